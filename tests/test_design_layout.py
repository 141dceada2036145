"""docs/design.md opens with the package's layout: every module of `kvtool/` is listed there with
one line, every folder (package) too, and nothing listed is gone. The layer rule it states is the
one `tests/test_imports.py` enforces (`LAYERS`)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_imports import LAYERS

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design.md"
ENTRY = re.compile(r"^(kvtool/[\w/]*?(?:\w+\.py|/))\s", re.M)


def _layout_section() -> str:
    text = DESIGN.read_text()
    start = text.index("\n## Layout\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def listed() -> set[str]:
    """Paths the layout section names at the start of a line: `kvtool/disk/index.py`, `kvtool/disk/`."""
    return set(ENTRY.findall(_layout_section()))


def on_disk() -> set[str]:
    root = REPO / "kvtool"
    mods = {p.relative_to(REPO).as_posix() for p in root.rglob("*.py") if p.name != "__init__.py"}
    pkgs = {p.parent.relative_to(REPO).as_posix() + "/" for p in root.rglob("__init__.py") if p.parent != root}
    return mods | pkgs


def test_the_layout_is_the_first_section():
    headings = re.findall(r"^## (.+)$", DESIGN.read_text(), re.M)
    assert headings[0] == "Layout"


def test_every_module_and_folder_is_listed():
    missing = sorted(on_disk() - listed())
    assert not missing, f"modules or folders of kvtool/ missing from docs/design.md's layout: {missing}"


def test_nothing_listed_is_gone():
    gone = sorted(listed() - on_disk())
    assert not gone, f"docs/design.md's layout lists what no longer exists: {gone}"


def test_the_layer_rule_names_every_layer():
    section = _layout_section()
    for names in LAYERS:
        for name in names:
            assert f"`{name}`" in section, f"layer member {name!r} is not named in the layer rule"


def test_the_reader_sees_entries(tmp_path):
    text = "kvtool/disk/index.py   the index\nkvtool/disk/           a namespace\n  kvtool/not_at_start.py\n"
    assert set(ENTRY.findall(text)) == {"kvtool/disk/index.py", "kvtool/disk/"}
