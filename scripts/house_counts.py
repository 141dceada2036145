"""The structure counts of a kvtool tree (docs/design.md#layout): lines, import cycles, imports up a layer,
long files and functions, accesses to another object's private members.

    .venv/bin/python scripts/house_counts.py            # this tree
    .venv/bin/python scripts/house_counts.py --json     # for scripts
    .venv/bin/python scripts/house_counts.py --tree /path/to/other/checkout

Import cycles and the layer rule are those of `tests/test_imports.py` (imports inside functions
and under TYPE_CHECKING count). A private access is `obj._name` where `obj` is not `self`,
`cls` or `super()`, or `from m import _name`, in a module other than the one defining the name;
namedtuple's `_replace`/`_asdict`/`_fields`/`_make` and `sys._getframe`/`os._exit` are public
API and not counted. Near-duplicate blocks are not counted here (a text-similarity tool's job).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_getframe", "_exit", "_field_defaults"}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _private_accesses(tree: ast.AST) -> int:
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            v = node.value
            own = (isinstance(v, ast.Name) and v.id in ("self", "cls")) or (
                isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super")
            if not own and node.attr not in PUBLIC_UNDERSCORE:
                n += 1
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            n += sum(1 for a in node.names if a.name.startswith("_") and not a.name.startswith("__"))
    return n


def counts(tree: Path) -> dict:
    """The counts for the checkout at `tree` (its `kvtool/` package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.test_imports import LAYERS, cycles, module_graph, part_of

    pkg = tree / "kvtool"
    files = sorted(pkg.rglob("*.py"))
    lines = {f: len(f.read_text().splitlines()) for f in files}
    c_lines = sum(len(f.read_text().splitlines()) for f in pkg.rglob("*.c"))
    long_funcs, private = [], {}
    for f in files:
        t = ast.parse(f.read_text())
        for node in ast.walk(t):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_funcs.append(f"{f.relative_to(tree)}:{node.name} {n}")
        if k := _private_accesses(t):
            private[str(f.relative_to(tree))] = k
    graph = module_graph(tree)
    rank = {name: r for r, names in enumerate(LAYERS) for name in names}
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                if (a := part_of(m)) and (b := part_of(d)) and a != b and a in rank and b in rank
                and rank[b] >= rank[a])  # fmt: skip
    return {
        "python_lines": sum(lines.values()),
        "c_lines": c_lines,
        "import_cycles": [sorted(c) for c in cycles(graph)],
        "imports_up_a_layer": up,
        "files_over_500_lines": sorted(f"{f.relative_to(tree)} {n}" for f, n in lines.items() if n > MAX_FILE_LINES),
        "functions_over_60_lines": sorted(long_funcs),
        "private_accesses": sum(private.values()),
        "private_access_files": private,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    c = counts(args.tree.resolve())
    if args.json:
        print(json.dumps(c, indent=2))
        return
    print(f"library lines: {c['python_lines']:,} Python + {c['c_lines']:,} C")
    print(f"import cycles: {len(c['import_cycles'])} {c['import_cycles']}")
    print(f"imports up a layer: {len(c['imports_up_a_layer'])}")
    print(f"files over 500 lines: {len(c['files_over_500_lines'])}")
    print(f"functions over 60 lines: {len(c['functions_over_60_lines'])}")
    print(f"private accesses: {c['private_accesses']} in {len(c['private_access_files'])} files")


if __name__ == "__main__":
    main()
