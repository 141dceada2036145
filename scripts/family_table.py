"""Write docs/models.md: the family matrix (tests/zoo_matrix.py) run over every model type of the
pinned mlx-lm, rendered as a table of families, cache types and what kvtool does with them.

    .venv/bin/python scripts/family_table.py            # run the matrix, write docs/models.md
    .venv/bin/python scripts/family_table.py --check    # exit 1 if docs/models.md is out of date
    .venv/bin/python scripts/family_table.py --only gpt_oss qwen3_next   # print these rows only

Models are built (or reused) under .cache/test-zoo; every family runs in a temporary cache
directory. The same rows are produced by `pytest tests/test_zoo_matrix.py` (which checks the file).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from tests import model_zoo, zoo_matrix

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/models.md instead of writing it")
    ap.add_argument("--only", nargs="*", help="run these families only and print their rows")
    args = ap.parse_args(argv)
    families = args.only or model_zoo.all_families()
    results = []
    t0 = time.perf_counter()
    for fam in families:
        try:
            path = model_zoo.family_dir(fam)
        except model_zoo.NotBuildable as exc:
            results.append(zoo_matrix.not_buildable_result(fam, str(exc)))
            continue
        with tempfile.TemporaryDirectory(prefix="kvtool-matrix-") as tmp:
            results.append(zoo_matrix.check_family(fam, path, Path(tmp)))
        print(f"{fam}: {results[-1].status}", file=sys.stderr, flush=True)
    text = zoo_matrix.render(results)
    print(f"{len(results)} families in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.only:
        print("\n".join(zoo_matrix.row_of(r) for r in results))
        return 0
    if args.check:
        same = zoo_matrix.MODELS_MD.exists() and zoo_matrix.MODELS_MD.read_text(encoding="utf-8") == text
        print("docs/models.md is " + ("up to date" if same else "out of date"), file=sys.stderr)
        return 0 if same else 1
    zoo_matrix.MODELS_MD.write_text(text, encoding="utf-8")
    print(f"wrote {zoo_matrix.MODELS_MD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
