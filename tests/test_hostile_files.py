"""Hostile files, read-only and symlinked caches, full disks, root in a user's cache.

Every case uses real files, real processes and real permissions: a FIFO planted where a segment
was; a `chmod a-w` cache, a root-owned 0755 cache and a read-only bind mount (served through
an unprivileged user via `setpriv`, or as root on the mount); a symlinked cache root; a cache
directory that does not exist yet; a group/other-writable `ssd_dir_mode`; a nearly full tmpfs;
hostile `--cache-dir` values and a binary sweep file; a record swap inside a segment; root
writing into a user's cache. Whatever happens, the output tokens equal the uncached ones.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.config import ConfigError, KVToolConfig
from kvtool.disk.confined import ConfinedDir
from kvtool.disk.fsops import FileOps, NotRegularFileError
from kvtool.disk.names import segment_relpath
from kvtool.ops.scan import scan_cache
from kvtool.ops.validate import validate
from tests.store_helpers import make_chain, mounted_tmpfs, open_store, record_span, segment_path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "kvtool" / "assets" / "demo_prompt.txt"
NOBODY = 65534
HANG_GUARD_S = 300  # a subprocess that hangs fails the test instead of the suite (not a timing check)
if not app_module.app.registered_commands:
    app_module._register()
runner = CliRunner()


# ----------------------------------------------------------------------------- helpers
def kvtool(*args: str, user: int | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a fresh process (as `user` through `setpriv` if given)."""
    cmd = [sys.executable, "-m", "kvtool.cli.app", *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    full_env = {**os.environ, **(env or {})}
    if user is not None:
        full_env["HOME"] = full_env.get("KVTOOL_TEST_HOME", "/tmp")
    # another user runs from "/": a model spec such as `tiny` is first looked up as a directory in the cwd
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO if user is None else "/", timeout=HANG_GUARD_S,
                          env=full_env)  # fmt: skip


def serve(cache: Path, prompt: Path, *extra: str, user: int | None = None) -> dict:
    """`serve-once --json` of one prompt file; the parsed document (exit 0 asserted)."""
    res = kvtool("serve-once", "--json", "--prompt-file", str(prompt), "--max-tokens", "4", "--cache-dir", str(cache),
                 *extra, user=user)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def cli(*args: str):
    return runner.invoke(app_module.app, list(args))


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under `root`: (mode, content of regular files), SQLite's -wal/-shm aside."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.name.endswith(("-wal", "-shm")):
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, p.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return out


def owners(root: Path) -> set[int]:
    return {p.lstat().st_uid for p in [root, *root.rglob("*")]}


def rows(cache: Path) -> int:
    total = 0
    for db in cache.glob("*/index.sqlite"):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            total += con.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
    return total


@pytest.fixture(scope="module")
def prompts() -> Iterator[Path]:
    """A world-readable directory with prompt files: `short.txt` (a prefix of) `long.txt`."""
    d = Path(tempfile.mkdtemp(prefix="kvtool-hostile-"))
    os.chmod(d, 0o755)
    text = DEMO.read_text(encoding="utf-8")
    (d / "short.txt").write_text(text[:1500], encoding="utf-8")
    (d / "long.txt").write_text(text[:3000], encoding="utf-8")
    for f in d.iterdir():
        os.chmod(f, 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(prompts) -> dict[str, list[int]]:
    """Uncached greedy tokens of each prompt (the output every cached run must equal)."""
    out = {}
    for name in ("short", "long"):
        doc = serve(prompts / "nossd", prompts / f"{name}.txt", "--no-ssd")
        out[name] = doc["requests"][0]["token_ids"]
    return out


@pytest.fixture
def shared_dir(prompts) -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="case-", dir=prompts))
    os.chmod(d, 0o755)
    yield d
    for p in [d, *d.rglob("*")]:  # undo chmod a-w so it can be removed
        if p.is_dir() and not p.is_symlink():
            os.chmod(p, 0o755)
    shutil.rmtree(d, ignore_errors=True)


