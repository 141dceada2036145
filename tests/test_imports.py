"""No import cycles among kvtool's modules, and the layering that keeps them out.

The module import graph is read from the source with `ast` (nothing is imported): one node per
module under `kvtool/` (a package is its `__init__`), one edge per import statement anywhere in a
module, including

- imports inside functions: a deferred import is still a dependency (it only moves the failure
  from import time to the first call), and it is how cycles usually hide;
- imports under `if TYPE_CHECKING:`: a class named in a signature is part of the module's
  contract, and mypy follows the import. Two modules whose contracts name each other are one
  module split in two files: the shared part belongs in a third module both import (for example
  `kvtool.disk.namespace_core` for `ssd` and `ssd_save`).

`from a.b import c` is an edge to `a.b.c` when that is a module, else to `a.b`; `import a.b.c` is
an edge to `a.b.c`. Importing a module is not counted as depending on its parent packages (every
import runs them, which would make each package a cycle with its own modules).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The layers, lowest first: a module imports only modules of its own package (folder) or of a
# lower layer (docs/design.md#layout). Root modules are leaves; the package `kvtool` itself
# (its lazy `__init__`) is no layer.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "units"),
    ("hashing", "prom", "prompts", "progress"),
    ("config",),
    ("disk",),
    ("kv", "models"),
    ("tiers",),
    ("cache",),
    ("engine",),
    ("server", "ops", "jobs"),
    ("bench",),
    ("cli",),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MLX_FREE = ("kvtool.disk", "kvtool.ops")  # never import MLX, directly or through another module


def module_graph(root: Path, package: str = "kvtool") -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (see the module docstring)."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join([*here, base] if base else here)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                dep = known(t) if t.split(".")[0] == package else None
                if dep is not None and dep != name:
                    deps.add(dep)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(frozenset(comp))
    return found


def _describe(comp: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = sorted(f"{a} -> {b}" for a in comp for b in graph[a] if b in comp)
    return "{" + ", ".join(sorted(comp)) + "}: " + "; ".join(edges)


@functools.cache
def _repo_graph() -> dict[str, set[str]]:
    return module_graph(REPO)


def part_of(module: str) -> str | None:
    """The layer member a module belongs to: `kvtool.disk.index` -> `disk`, `kvtool.engine` ->
    `engine`; None for the package `kvtool` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point to the module's own layer in another package, or up (see `LAYERS`)."""
    wrong = []
    for m, deps in graph.items():
        a = part_of(m)
        for d in deps:
            b = part_of(d)
            if a is not None and b is not None and a != b and RANK[b] >= RANK[a]:
                wrong.append(f"{m} -> {d}")
    return sorted(wrong)


def test_no_import_cycles():
    graph = _repo_graph()
    assert "kvtool.disk.namespace" in graph and len(graph) > 50  # the walk saw the package
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(c, graph) for c in found)


def test_every_package_has_a_layer():
    graph = _repo_graph()
    unknown = sorted({p for m in graph if (p := part_of(m)) is not None} - set(RANK))
    assert not unknown, f"modules or packages with no layer in LAYERS: {unknown}"


def test_layers_point_down():
    wrong = upward(_repo_graph())
    assert not wrong, "imports up a layer (or sideways into another package of the same layer):\n" + "\n".join(wrong)


def test_the_cycles_this_work_removed_stay_removed():
    graph = _repo_graph()
    assert "kvtool.ops.validate" not in graph["kvtool.ops.rebuild"]
    assert "kvtool.disk.namespace" not in graph["kvtool.disk.namespace_save"] | graph["kvtool.disk.namespace_core"]
    assert "kvtool.cli.common" not in graph["kvtool.cli.output"]
    # blocks.py takes KVLayout from where it lives, not through the segment file format
    assert "kvtool.disk.segment" not in graph["kvtool.kv.blocks"] and "kvtool.disk.kvlayout" in graph["kvtool.kv.blocks"]


def _mlx_free_modules() -> list[str]:
    return sorted(m for m in _repo_graph() if m.startswith(MLX_FREE))


def test_disk_and_ops_never_import_mlx():
    """Every module of `kvtool.disk` and `kvtool.ops`, imported in a fresh interpreter, leaves
    `mlx` and `mlx_lm` out of `sys.modules` (so `validate`, `prune`, `inspect` run without MLX)."""
    import subprocess
    import sys

    mods = _mlx_free_modules()
    assert len(mods) > 20
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('mlx', 'mlx_lm')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("hidden", [
    "def f():\n    from kvtool.b import x\n",  # inside a function
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtool.b import x\n",  # for types only
    "from . import b\n",  # relative
    "import kvtool.b as b\n",
])  # fmt: skip
def test_the_detector_sees_every_kind_of_import(tmp_path, hidden):
    root = _write(tmp_path, {"kvtool/__init__.py": "", "kvtool/a.py": hidden, "kvtool/b.py": "from kvtool.a import y\n"})
    assert cycles(module_graph(root)) == [frozenset({"kvtool.a", "kvtool.b"})]


def test_the_detector_ignores_parent_packages_and_other_packages(tmp_path):
    root = _write(tmp_path, {
        "kvtool/__init__.py": "from kvtool.sub.m import X\n",  # a package re-exporting its module
        "kvtool/sub/__init__.py": "",
        "kvtool/sub/m.py": "import os\nfrom kvtool.sub import n\nX = 1\n",
        "kvtool/sub/n.py": "import numpy\n",
    })  # fmt: skip
    graph = module_graph(root)
    assert graph["kvtool.sub.m"] == {"kvtool.sub.n"} and cycles(graph) == []


def test_the_layer_rule_sees_an_upward_import(tmp_path):
    root = _write(tmp_path, {
        "kvtool/__init__.py": "",
        "kvtool/disk/__init__.py": "",
        "kvtool/disk/index.py": "def f():\n    from kvtool.cache.prefix import PrefixCache\n",
        "kvtool/cache/__init__.py": "",
        "kvtool/cache/prefix.py": "from kvtool.disk import index\n",
    })  # fmt: skip
    assert upward(module_graph(root)) == ["kvtool.disk.index -> kvtool.cache.prefix"]
