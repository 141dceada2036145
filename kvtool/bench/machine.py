"""Machine description recorded in `run.json`: CPU, cores, RAM, cache disk and file system,
versions of python / mlx / mlx-lm / kvtool, and the git commit of the working tree.

Everything is read from files and the standard library (no subprocess, no git binary): a field that
cannot be determined is None.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("mlx", "mlx-lm", "kvtool", "numpy", "pandas")


def machine_info(cache_dir: Path) -> dict[str, Any]:
    """This machine and the disk holding `cache_dir` (the run's cache root; need not exist yet:
    its nearest existing parent is used), as a JSON-serialisable dict."""
    return {
        "hostname": platform.node(),
        "os": platform.platform(),
        "arch": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "ram_bytes": total_ram_bytes(),
        "load_avg": load_average(),
        "cache_disk": disk_info(cache_dir),
        "versions": {"python": platform.python_version(), **package_versions()},
    }


def load_average(digits: int | None = None) -> list[float] | None:
    """1, 5 and 15-minute load averages, rounded to `digits` if given (None where unavailable)."""
    try:
        return [x if digits is None else round(x, digits) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def listen_overflows() -> int | None:
    """This host's count of connections dropped because a listening socket's accept queue was full
    (Linux `/proc/net/netstat`, `TcpExt: ListenOverflows`; None elsewhere or when unreadable).

    System-wide and monotonic: take the difference of two reads around the work to attribute. A
    dropped connection is not refused: its client sends the SYN again after ~1 s (the initial
    retransmission timeout), so every drop adds about a second to that request's TTFT.
    """
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:") and values.startswith("TcpExt:"):
            fields = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            try:
                return int(fields["ListenOverflows"])
            except (KeyError, ValueError):
                return None
    return None


def cpu_model() -> str | None:
    """CPU model name (`/proc/cpuinfo` on Linux, `platform.processor()` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def total_ram_bytes() -> int | None:
    """Physical memory in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def package_versions() -> dict[str, str | None]:
    """Installed versions of `PACKAGES` (None if not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _existing(path: Path) -> Path:
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.resolve()


def disk_info(path: Path) -> dict[str, Any]:
    """Mount point, device, file-system type, sizes and (Linux) disk model of `path`'s disk."""
    path = _existing(path)
    info: dict[str, Any] = {"path": str(path)}
    try:
        st = os.statvfs(path)
        info["total_bytes"] = st.f_frsize * st.f_blocks
        info["free_bytes"] = st.f_frsize * st.f_bavail
    except OSError:
        pass
    mount = _mount_of(path)
    if mount:
        info.update(mount)
        info.update(_block_device(mount["device"]))
    return info


def _mount_of(path: Path) -> dict[str, str] | None:
    """The /proc/mounts entry with the longest mount point containing `path` (Linux only)."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        device, mount_point, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        if path == Path(mount_point) or Path(mount_point) in path.parents:
            if best is None or len(mount_point) > len(best["mount_point"]):
                best = {"device": device, "mount_point": mount_point, "filesystem": fstype}
    return best


def _block_device(device: str) -> dict[str, Any]:
    """Disk model and rotational flag from /sys/block for a /dev/ device (Linux only)."""
    name = Path(device).name
    sys_block = Path("/sys/class/block") / name
    if not device.startswith("/dev/") or not sys_block.exists():
        return {}
    disk = sys_block.resolve()
    if (disk / "partition").exists():
        disk = disk.parent
    out: dict[str, Any] = {"disk": disk.name}
    for key, rel in (("disk_model", "device/model"), ("rotational", "queue/rotational")):
        try:
            out[key] = (disk / rel).read_text().strip()
        except OSError:
            pass
    if "rotational" in out:
        out["rotational"] = out["rotational"] == "1"
    return out


def git_commit(start: Path | None = None) -> str | None:
    """Commit of the git work tree containing `start` (default: the kvtool source), read from
    `.git` files directly; None outside a work tree. A `-dirty` mark is not computed."""
    here = _existing(start or Path(__file__))
    for directory in (here, *here.parents):
        git = directory / ".git"
        if git.is_file():  # worktree / submodule: "gitdir: <path>"
            git = (directory / git.read_text().split(":", 1)[1].strip()).resolve()
        if git.is_dir():
            return _resolve_head(git)
    return None


def _resolve_head(git: Path) -> str | None:
    try:
        head = (git / "HEAD").read_text().strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head
    ref = head.split(":", 1)[1].strip()
    common = git
    if (git / "commondir").exists():
        common = (git / (git / "commondir").read_text().strip()).resolve()
    for base in (git, common):
        if (base / ref).is_file():
            return (base / ref).read_text().strip()
    try:
        for line in (common / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split(" ", 1)[0]
    except OSError:
        pass
    return None
