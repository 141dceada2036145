"""Every rule the code and docs cite is written in this repository: no citation of a document
outside it ("seed 000 §2", "seed 002 A3", "issue 8", ...). Cite a section of the repository's
docs instead (e.g. docs/design.md#writer-protocol), or state the rule in a few words."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"\bseed\s+0\d\d\b|\bseed\s+\d{3}\b|\bissue\s+\d+", re.I)
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".sh", ""}


def _files() -> list[Path]:
    files = [REPO / "README.md"]
    for top in ("kvtool", "tests", "docs"):
        files += [p for p in (REPO / top).rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    this = Path(__file__).resolve()
    return [p for p in files if p.resolve() != this and "__pycache__" not in p.parts]


def test_no_citation_of_documents_outside_the_repository():
    found = []
    for path in _files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if CITATION.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not found, "citations of documents outside the repository (cite docs/design.md#... instead):\n" + "\n".join(found)


def test_the_pattern_catches_the_old_forms():
    for text in ("seed 000 §2", "(seed 000)", "seed 002 A3", "seed 003", "issue 8", "Issue 9: x", "issue 3 §2"):
        assert CITATION.search(text), text
    assert not CITATION.search("the seed of the sweep"), "a random seed is not a citation"
