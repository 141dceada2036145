"""The family matrix (tests/zoo_matrix.py) over every model type of the pinned mlx-lm.

Each family: cold / RAM hit / SSD hit in a fresh engine / 60 % shared prefix / extended prompt,
all equal to mlx-lm's greedy tokens; cached families hit, refused ones name a measured or named
reason. A fast subset runs by default, the rest is marked slow. The last test checks that
docs/models.md is what the families run in this session render to (every row when the whole
matrix ran); `KVTOOL_REGEN_MODELS_MD=1` rewrites it instead (or run scripts/family_table.py).
"""

from __future__ import annotations

import os

import pytest

from tests import model_zoo, zoo_matrix

FAST = ("llama", "qwen3_next")  # the rest of the matrix runs in `make test` (test-fast keeps its time budget)
FAMILIES = model_zoo.all_families()
RESULTS: dict[str, zoo_matrix.FamilyResult] = {}


def _params():
    return [pytest.param(f, id=f, marks=() if f in FAST else pytest.mark.slow) for f in FAMILIES]


@pytest.mark.parametrize("family", _params())
def test_family_matrix(family, tmp_path):
    try:
        path = model_zoo.family_dir(family)
    except model_zoo.NotBuildable as exc:
        assert family not in zoo_matrix.ACCEPTANCE, f"{family} must build: {exc}"
        RESULTS[family] = zoo_matrix.not_buildable_result(family, str(exc))
        return
    res = zoo_matrix.check_family(family, path, tmp_path)
    RESULTS[family] = res
    if family in zoo_matrix.ACCEPTANCE:
        assert res.status == "cached" or res.reason.startswith("self-check failed: ") or "mlx-lm" in res.reason


def test_models_md_is_generated_from_the_matrix():
    """Runs after the matrix (last in this file): docs/models.md rows = this session's results."""
    if not RESULTS:
        pytest.skip("no family of the matrix ran in this session")
    everything = len(RESULTS) == len(FAMILIES)
    text = zoo_matrix.render([RESULTS[f] for f in FAMILIES if f in RESULTS])
    if os.environ.get("KVTOOL_REGEN_MODELS_MD") == "1" and everything:
        zoo_matrix.MODELS_MD.write_text(text, encoding="utf-8")
    current = zoo_matrix.MODELS_MD.read_text(encoding="utf-8")
    stored = zoo_matrix.rows(current)
    for family, res in RESULTS.items():
        assert stored.get(family) == zoo_matrix.row_of(res), (
            f"docs/models.md is out of date for {family}: run scripts/family_table.py")
    if everything:
        assert current == text, "docs/models.md is out of date: run scripts/family_table.py"
        cached = [r for r in RESULTS.values() if r.status == "cached"]
        built = [r for r in RESULTS.values() if r.status != "not buildable"]
        assert len({r.model_type for r in built}) >= 25 and len(cached) >= 25
