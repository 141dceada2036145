"""No import cycles among kvtool's modules, and the layering that keeps them out.

The module import graph is read from the source with `ast` (nothing is imported): one node per
module under `kvtool/` (a package is its `__init__`), one edge per import statement anywhere in a
module, including

- imports inside functions: a deferred import is still a dependency (it only moves the failure
  from import time to the first call), and it is how cycles usually hide;
- imports under `if TYPE_CHECKING:`: a class named in a signature is part of the module's
  contract, and mypy follows the import. Two modules whose contracts name each other are one
  module split in two files: the shared part belongs in a third module both import (for example
  `kvtool.store.ssd_core` for `ssd`, `ssd_open` and `ssd_save`).

`from a.b import c` is an edge to `a.b.c` when that is a module, else to `a.b`; `import a.b.c` is
an edge to `a.b.c`. Importing a module is not counted as depending on its parent packages (every
import runs them, which would make each package a cycle with its own modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Cycles that exist in modules other engineers are changing right now, each with why it is
# there. The list may only shrink: any other cycle fails the test, and so does a listed one
# that gains a module.
KNOWN_CYCLES = {
    frozenset({"kvtool.prefix", "kvtool.selfcheck"}):
        "selfcheck imports PrefixCache inside a function and prefix imports selfcheck (model-family work)",
    frozenset({"kvtool.blocks", "kvtool.windows"}):
        "windows imports blocks.map_leaves inside a function and blocks re-exports windows (model-family work)",
    frozenset({"kvtool.store.remote", "kvtool.store.remote_writer", "kvtool.store.remote_read"}):
        "remote_writer and remote_read (the store's background writer and its pipelined reads) name "
        "RemoteStore under TYPE_CHECKING only, and remote imports both (remote tier)",
}  # fmt: skip


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


def test_no_import_cycles():
    graph = module_graph(REPO)
    assert "kvtool.store.ssd" in graph and len(graph) > 50  # the walk saw the package
    new = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(_describe(c, graph) for c in new)


def test_the_cycles_this_work_removed_stay_removed():
    graph = module_graph(REPO)
    assert "kvtool.ops.validate" not in graph["kvtool.ops.rebuild"]
    assert "kvtool.store.ssd" not in graph["kvtool.store.ssd_save"] | graph["kvtool.store.ssd_open"]
    assert "kvtool.cli.common" not in graph["kvtool.cli.output"]
    # blocks.py takes KVLayout from where it lives, not through the segment file format
    assert "kvtool.store.segment" not in graph["kvtool.blocks"] and "kvtool.store.kvlayout" in graph["kvtool.blocks"]


def test_the_store_never_imports_the_commands():
    """The SSD tier (its byte budget included) depends on nothing above it: operator commands,
    CLI, server and benchmarks build on the store, never the other way round."""
    graph = module_graph(REPO)
    above = ("kvtool.ops", "kvtool.cli", "kvtool.server", "kvtool.bench")
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("kvtool.store.")
                   for d in deps if d.startswith(above))  # fmt: skip
    assert not wrong, wrong


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
