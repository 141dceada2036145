"""Shared fixtures. Embedded models are built once into `<repo>/.cache/test-models` and reused."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_MODELS_DIR = REPO_ROOT / ".cache" / "test-models"

# Set before any kvtool import resolves a model, so tests never touch ~/.cache/kvtool-models.
os.environ["KVTOOL_MODELS_DIR"] = str(TEST_MODELS_DIR)
# A test that forgets --cache-dir must never write into the user's ~/.cache/kvtool.
os.environ["KVTOOL_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvtool-test-cache-")
# Settings come from KVTOOL_<FIELD> variables and ~/.config/kvtool/config.toml too: a developer's
# shell or config file must not change what the tests see (tests that need them set their own).
for _name in [n for n in os.environ if n.startswith("KVTOOL_") and n not in ("KVTOOL_MODELS_DIR", "KVTOOL_CACHE_DIR")
              and not n.startswith("KVTOOL_TEST_") and n not in ("KVTOOL_SOAK_SECONDS",)]:
    del os.environ[_name]
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="kvtool-test-xdg-")
os.chmod(os.environ["XDG_CONFIG_HOME"], 0o755)  # empty; tests that run kvtool as another user look in it too


@pytest.fixture(scope="session")
def tiny_model():
    """The embedded `tiny` preset, loaded once per session (a `LoadedModel`)."""
    from kvtool.models.loader import load_model

    return load_model("tiny")


@pytest.fixture
def read_only_dir(tmp_path):
    """An empty directory on a read-only bind mount of itself (where a write fails with EROFS even
    for root, who passes every permission check); skipped where mounting is not allowed (needs
    root or CAP_SYS_ADMIN: a container without it, macOS)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    res = subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here (needs root / CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
