"""Worker process for tests/test_removal_crash.py: run one real kvtool operation and SIGKILL
itself at a chosen point between two of its steps, so the kill lands there every time.

Usage:
    python -m tests.kill_worker first-write CACHE_DIR
        open the default test namespace (`tests.store_helpers.open_store`) and save a chain; the
        process kills itself when the store is about to commit the segment's rows: the segment
        file is in place, the index has no row (a cache killed during its very first write).
    python -m tests.kill_worker unlink CACHE_DIR KVTOOL_ARGS...
        run the kvtool CLI with `KVTOOL_ARGS` (e.g. `prune --max-bytes 0 --yes`); the process
        kills itself when the command is about to unlink its first segment file (after the rows
        were deleted and committed, before any file is gone).
    python -m tests.kill_worker rm-prompt CACHE_DIR HASH...
        remove a prompt's blocks (`kvtool.ops.remove.remove_prompt`, what `kvtool rm --prompt`
        runs once the prompt is hashed; here the chain hashes are given, so no model is
        loaded), killed at the first segment unlink as above.

Only the kill is added (a wrapper around the real method): the real files, SQLite index and
commands run unchanged. Exits 3 if the kill point was never reached.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def _kill_before(cls, name: str) -> None:
    """SIGKILL this process when `cls.name` is first called (before it runs)."""

    def die(*_args, **_kw):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(cls, name, die)


def main(argv: list[str]) -> int:
    mode, cache_dir = argv[0], Path(argv[1])
    if mode == "first-write":
        import numpy as np

        from kvtool.disk.index import BlockIndex
        from tests.store_helpers import make_chain, open_store

        store = open_store(cache_dir)
        _kill_before(BlockIndex, "insert_segment")
        store.save_blocks(make_chain(store.layout_key, np.arange(8)))
        return 3
    from kvtool.disk.confined import ConfinedDir

    _kill_before(ConfinedDir, "unlink_segment")
    if mode == "unlink":
        from kvtool.cli import app

        sys.argv = ["kvtool", *argv[2:], "--cache-dir", str(cache_dir)]
        try:
            app.main()
        except SystemExit:
            pass
        return 3
    if mode == "rm-prompt":
        from kvtool.ops.remove import PromptKeys, remove_prompt
        from tests.store_helpers import GEOMETRY, make_layout

        keys = PromptKeys(make_layout(), GEOMETRY["block_size"], tuple(argv[2:]))
        remove_prompt(cache_dir, lambda _bs: keys, [GEOMETRY["block_size"]])
        return 3
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