def _unprivileged_ok(prompts: Path) -> str | None:
    """Why an unprivileged user cannot run kvtool here (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to switch to an unprivileged user"
    if shutil.which("setpriv") is None:
        return "setpriv is not installed"
    res = kvtool("--version", user=NOBODY)
    return None if res.returncode == 0 else f"uid {NOBODY} cannot run kvtool here: {res.stderr.strip()[-200:]}"


# ----------------------------------------------------------------------------- 1: a FIFO
def test_fifo_is_never_opened_by_file_ops(tmp_path):
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFileError):
        FileOps().open_read(fifo)
    cache = tmp_path / "kv"
    store = open_store(cache)
    chain = make_chain(store.layout_key, range(12))
    assert store.save_blocks(chain) == ["saved"] * 3
    name = store.index.get(chain[0].block_hash).segment
    path = segment_path(store, name)
    path.unlink()
    os.mkfifo(path)
    with ConfinedDir(cache, store.layout_key) as cdir, pytest.raises(OSError, match="not a regular file"):
        cdir.open_segment(name)
    assert store.open_segment(name) is None  # a miss, never a hang
    assert store.stats()["ssd_load_corrupt"] == 1 and store.index.get(chain[0].block_hash) is not None  # left for validate
    # a recomputed block replaces the rows that point at the FIFO (not dropped as duplicates)
    assert store.save_blocks(chain) == ["saved"] * 3 and store.index.get(chain[0].block_hash).segment != name
    store.close()


@pytest.mark.slow
def test_fifo_in_place_of_a_segment(prompts, reference, tmp_path):
    cache = tmp_path / "kv"
    serve(cache, prompts / "long.txt", "--sync")
    (seg,) = cache.glob("*/*/*.safetensors")
    seg.unlink()
    os.mkfifo(seg)

    doc = serve(cache, prompts / "long.txt", "--sync")  # would hang forever in open() before
    (req,) = doc["requests"]
    assert req["token_ids"] == reference["long"] and req["cached_tokens"] == 0
    assert doc["stats"]["ssd_load_corrupt"] == 1 and req["blocks_written"] == doc["stats"]["ssd_save_success"] > 0
    assert stat.S_ISFIFO(seg.lstat().st_mode)  # the serving process removes nothing: validate does

    checked = kvtool("validate", "--json", "--cache-dir", str(cache))
    assert checked.returncode == 1, checked.stderr
    (ns,) = json.loads(checked.stdout)["namespaces"]
    assert ns["irregular"] == [segment_relpath(seg.stem)] and ns["irregular_removed"] == 1
    assert ns["broken_chain_removed"] == 0 and ns["corrupt_removed"] == 0  # the rows were stored anew
    assert not os.path.lexists(seg)
    assert kvtool("validate", "--cache-dir", str(cache)).returncode == 0  # clean now
    again = serve(cache, prompts / "long.txt")
    assert again["requests"][0]["token_ids"] == reference["long"] and again["requests"][0]["ssd_hit_tokens"] > 0


def test_validate_removes_a_fifo_whose_rows_have_no_copy(tmp_path):
    cache = tmp_path / "kv"
    store = open_store(cache)
    chain = make_chain(store.layout_key, range(12))
    store.save_blocks(chain)
    store.close()
    (seg,) = cache.glob("*/*/*.safetensors")
    seg.unlink()
    os.mkfifo(seg)
    assert scan_cache(cache).namespaces[0].irregular == (segment_relpath(seg.stem),)
    dry = validate(cache, dry_run=True)
    (ns,) = dry.namespaces
    assert ns.corrupt_removed == 3 and ns.missing_rows_dropped == 0 and ns.irregular_removed == 1
    assert stat.S_ISFIFO(seg.lstat().st_mode)
    done = validate(cache)
    assert done.namespaces[0].unlink_failed == 0 and not os.path.lexists(seg) and rows(cache) == 0
    assert validate(cache).problems == 0


# ----------------------------------------------------------------------------- 2: read-only caches
@pytest.mark.slow
def test_chmod_a_w_cache_serves_verified_hits(prompts, reference, shared_dir):
    why = _unprivileged_ok(prompts)
    if why:
        pytest.skip(why)
    cache = shared_dir / "kv"
    os.chown(shared_dir, NOBODY, NOBODY)
    serve(cache, prompts / "short.txt", "--sync", user=NOBODY)
    subprocess.run(["chmod", "-R", "a-w", str(cache)], check=True)
    before = tree(cache)
    doc = serve(cache, prompts / "long.txt", user=NOBODY)
    (req,) = doc["requests"]
    assert req["token_ids"] == reference["long"]
    assert req["ssd_hit_tokens"] > 0 and req["blocks_written"] == 0
    assert "read-only" in doc["ssd_disabled_reason"] and doc["stats"]["ssd_save_success"] == 0
    assert tree(cache) == before
    for cmd in (["validate", "--dry-run", "--json"], ["inspect", "--json"]):
        res = kvtool(*cmd, "--cache-dir", str(cache), user=NOBODY)
        assert res.returncode == 0, res.stdout + res.stderr
        assert json.loads(res.stdout)["namespaces"][0]["status"] == "ok"


@pytest.mark.slow
def test_root_owned_cache_serves_another_user(prompts, reference, shared_dir):
    why = _unprivileged_ok(prompts)
    if why:
        pytest.skip(why)
    cache = shared_dir / "kv"
    conf = shared_dir / "kvtool.toml"
    conf.write_text('ssd_dir_mode = "0755"\n')
    os.chmod(conf, 0o644)
    serve(cache, prompts / "short.txt", "--sync", "--config", str(conf))  # as root: 0755 dirs, 0644 files
    before = tree(cache)
    doc = serve(cache, prompts / "long.txt", user=NOBODY)
    (req,) = doc["requests"]
    assert req["token_ids"] == reference["long"] and req["ssd_hit_tokens"] > 0 and req["blocks_written"] == 0
    assert tree(cache) == before and owners(cache) == {0}


@pytest.mark.slow
def test_read_only_bind_mount_serves_verified_hits(prompts, reference, tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    cache, ro = tmp_path / "kv", tmp_path / "ro"
    serve(cache, prompts / "short.txt", "--sync")
    ro.mkdir()
    res = subprocess.run(["mount", "--bind", str(cache), str(ro)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"mount --bind refused here: {res.stderr.strip()}")
    try:
        res = subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"remount read-only refused here: {res.stderr.strip()}")
        before = tree(cache)
        doc = serve(ro, prompts / "long.txt")
        (req,) = doc["requests"]
        assert req["token_ids"] == reference["long"] and req["ssd_hit_tokens"] > 0 and req["blocks_written"] == 0
        assert "read-only" in doc["ssd_disabled_reason"]
        assert tree(cache) == before
        checked = kvtool("validate", "--dry-run", "--json", "--cache-dir", str(ro))
        assert checked.returncode == 0 and json.loads(checked.stdout)["namespaces"][0]["status"] == "ok", checked.stdout
    finally:
        if subprocess.run(["umount", str(ro)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)


# ----------------------------------------------------------------------------- 3: symlinked root
@pytest.mark.slow
def test_symlinked_cache_root_works_in_every_command(prompts, reference, tmp_path):
    real, link = tmp_path / "ssd" / "kvtool", tmp_path / "link"
    real.mkdir(parents=True)
    link.symlink_to(real, target_is_directory=True)
    doc = serve(link, prompts / "short.txt", "--sync")
    assert doc["requests"][0]["token_ids"] == reference["short"]
    (ns,) = scan_cache(real).namespaces
    resolved = str(real.resolve())
    for args in (["validate", "--json"], ["inspect", "--json"], ["prune", "--json", "--dry-run"]):
        res = cli(*args, "--cache-dir", str(link))
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["cache_dir"] == resolved
    human = cli("inspect", "--cache-dir", str(link))
    assert human.exit_code == 0 and resolved in human.stdout.replace("\n", "")
    # symlinks inside the cache stay refused: a symlinked namespace is never followed
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(real / ns.name, elsewhere)
    (real / ("f" * 32)).symlink_to(elsewhere, target_is_directory=True)
    res = cli("validate", "--json", "--cache-dir", str(link))
    assert res.exit_code == 1 and json.loads(res.stdout)["symlinks"] == ["f" * 32]
    (real / ("f" * 32)).unlink()
    removed = cli("rm", ns.name[:12], "--yes", "--json", "--cache-dir", str(link))
    assert removed.exit_code == 0, removed.output
    assert json.loads(removed.stdout)["cache_dir"] == resolved and not (real / ns.name).exists()
    assert link.is_symlink() and elsewhere.exists()


# ----------------------------------------------------------------------------- 4: not there yet
@pytest.mark.parametrize("args", [["validate"], ["validate", "--json"], ["inspect"], ["inspect", "--json"],
                                  ["prune", "--yes"], ["prune", "--dry-run", "--json"], ["rm", "abcdef0123", "--yes"]])
def test_cache_dir_that_does_not_exist_yet_is_an_error_unless_created(tmp_path, args):
    """A named cache directory that does not exist is one `error:` line, exit 2, nothing created
    (a mistyped path in cron must not pass as an empty cache); with `--create` it is made and is
    an empty cache."""
    absent = tmp_path / "not" / "yet"
    res = cli(*args, "--cache-dir", str(absent))
    assert res.exit_code == 2 and "does not exist" in one_error_line(res) and not (tmp_path / "not").exists()
    if args[0] == "rm":  # an empty cache has no namespace to remove: exit 2 either way
        return
    res = cli(*args, "--cache-dir", str(absent), "--create")
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output and absent.is_dir()
    if "--json" in args:
        doc = json.loads(res.stdout)
        assert doc["cache_dir"] == str(absent) and doc["namespaces"] == []


def test_cache_dir_that_is_a_file_is_an_error(tmp_path):
    (tmp_path / "file").write_text("x")
    for cmd in (["validate"], ["inspect"], ["prune", "--yes"], ["rm", "abcdef0123", "--yes"]):
        assert "not a directory" in one_error_line(cli(*cmd, "--cache-dir", str(tmp_path / "file")))


# ----------------------------------------------------------------------------- 5: ssd_dir_mode
@pytest.mark.parametrize("mode", ["511", "0o777", "0o702", '"0770"', "0o757"])
def test_dir_mode_with_write_bits_for_others_is_refused(tmp_path, mode):
    conf = tmp_path / "kvtool.toml"
    conf.write_text(f"ssd_dir_mode = {mode}\n")
    for args in (["validate"], ["serve-once", "-p", "hello"]):
        line = one_error_line(cli(*args, "--config", str(conf), "--cache-dir", str(tmp_path / "kv")))
        assert "ssd_dir_mode" in line, line
    assert not (tmp_path / "kv").exists()
    with pytest.raises(ConfigError, match="write"):
        KVToolConfig(ssd_cache_dir=tmp_path, ssd_dir_mode=0o777)
    assert KVToolConfig(ssd_cache_dir=tmp_path, ssd_dir_mode=0o2770).ssd_dir_mode == 0o2770  # a group-shared cache


# ----------------------------------------------------------------------------- 6: a nearly full disk
class BudgetFS(FileOps):
    """Real file operations on a disk that holds `budget` more bytes of segment data: a write
    beyond it fails with ENOSPC (as the kernel's), after writing nothing."""

    def __init__(self, budget: int):
        self.budget = budget
        self.attempts: list[int] = []
        self._lock = threading.Lock()

    def write_all(self, fd, data) -> None:
        size = sum(memoryview(b).nbytes for b in data) if isinstance(data, (list, tuple)) else memoryview(data).nbytes
        with self._lock:
            self.attempts.append(size)
            if size > self.budget:
                raise OSError(errno.ENOSPC, "No space left on device (test budget)")
            self.budget -= size
        super().write_all(fd, data)


def test_full_disk_saves_the_blocks_that_fit(tmp_path):
    fs = BudgetFS(1 << 30)
    store = open_store(tmp_path / "kv", fs=fs)
    chain = make_chain(store.layout_key, range(4 * 16), seed=3)  # 16 blocks, one write batch
    one = store.save_blocks(chain[:1])  # measures one block's segment
    assert one == ["saved"]
    fs.budget = 5 * fs.attempts[0]  # room for ~5 single-block segments (fewer with a bigger header)
    out = store.save_blocks(chain[1:])
    saved = out.count("saved")
    assert 0 < saved < 15 and out == ["saved"] * saved + ["error"] * (15 - saved)  # a prefix of the chain
    st = store.stats()
    assert st["ssd_save_success"] == 1 + saved and st["ssd_save_fail"] == 15 - saved
    assert store.saved_count(b.block_hash for b in chain) == 1 + saved
    assert store.count_prefix([b.block_hash for b in chain]) == 1 + saved
    assert not list((tmp_path / "kv").rglob("*.tmp"))
    store.close()
    assert validate(tmp_path / "kv").problems == 0  # nothing orphaned, nothing unreachable


@pytest.mark.slow
def test_nearly_full_tmpfs_keeps_what_fits(prompts, reference, tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "16m") as mnt:
        cache = mnt / "kv"
        serve(cache, prompts / "short.txt", "--sync", "--block-size", "16")  # the namespace and its index exist
        stored_before = rows(cache)
        filler = mnt / "filler"
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        with open(filler, "wb") as fh:  # leave ~200 KiB: a part of the long prompt's new blocks fits
            fh.write(b"\0" * max(0, free - (200 << 10)))
        doc = serve(cache, prompts / "long.txt", "--sync", "--block-size", "16")
        (req,) = doc["requests"]
        st = doc["stats"]
        assert req["token_ids"] == reference["long"]
        assert st["ssd_save_success"] > 0 and st["ssd_save_fail"] > 0  # some fit, the rest failed
        assert req["blocks_written"] == st["ssd_save_success"] == rows(cache) - stored_before
        filler.unlink()
        checked = kvtool("validate", "--json", "--cache-dir", str(cache))
        assert checked.returncode == 0, checked.stdout + checked.stderr  # no orphan, no broken chain


# ----------------------------------------------------------------------------- 7: one error line
@pytest.mark.parametrize("command", [["validate"], ["prune", "--yes"], ["inspect"], ["rm", "abcdef0123", "--yes"]])
def test_hostile_cache_dir_values_are_one_error_line(tmp_path, command):
    long_path = "/tmp/" + "a" * 5000
    line = one_error_line(cli(*command, "--cache-dir", long_path))
    assert "too long" in line and len(line) < 300
    line = one_error_line(cli(*command, "--cache-dir", str(tmp_path / ("b" * 300) / "kv")))
    assert "too long" in line
    line = one_error_line(cli(*command, "--cache-dir", ""))
    assert "--cache-dir" in line and "empty" in line


def test_cache_dir_empty_string_is_refused_for_serving(tmp_path):
    assert "empty" in one_error_line(cli("serve-once", "-p", "hello", "--cache-dir", ""))
    assert "empty" in one_error_line(cli("warm", str(tmp_path / "p.txt"), "--cache-dir", ""))


@pytest.mark.slow
def test_binary_sweep_file_is_one_error_line(tmp_path):
    blob = tmp_path / "sweep.toml"
    blob.write_bytes(bytes(range(256)) * 8)
    res = kvtool("bench", str(blob))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "UTF-8" in lines[0] and "Traceback" not in res.stderr


# ----------------------------------------------------------------------------- 8: record swap
def test_record_swap_recomputed_blocks_replace_the_damaged_rows(tmp_path):
    """Records k and k+1 swapped in a segment (header intact): k fails its checksum and is
    dropped; k+1's row still points at the swapped bytes. The recomputed blocks must replace
    those rows, so that validate then loses no intact descendant."""
    from kvtool.disk.restore import restore_chain

    cache = tmp_path / "kv"
    store = open_store(cache)
    chain = make_chain(store.layout_key, range(4 * 40), seed=7)  # 40 blocks in one segment
    assert store.save_blocks(chain) == ["saved"] * 40
    path = segment_path(store, store.index.get(chain[0].block_hash).segment)
    k = 5
    (a, n), (b, m) = record_span(path, chain[k].block_hash), record_span(path, chain[k + 1].block_hash)
    data = bytearray(path.read_bytes())
    data[a : a + n], data[b : b + m] = data[b : b + m], data[a : a + n]
    path.write_bytes(bytes(data))
    store.close()

    store = open_store(cache)  # a new process
    ids = np.arange(4 * 40, dtype=np.int32)
    kv = store.expected.kv
    bufs = [np.zeros((1, *s[1:2], 4 * 40, s[3]), dtype=st) for s, st in zip(kv.shapes(1), kv.storage_dtypes())]
    from kvtool.disk.segment import HeadPieces

    pieces = HeadPieces(bufs)
    rows_ = store.lookup([blk.block_hash for blk in chain])
    result = restore_chain(store, rows_, chain[0].parent_hash, ids, [4 * i for i in range(40)],
                           lambda off, n: pieces(off, n), parallel=False)  # fmt: skip
    assert result.n_ok == k and store.stats()["ssd_load_corrupt"] == 1
    assert store.index.get(chain[k].block_hash) is None and store.index.get(chain[k + 1].block_hash) is not None
    out = store.save_blocks(chain[k:])  # the request recomputed them: they are stored again
    assert out == ["saved"] * (40 - k)
    assert all(store.index.get(blk.block_hash).segment != path.stem for blk in chain[k:])
    store.close()
    rep = validate(cache)
    (ns,) = rep.namespaces
    assert ns.broken_chain_removed == 0 and ns.corrupt_removed == 0 and rows(cache) == 40
    store = open_store(cache)
    assert store.count_prefix([blk.block_hash for blk in chain]) == 40
    for blk in chain[k : k + 2]:
        got = store.load_block(blk.block_hash, blk.token_ids, blk.parent_hash)
        assert got is not None and all(np.array_equal(x, y) for x, y in zip(got.keys, blk.keys))
    store.close()


# ----------------------------------------------------------------------------- 9: root in a user's cache
@pytest.mark.slow
def test_root_writing_into_a_users_cache_leaves_it_prunable(prompts, reference, shared_dir):
    why = _unprivileged_ok(prompts)
    if why:
        pytest.skip(why)
    cache = shared_dir / "kv"
    cache.mkdir(mode=0o700)
    os.chown(cache, NOBODY, NOBODY)
    doc = serve(cache, prompts / "long.txt", "--sync")  # as root
    assert doc["requests"][0]["token_ids"] == reference["long"] and doc["requests"][0]["blocks_written"] > 0
    assert kvtool("validate", "--cache-dir", str(cache)).returncode == 0  # as root: creates the lock file
    assert owners(cache) == {NOBODY}, {str(p): p.lstat().st_uid for p in cache.rglob("*") if p.lstat().st_uid != NOBODY}
    pruned = kvtool("prune", "--yes", "--max-bytes", "0", "--json", "--cache-dir", str(cache), user=NOBODY)
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert not list(cache.rglob("*.safetensors"))
    again = serve(cache, prompts / "long.txt", "--sync", user=NOBODY)  # the user can write it again
    assert again["requests"][0]["blocks_written"] > 0


def test_dir_owner_is_only_for_root(tmp_path):
    from kvtool.disk.fsops import dir_owner

    owned = dir_owner(tmp_path)
    if os.geteuid() != 0:
        assert owned is None
    else:
        assert owned is None  # root's own directory: nothing to change
        os.chown(tmp_path, NOBODY, NOBODY)
        assert dir_owner(tmp_path) == (NOBODY, NOBODY)
        sub = tmp_path / "a" / "b"
        FileOps().makedirs(sub)
        fd = FileOps().open_new(sub / "f")
        os.close(fd)
        assert {p.lstat().st_uid for p in (tmp_path / "a", sub, sub / "f")} == {NOBODY}
        assert stat.S_IMODE((tmp_path / "a").lstat().st_mode) == 0o700



# ---------------------------- a FIFO beside the index (hostile round 3, finding 2)
@pytest.mark.parametrize("suffix", ["-journal", "-wal", "-shm"])
def test_a_fifo_beside_the_index_is_never_opened(tmp_path, suffix):
    """SQLite opens the index's side files without O_NONBLOCK: a FIFO at `index.sqlite-journal`
    hung every command on the cache, `validate` included. Now no `BlockIndex` is opened while one
    of them is not a regular file (a `sqlite3.Error`, so every caller treats the index as
    unreadable), and the scan says which file."""
    cache = tmp_path / "kv"
    store = open_store(cache)
    assert store.save_blocks(make_chain(store.layout_key, range(8))) == ["saved"] * 2
    ns_dir = store.namespace_dir
    store.close()
    side = ns_dir / f"index.sqlite{suffix}"
    side.unlink(missing_ok=True)
    os.mkfifo(side)
    from kvtool.disk.index import BlockIndex

    for read_only in (True, False):
        with pytest.raises(sqlite3.Error, match="not a regular file"):
            BlockIndex(ns_dir / "index.sqlite", create=False, read_only=read_only)
    for args in (["validate", "--dry-run", "--json"], ["inspect", "--json"], ["prune", "--dry-run", "--max-bytes", "1KB", "--json"]):
        res = kvtool(*args, "--cache-dir", str(cache))  # hung in open() before: HANG_GUARD_S fails it
        assert "Traceback" not in res.stderr, res.stderr
    (ns,) = json.loads(kvtool("inspect", "--json", "--cache-dir", str(cache)).stdout)["namespaces"]
    assert ns["status"] == "unreadable" and f"index.sqlite{suffix}" in ns["message"]
    assert stat.S_ISFIFO(side.lstat().st_mode)  # only read so far: left where it is


# ------------------ an index file that is not a file, repaired (hostile round 3, findings 2 and 10)
@pytest.mark.parametrize(("suffix", "kind"), [("-journal", "fifo"), ("-wal", "fifo"), ("-shm", "directory"),
                                              ("", "fifo"), ("", "directory")])  # fmt: skip
def test_validate_moves_an_irregular_index_file_aside_and_nothing_is_lost(tmp_path, suffix, kind):
    """A FIFO, directory (or device) at `index.sqlite` or one of its side files disabled the
    namespace for good: every command left it untouched. A repairing `validate` renames it to
    `<name>.irregular` (never deleting it: kvtool did not write it); a side file moved leaves the
    index as it was, the index itself moved is rebuilt from the segment files: every block is
    there again and the namespace is `ok`. A dry run only says so."""
    cache = tmp_path / "kv"
    store = open_store(cache)
    assert store.save_blocks(make_chain(store.layout_key, range(16))) == ["saved"] * 4
    ns_dir = store.namespace_dir
    store.close()
    planted = ns_dir / f"index.sqlite{suffix}"
    if suffix == "":
        os.replace(planted, tmp_path / "old-index")  # the database itself: replaced by the planted entry
    planted.unlink(missing_ok=True)
    os.mkfifo(planted) if kind == "fifo" else planted.mkdir()
    dry = json.loads(kvtool("validate", "--dry-run", "--json", "--cache-dir", str(cache)).stdout)
    assert dry["namespaces"][0]["status"] == "unreadable"
    assert planted.exists() and not planted.is_file()  # a dry run changes nothing
    res = kvtool("validate", "--json", "--cache-dir", str(cache))
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr
    (rep,) = json.loads(res.stdout)["namespaces"]
    assert rep["irregular_removed"] == 1 and any(f"index.sqlite{suffix}" in d and "moved aside" in d for d in rep["details"])
    aside = ns_dir / f"index.sqlite{suffix}.irregular"
    assert (stat.S_ISFIFO if kind == "fifo" else stat.S_ISDIR)(aside.lstat().st_mode)  # kept, never opened
    assert not planted.exists() or planted.is_file()  # gone, or a new side file SQLite made
    if suffix == "":  # no meta to salvage (the database was replaced): the next open completes it
        assert rep["index_rebuilt"] and rep["blocks_recovered"] == 4
        reopened = open_store(cache)
        assert reopened.enabled and reopened.count_prefix([b.block_hash for b in make_chain(reopened.layout_key, range(16))]) == 4
        reopened.close()
    (ns,) = json.loads(kvtool("inspect", "--json", "--cache-dir", str(cache)).stdout)["namespaces"]
    assert ns["status"] == "ok" and ns["blocks"] == 4, ns
    again = json.loads(kvtool("validate", "--json", "--cache-dir", str(cache)).stdout)
    assert again["namespaces"][0]["outcome"] == "clean", again


@pytest.mark.slow
def test_serving_with_a_fifo_at_the_journal_answers_uncached(prompts, reference, tmp_path):
    cache = tmp_path / "kv"
    serve(cache, prompts / "long.txt", "--sync")
    (ns_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    os.mkfifo(ns_dir / "index.sqlite-journal")
    doc = serve(cache, prompts / "long.txt")  # hung before the first token
    (req,) = doc["requests"]
    assert req["token_ids"] == reference["long"] and req["cached_tokens"] == 0
