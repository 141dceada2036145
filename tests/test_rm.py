"""Tests of kvtool.ops.remove and `kvtool rm`: a whole namespace, one prompt's blocks with their
descendants and the segments left empty, dry runs, prune's lock, cron-safety (no terminal without
--yes), confinement (symlinks never followed), the JSON document, and a prompt hashed by a real
model end to end."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.cli import removal
from kvtool.disk.lock import cache_lock
from kvtool.disk.names import LOCK_FILENAME
from kvtool.disk.namespace import SSDStore
from kvtool.hashing import chain_hashes, tail_hash
from kvtool.ops.remove import (
    PromptKeys,
    RemoveError,
    plan_namespace_removal,
    plan_prompt_removal,
    remove_namespace,
    remove_prompt,
    scan_for_removal,
)  # fmt: skip
from kvtool.ops.scan import ScanError, scan_cache
from kvtool.ops.validate import validate
from tests.store_helpers import block_path, free_fan_out, make_chain, make_layout, make_meta, open_store, stored

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "kvtool" / "assets" / "demo_prompt.txt"
BS = 4  # the test namespace's block size (store_helpers.GEOMETRY)
PROMPT = np.arange(18)  # 4 full blocks and a tail entry of 2 tokens

if not any(c.name == "rm" for c in app_module.app.registered_commands):
    app_module._register()
runner = CliRunner()

NAMESPACE_KEYS = {
    "namespace", "model_name", "status", "message", "remove_namespace", "namespace_removed", "blocks", "segments",
    "bytes", "prompt_entries", "prompt_blocks", "descendant_blocks", "remove_blocks", "remove_segments",
    "remove_bytes", "blocks_after", "segments_after", "bytes_after", "rows_deleted", "files_deleted", "bytes_freed",
    "unlink_failed", "index_failed", "left",
}  # fmt: skip


def run_cli(*args, **kw):
    return runner.invoke(app_module.app, ["rm", *args], **kw)


def one_error_line(res, code: int = 2) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == code, (res.exit_code, res.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output and res.stdout == ""
    return lines[0]


@pytest.fixture
def cache(tmp_path):
    """Two namespaces. Namespace 1: the prompt's chain a (4 blocks + tail, one segment each), a
    branch b sharing a's first two blocks (b2, b3), and an unrelated chain c whose first block
    shares a segment with a2. Namespace 2 (another model): one chain."""
    cache_dir = tmp_path / "kv"
    store = open_store(cache_dir)
    a = make_chain(store.layout_key, PROMPT, tail=True)
    b = make_chain(store.layout_key, np.concatenate([PROMPT[:8], np.arange(50, 58)]), seed=20)
    c = make_chain(store.layout_key, np.arange(100, 108), seed=40)
    assert [x.block_hash for x in b[:2]] == [x.block_hash for x in a[:2]]
    for blk in (a[0], a[1], a[3], a[4], b[2], b[3], c[1]):
        assert store.save_block(blk) == "saved"
    assert store.save_blocks([a[2], c[0]]) == ["saved", "saved"]  # one segment: a2 and c0
    store.close()
    other = SSDStore(cache_dir, make_layout(model_id="other"), make_meta(model_id="other"))
    for blk in make_chain(other.layout_key, np.arange(200, 208)):
        other.save_block(blk)
    other.close()
    return cache_dir, store, other, {"a": a, "b": b[2:], "c": c}


def hashes(blocks) -> set[str]:
    return {b.block_hash for b in blocks}


def snapshot(cache_dir: Path) -> tuple[dict, list]:
    files = {str(p.relative_to(cache_dir)): p.read_bytes() for p in sorted(cache_dir.rglob("*"))
             if p.is_file() and not p.name.startswith("index.sqlite")}  # fmt: skip
    rows = []
    for db in sorted(cache_dir.glob("*/index.sqlite")):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            rows.append(conn.execute("SELECT * FROM blocks ORDER BY hash").fetchall())
    return files, rows


def prompt_keys(tokens, layout: str):
    """`keys_for` of a prompt in the test namespace (block size `BS`; other sizes: other layouts)."""

    def keys_for(bs: int) -> PromptKeys:
        key = layout if bs == BS else make_layout(block_size=bs)
        full = chain_hashes(tokens, bs, key)
        tail = tail_hash(tokens, bs, key, full)
        return PromptKeys(key, bs, tuple(full) + ((tail,) if tail else ()))

    return keys_for


# ------------------------------------------------------------------ a namespace
def test_namespace_removal(cache):
    cache_dir, store, other, _ = cache
    res = run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--yes", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert list(doc)[0] == "schema_version" and doc["schema_version"] == 1
    assert set(doc) == {"schema_version", "cache_dir", "target", "model", "prompt_tokens", "now", "dry_run", "executed",
                        "namespaces", "totals", "problems"}  # fmt: skip
    (ns,) = doc["namespaces"]
    assert set(ns) == NAMESPACE_KEYS and doc["target"] == "namespace" and doc["executed"] and doc["problems"] == 0
    assert ns["namespace"] == store.layout_key and ns["namespace_removed"] and ns["remove_namespace"]
    assert (ns["blocks"], ns["segments"], ns["rows_deleted"], ns["files_deleted"]) == (9, 8, 9, 8)
    assert ns["bytes_freed"] == ns["remove_bytes"] == ns["bytes"] > 0 and ns["bytes_after"] == 0
    assert not store.namespace_dir.exists() and other.namespace_dir.exists()
    assert validate(cache_dir, deep=True).problems == 0
    assert (cache_dir / LOCK_FILENAME).exists()  # prune's lock was taken
    # the API: the other namespace, by its full key
    plan = remove_namespace(cache_dir, other.layout_key)
    assert plan.namespaces[0].namespace_removed and not other.namespace_dir.exists()


def test_namespace_removal_of_an_unreadable_namespace_after_its_rebuild(cache):
    """An index that is not a database cannot be told from another program's file: `rm` refuses
    it (hostile round 3, finding 5); `validate --rebuild-index` makes it a kvtool index again, then `rm`
    removes it."""
    cache_dir, store, other, _ = cache
    (other.namespace_dir / "index.sqlite").write_bytes(b"not a database" * 100)
    assert scan_cache(cache_dir, other.layout_key).namespaces[0].status == "unreadable"
    res = run_cli("--cache-dir", str(cache_dir), other.layout_key[:10], "--yes")
    assert res.exit_code == 2 and "not a kvtool namespace" in res.output and "--rebuild-index" in res.output
    assert other.namespace_dir.exists()
    validate(cache_dir, other.layout_key, rebuild_index=True)
    res = run_cli("--cache-dir", str(cache_dir), other.layout_key[:10], "--yes")
    assert res.exit_code == 0, res.output
    assert "removed namespace" in res.stdout and not other.namespace_dir.exists() and store.namespace_dir.exists()


def test_bad_prefixes(cache, tmp_path):
    cache_dir, store, other, _ = cache
    for args, needle in [
        (["zz"], "not a namespace key prefix"),
        (["tiny"], "kvtool inspect --filter tiny"),
        (["ab" * 17], "not a namespace key prefix"),
        (["0" * 31 + "1"], "no namespace"),
        ([], "give a NAMESPACE key prefix or a prompt"),
        ([store.layout_key[:4], "--prompt", "hi"], "not both"),
        ([store.layout_key[:4], "--model", "tiny"], "only apply with a prompt"),
    ]:
        line = one_error_line(run_cli("--cache-dir", str(cache_dir), "--yes", *args))
        assert needle in line, line
    shared = next(i for i in range(32) if store.layout_key[i] != other.layout_key[i])
    if shared:  # both keys start alike: the common prefix is ambiguous (or too short: refused either way)
        line = one_error_line(run_cli("--cache-dir", str(cache_dir), "--yes", store.layout_key[:shared]))
        assert ("2 namespaces" if shared >= 8 else "too short") in line, line
    with pytest.raises(RemoveError, match="not a namespace key prefix"):
        scan_for_removal(cache_dir, "")
    absent = run_cli("--cache-dir", str(tmp_path / "absent"), "--yes", "--create", "abababab")  # an empty cache
    assert "no namespace" in one_error_line(absent) and (tmp_path / "absent").is_dir()
    assert len(stored(store)) == 9 and other.namespace_dir.exists()


# ------------------------------------------------------------------ a prompt
def test_prompt_removal_takes_descendants_and_empty_segments_only(cache):
    cache_dir, store, other, chains = cache
    a, b, c = chains["a"], chains["b"], chains["c"]
    mixed = block_path(store, c[0].block_hash)
    assert mixed == block_path(store, a[2].block_hash)
    only_a = [block_path(store, h) for h in hashes(a) - {a[2].block_hash}]
    # the prompt is a's first two blocks: everything below them goes (a's rest and branch b)
    plan = plan_prompt_removal(scan_cache(cache_dir), prompt_keys(PROMPT[:8], store.layout_key))
    (ns,) = plan.namespaces
    assert (ns.prompt_entries, ns.prompt_blocks, ns.descendant_blocks, ns.prune_blocks) == (2, 2, 5, 7)
    assert set(ns.hashes) == hashes(a) | hashes(b)
    assert ns.prune_segments == 6 and ns.segments_after == 2  # the mixed segment keeps c0: it stays
    plan.dry_run = False
    from kvtool.ops.remove import execute_removal

    execute_removal(plan)
    assert stored(store) == hashes(c) and mixed.exists() and not any(p.exists() for p in only_a)
    assert ns.rows_deleted == 7 and ns.files_deleted == 6 and ns.bytes_freed == ns.prune_bytes > 0
    assert len(scan_cache(cache_dir, other.layout_key).namespaces[0].rows) == 2  # other model untouched
    assert validate(cache_dir, deep=True).problems == 0
    live = SSDStore(cache_dir, store.layout_key, make_meta())
    assert all(live.load_block(x.block_hash, x.token_ids) is not None for x in c)
    live.close()


def test_prompt_removal_takes_the_tail_entry_and_nothing_of_a_longer_branch_before_it(cache):
    cache_dir, store, _, chains = cache
    a, c = chains["a"], chains["c"]
    tail = a[4]
    assert tail.token_ids.size == 2
    plan = remove_prompt(cache_dir, prompt_keys(PROMPT, store.layout_key))  # the whole prompt (4 blocks + tail)
    (ns,) = plan.namespaces
    assert (ns.prompt_entries, ns.prompt_blocks) == (5, 5) and tail.block_hash in ns.hashes
    assert stored(store) == hashes(c)  # a's first block was the prompt's: branch b hung below it
    assert plan.executed and plan.problems == 0
    # nothing of it left: a second run removes nothing
    again = remove_prompt(cache_dir, prompt_keys(PROMPT, store.layout_key))
    assert not again.removes_anything() and again.namespaces[0].prompt_blocks == 0


def test_prompt_in_no_namespace_of_the_cache(cache):
    cache_dir, store, _, _ = cache
    plan = plan_prompt_removal(scan_cache(cache_dir), prompt_keys(PROMPT, store.layout_key), [8, 16])
    assert plan.namespaces == [] and not plan.removes_anything() and plan.problems == 0


def test_an_unreadable_namespace_of_the_prompt_is_left_alone_and_reported(cache):
    cache_dir, store, _, _ = cache
    (store.namespace_dir / "index.sqlite").write_bytes(b"not a database" * 100)
    before = sorted(store.namespace_dir.rglob("*"))
    files = {str(p): p.read_bytes() for p in before if p.is_file()}
    plan = remove_prompt(cache_dir, prompt_keys(PROMPT, store.layout_key), [BS])
    (ns,) = plan.namespaces
    assert ns.skipped and "unreadable" in ns.message and plan.problems == 1 and not plan.removes_anything()
    assert sorted(store.namespace_dir.rglob("*")) == before
    assert {str(p): p.read_bytes() for p in before if p.is_file()} == files


# ------------------------------------------------------------------ dry run, lock, confirmation
def test_dry_run_changes_nothing(cache):
    cache_dir, store, _, _ = cache
    before = snapshot(cache_dir)
    res = run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--dry-run", "--json")  # no --yes needed
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["dry_run"] and not doc["executed"] and doc["namespaces"][0]["remove_blocks"] == 9
    assert doc["namespaces"][0]["rows_deleted"] == 0 and not doc["namespaces"][0]["namespace_removed"]
    human = run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--dry-run")
    assert human.exit_code == 0 and "dry run: nothing changed" in human.stdout and "remove it whole" in human.stdout
    plan = remove_prompt(cache_dir, prompt_keys(PROMPT, store.layout_key), dry_run=True)
    assert plan.dry_run and not plan.executed and plan.total("prune_blocks") == 7
    assert plan_namespace_removal(scan_for_removal(cache_dir, store.layout_key)).namespaces[0].prune_blocks == 9
    assert snapshot(cache_dir) == before and not (cache_dir / LOCK_FILENAME).exists()  # no lock taken either


def test_lock_held_by_prune_exits_3(cache):
    cache_dir, store, _, _ = cache
    with cache_lock(cache_dir):  # what `kvtool prune` holds from planning to the end of execution
        res = run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--yes")
        assert "another kvtool prune, rm or validate is running" in one_error_line(res, code=3)
        assert store.namespace_dir.exists() and len(stored(store)) == 9
    assert run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--yes", "--quiet").exit_code == 0  # released


def test_no_terminal_without_yes_is_one_error_line_and_changes_nothing(cache):
    cache_dir, store, _, _ = cache
    before = snapshot(cache_dir)
    line = one_error_line(run_cli("--cache-dir", str(cache_dir), store.layout_key[:8]))
    assert "--yes" in line and "no terminal" in line
    one_error_line(run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--json"))
    assert snapshot(cache_dir) == before and not (cache_dir / LOCK_FILENAME).exists()


def test_confirmation_on_a_terminal(cache, monkeypatch):
    cache_dir, store, _, _ = cache
    monkeypatch.setattr(removal, "interactive", lambda: True)
    res = run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], input="n\n")
    assert res.exit_code == 1 and "aborted: nothing changed" in res.output and store.namespace_dir.exists()
    assert f"Remove namespace {store.layout_key}" in res.output
    res = run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--json", input="y\n")
    assert res.exit_code == 0 and not store.namespace_dir.exists()
    doc = res.stdout[res.stdout.index("{"):]  # CliRunner echoes the typed answer to stdout; a terminal does not
    assert json.loads(doc)["namespaces"][0]["namespace_removed"]  # the plan went to stderr, not into the JSON
    assert "remove it whole" in res.stderr and "remove it whole" not in res.stdout


def _on_a_terminal(args: list[str], answer: bytes) -> tuple[int, bytes, bytes]:
    """Run kvtool with stdin and stderr on a pseudo-terminal (stdout a pipe, as `kvtool ... --json
    | jq` has it), type `answer`; (exit code, stdout, what the terminal showed)."""
    import os
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvtool.cli.app", *args], cwd=REPO, stdin=slave, stderr=slave,
                            stdout=subprocess.PIPE)  # fmt: skip
    os.close(slave)
    os.write(master, answer)  # kept by the terminal until kvtool reads it
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    out = proc.stdout.read() if proc.stdout else b""
    os.close(master)
    return proc.wait(timeout=60), out, shown


@pytest.mark.slow
@pytest.mark.parametrize("answer", [b"n\n", b"\x04"])  # "no", end of input (Ctrl-D)
def test_a_declined_confirmation_leaves_stdout_empty_under_json(cache, answer):
    cache_dir, store, _, _ = cache
    code, out, shown = _on_a_terminal(["rm", store.layout_key[:8], "--json", "--cache-dir", str(cache_dir)], answer)
    assert code == 1 and out == b"", (code, out, shown)  # click.confirm wrote a space to stdout
    assert b"[y/N]" in shown and b"aborted: nothing changed" in shown and store.namespace_dir.exists()


def test_quiet_prints_nothing(cache):
    cache_dir, store, _, _ = cache
    res = run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--yes", "--quiet")
    assert res.exit_code == 0 and res.output == "" and not store.namespace_dir.exists()


# ------------------------------------------------------------------ confinement
def test_symlinked_namespace_is_not_followed(cache, tmp_path):
    cache_dir, store, other, _ = cache
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / ("ef" * 16)
    other.namespace_dir.rename(target)  # a real namespace, outside the cache
    (cache_dir / target.name).symlink_to(target, target_is_directory=True)
    before = {str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*")}
    line = one_error_line(run_cli("--cache-dir", str(cache_dir), "efefefef", "--yes"))
    assert "is a symlink: never followed" in line
    with pytest.raises(RemoveError, match="symlink"):
        remove_namespace(cache_dir, "efefefef")
    assert (cache_dir / target.name).is_symlink() and {str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*")} == before
    # a symlink inside a namespace that is removed: the link goes, never what it points to
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    free = free_fan_out(store.namespace_dir)  # a fan-out dir name
    (store.namespace_dir / free).symlink_to(outside, target_is_directory=True)
    res = run_cli("--cache-dir", str(cache_dir), store.layout_key[:8], "--yes")
    assert res.exit_code == 0, res.output
    assert not store.namespace_dir.exists() and (outside / "keep.txt").read_text() == "mine"


def test_scan_errors_propagate(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ScanError, match="not a directory"):
        scan_for_removal(tmp_path / "file", "abababab")


def test_help():
    res = run_cli("--help")
    assert res.exit_code == 0 and "kvtool rm 3fa2c1d0 --dry-run" in res.stdout and "--prompt-file" in res.stdout


# ------------------------------------------------------------------ a real model, end to end
def test_prompt_removal_with_a_real_model(tmp_path, tiny_model):
    from kvtool.config import KVToolConfig
    from kvtool.engine import Engine

    cache_dir = tmp_path / "kv"
    text = " ".join(DEMO.read_text(encoding="utf-8")[:3000].split())
    first, second = text[:700], text[1500:2300]  # no shared blocks
    engine = Engine(tiny_model, KVToolConfig(ssd_cache_dir=cache_dir, block_size=16, ssd_async_writes=False))
    first_ids, second_ids = (engine.encode(prompt=p, chat_template=True) for p in (first, second))
    for ids in (first_ids, second_ids):
        engine.prefill(ids)
    engine.close()
    (ns,) = scan_cache(cache_dir).namespaces
    blocks = len(ns.rows)
    args = ["--cache-dir", str(cache_dir), "--block-size", "16", "--json"]
    probe = lambda p: json.loads(runner.invoke(app_module.app, ["inspect", *args, "--prompt", p]).stdout)  # noqa: E731
    assert probe(first)["would_hit"] and probe(second)["would_hit"]

    dry = run_cli("--cache-dir", str(cache_dir), "--prompt", first, "--dry-run", "--json")  # every block size in the cache
    assert dry.exit_code == 0, dry.output
    doc = json.loads(dry.stdout)
    assert doc["target"] == "prompt" and doc["model"] == "tiny" and doc["prompt_tokens"] > 16
    (plan,) = doc["namespaces"]
    assert plan["namespace"] == ns.name and plan["prompt_blocks"] == plan["prompt_entries"] > 1
    assert plan["descendant_blocks"] == 0 and plan["remove_blocks"] < blocks

    res = run_cli("--cache-dir", str(cache_dir), "--prompt", first, "--yes")
    assert res.exit_code == 0, res.output
    assert f"removed {plan['remove_blocks']} block(s)" in res.stdout
    # what is left of `first` is what it shares with `second`'s first block (the chat template's
    # opening tokens, a partial-block hit from a sibling), never a block of its own
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    assert probe(first)["cached_tokens"] == shared < 16 and probe(second)["would_hit"]
    assert len(scan_cache(cache_dir).namespaces[0].rows) == blocks - plan["remove_blocks"]
    assert validate(cache_dir, deep=True).problems == 0
    nothing = run_cli("--cache-dir", str(cache_dir), "--prompt", first, "--block-size", "16", "--yes")
    assert nothing.exit_code == 0 and "nothing to remove" in nothing.stdout
