"""Cache directories get an explicit mode whatever the process umask (0o700 by default,
`ssd_dir_mode` for a group-shared cache), in a real subprocess run under umask 000."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_dir()}


def _serve(cache: Path, *extra: str) -> None:
    code = "import os, sys; os.umask(0); sys.argv = ['kvtool', *sys.argv[1:]]; from kvtool.cli.app import main; main()"
    res = subprocess.run([sys.executable, "-c", code, "serve-once", "--prompt", "hello there, general kenobi", "--max-tokens", "2",
                          "--cache-dir", str(cache), "--sync", *extra], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
def test_umask_000_still_gives_private_directories(tmp_path):
    cache = tmp_path / "kv"
    _serve(cache)
    modes = _modes(cache)
    assert modes and all(m == 0o700 for m in modes.values()), modes  # namespace and fan-out dirs


@pytest.mark.slow
def test_group_shared_mode_from_the_config(tmp_path):
    cfg = tmp_path / "kvtool.toml"
    cfg.write_text("ssd_dir_mode = 0o2770\n")
    cache = tmp_path / "kv"
    _serve(cache, "--config", str(cfg))
    modes = _modes(cache)
    assert modes and all(m == 0o2770 for m in modes.values()), {k: oct(v) for k, v in modes.items()}
    assert not any(m & stat.S_IWOTH for m in modes.values()) and os.stat(cache).st_mode
