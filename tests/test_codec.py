"""Opt-in lossless codecs for SSD block records (`ssd_codec`: zstd, lz4; docs/design.md#segments-format-2-why-and-what).

- a record stored compressed reads back bit for bit (per codec and dtype), through the segment
  reader, `SSDStore.load_block` and the batched restore; `none` writes exactly today's bytes;
- the checksum covers the stored (compressed) bytes and is checked before decompressing; a
  damaged compressed record, or one that decodes to another size, cuts the chain there;
- the codec is part of the namespace (meta `kv_codec`, layout key): codec and plain blocks never
  mix;
- the engine's output equals mlx-lm's with a codec: cold, RAM hit, SSD hit after a restart.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kvtool.cli import common
from kvtool.config import Codec, ConfigError, KVToolConfig
from kvtool.disk import restore
from kvtool.disk import segment as seg
from kvtool.disk.namespace import SSDStore
from kvtool.disk.segment import BlockFileError
from kvtool.engine import Engine
from kvtool.hashing import key_extra_of_meta, layout_key_of_meta, root_parent
from kvtool.models.loader import load_model
from tests.store_helpers import (
    assert_same_block,
    flip_record_byte,
    kv_layout,
    make_chain,
    make_meta,
    segment_files,
)

CODECS = ["zstd", "lz4"]
BS = 4


def codec_store(tmp_path, codec: str, dtype: str = "bfloat16") -> SSDStore:
    meta = {**make_meta(dtype), "format_version": str(seg.FORMAT_VERSION)}
    if codec != "none":
        meta["kv_codec"] = codec
    key = layout_key_of_meta(meta)
    meta.pop("format_version")
    return SSDStore(tmp_path / "kv", key, meta)


def smooth_chain(layout: str, ids, dtype: str):
    """A chain whose KV compresses (small integers), so stored bytes < raw bytes."""
    chain = make_chain(layout, ids, dtype, tail=True)
    for b in chain:
        for arr in [*b.keys, *b.values]:
            arr[...] = (np.arange(arr.size).reshape(arr.shape) % 7).astype(arr.dtype)
    return chain


def read_file(path, layout, kv, codec=None):
    fd = os.open(path, os.O_RDONLY)
    try:
        header = seg.read_header(fd, os.fstat(fd).st_size)
        seg.check_header(header, layout, kv, codec)
        return header, [seg.read_block(fd, s, header.kv) for s in header.slots]
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- format
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_is_exact(tmp_path, codec, dtype):
    kv = kv_layout(dtype)
    chain = make_chain("ab" * 16, np.arange(14), dtype, tail=True)  # random bits: NaN patterns too
    buffers, slots = seg.encode(chain, "ab" * 16, kv, 1.0, codec)
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"".join(bytes(b) for b in buffers))
    header, got = read_file(path, "ab" * 16, kv, codec)
    assert [s.codec for s in header.slots] == [codec] * len(chain)
    assert [s.raw_nbytes for s in header.slots] == [kv.record_nbytes(b.num_tokens) for b in chain]
    assert header.slots == tuple(slots)
    for a, b in zip(chain, got):
        assert_same_block(a, b)
    meta = header.meta["b0"].split(":")
    assert meta[4:] == [codec, str(kv.record_nbytes(chain[0].num_tokens))]
    with pytest.raises(BlockFileError) as err:  # a plain namespace refuses a compressed file
        seg.check_header(header, "ab" * 16, kv, "none")
    assert err.value.kind == "header"


def test_codec_none_writes_todays_bytes():
    kv = kv_layout("float16")
    chain = make_chain("ab" * 16, np.arange(10), "float16", tail=True)
    plain, _ = seg.encode(chain, "ab" * 16, kv, 2.0)
    none, slots = seg.encode(chain, "ab" * 16, kv, 2.0, "none")
    assert b"".join(bytes(b) for b in plain) == b"".join(bytes(b) for b in none)
    assert all(s.codec == "none" and s.raw_nbytes == s.nbytes for s in slots)
    with pytest.raises(ValueError):
        seg.encode(chain, "ab" * 16, kv, 2.0, "gzip")


@pytest.mark.parametrize("codec", CODECS)
def test_compressible_records_are_smaller(tmp_path, codec):
    store = codec_store(tmp_path, codec)
    ids = np.arange(1000, 1030, dtype=np.int32)
    chain = smooth_chain(store.layout_key, ids, "bfloat16")
    assert set(store.save_blocks(chain)) == {"saved"}
    raw = sum(store.expected.kv.record_nbytes(b.num_tokens) for b in chain)
    rows = store.lookup([b.block_hash for b in chain])
    assert len(rows) == len(chain) and sum(r.nbytes for r in rows) < raw
    for b in chain:
        assert_same_block(store.load_block(b.block_hash, b.token_ids, b.parent_hash), b)


# ----------------------------------------------------------------------------- restore
def restore_all(store, chain, ids, parallel=True):
    kv = store.expected.kv
    arrays = [np.zeros((1, h, len(ids) + 4, d), seg.STORAGE_DTYPES[kv.dtype]) for h, dk, dv in kv.layers for d in (dk, dv)]
    rows = store.lookup([b.block_hash for b in chain])
    offs = list(np.cumsum([0] + [r.num_tokens for r in rows])[:-1])
    res = restore.restore_chain(store, rows, root_parent(store.layout_key), np.asarray(ids, np.int32), offs,
                                seg.HeadPieces(arrays), parallel)
    return res, arrays, rows


def placed(arrays, chain, n_ok) -> bool:
    stop = sum(b.num_tokens for b in chain[:n_ok])
    want = [np.concatenate([getattr(b, part)[layer] for b in chain[:n_ok]], axis=2).tobytes() if n_ok else b""
            for layer in range(len(chain[0].keys)) for part in ("keys", "values")]
    return [a[:, :, :stop, :].tobytes() for a in arrays] == want


@pytest.fixture
def small_tasks(monkeypatch):
    monkeypatch.setattr(restore, "TASK_BYTES", 2 * kv_layout().record_nbytes(BS))
    monkeypatch.setattr(restore, "PARALLEL_MIN_BYTES", 0, raising=False)


def saved_chain(store, batches=(3, 7)):
    ids = np.arange(1000, 1046, dtype=np.int32)
    chain = make_chain(store.layout_key, ids, "bfloat16", tail=True)
    cuts = [0, *batches, len(chain)]
    for lo, hi in zip(cuts, cuts[1:]):
        assert set(store.save_blocks(chain[lo:hi])) == {"saved"}
    return chain, ids


@pytest.mark.parametrize("parallel", [True, False], ids=["pool", "inline"])
@pytest.mark.parametrize("codec", CODECS)
def test_batched_restore_of_compressed_records_is_exact(tmp_path, small_tasks, codec, parallel):
    store = codec_store(tmp_path, codec)
    chain, ids = saved_chain(store)
    res, arrays, rows = restore_all(store, chain, ids, parallel)
    assert res.n_ok == len(chain) and res.failure is None
    assert placed(arrays, chain, len(chain))
    assert res.bytes_read == sum(r.nbytes for r in rows)


K = 5  # the damaged block: the middle of segment 2 (blocks 3..6)


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("parallel", [True, False], ids=["pool", "inline"])
@pytest.mark.parametrize("codec", CODECS)
def test_corrupt_compressed_record_cuts_the_chain(tmp_path, small_tasks, codec, parallel, where):
    store = codec_store(tmp_path, codec)
    chain, ids = saved_chain(store)
    flip_record_byte(store, chain[K].block_hash, where=where)
    res, arrays, _ = restore_all(store, chain, ids, parallel)
    assert res.n_ok == K and res.failure is not None and "checksum" in res.failure
    assert placed(arrays, chain, K)
    assert store.index.get(chain[K].block_hash) is None and store.stats()["ssd_load_corrupt"] >= 1
    assert all(store.index.get(b.block_hash) is not None for b in chain if b is not chain[K])


@pytest.mark.parametrize("codec", CODECS)
def test_record_decoding_to_another_size_is_a_checksum_failure(tmp_path, small_tasks, monkeypatch, codec):
    """A consistent record (its checksum matches its stored bytes) whose data decodes to fewer
    bytes than its slot declares: never placed, the chain is cut there as for corruption."""
    store = codec_store(tmp_path, codec)
    real = seg.compress
    calls = {"n": 0}

    def short(c, data):
        calls["n"] += 1
        return real(c, bytes(data)[:-8] if calls["n"] == K + 1 else data)

    monkeypatch.setattr(seg, "compress", short)
    chain, ids = saved_chain(store)
    monkeypatch.setattr(seg, "compress", real)
    res, arrays, _ = restore_all(store, chain, ids)
    assert res.n_ok == K and "checksum" in (res.failure or "")
    assert placed(arrays, chain, K)
    assert store.load_block(chain[K].block_hash, chain[K].token_ids) is None  # its row is gone
    with pytest.raises(seg.CodecError):
        seg.decompress(codec, real(codec, b"x" * 100), 99)


# ----------------------------------------------------------------------------- namespaces
def test_codec_is_part_of_the_namespace(tmp_path):
    base = {**make_meta("bfloat16"), "format_version": "2"}
    keys = {c: layout_key_of_meta({**base, "kv_codec": c}) for c in ["none", *CODECS]}
    assert keys["none"] == layout_key_of_meta(base)  # plain namespaces keep today's key
    assert len(set(keys.values())) == 3
    assert key_extra_of_meta({**base, "kv_codec": "zstd"}) == "codec=zstd"
    assert key_extra_of_meta({**base, "kv_codec": "none"}) == ""
    # a compressed segment planted in the plain namespace is refused (another layout key)
    plain, zstd = codec_store(tmp_path, "none"), codec_store(tmp_path, "zstd")
    chain = make_chain(zstd.layout_key, np.arange(8), "bfloat16")
    assert set(zstd.save_blocks(chain)) == {"saved"}
    assert plain.namespace_dir != zstd.namespace_dir and plain.lookup([chain[0].block_hash]) == []


def test_config_and_cli_options(tmp_path):
    assert KVToolConfig(ssd_cache_dir=tmp_path).ssd_codec == "none"
    assert KVToolConfig(ssd_cache_dir=tmp_path, ssd_codec="lz4").ssd_codec == "lz4"
    with pytest.raises(ConfigError) as err:
        KVToolConfig(ssd_cache_dir=tmp_path, ssd_codec="gzip")
    assert err.value.field == "ssd_codec"
    assert common.build_config(cache_dir=tmp_path, codec=Codec.ZSTD).ssd_codec == "zstd"
    toml = tmp_path / "c.toml"
    toml.write_text('ssd_codec = "zstd"\n')
    assert common.build_config(toml, tmp_path).ssd_codec == "zstd"


# ----------------------------------------------------------------------------- engine
ENGINE_BS = 64
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["tiny", "tiny-bf16"])
def loaded(request):
    return load_model(request.param)


def reference_tokens(model, tokenizer, ids):
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS):
        if tok in tokenizer.eos_token_ids:
            break
        out.append(int(tok))
    return out


def make_engine(loaded, tmp_path, codec):
    cfg = KVToolConfig(ssd_cache_dir=tmp_path / "kv", block_size=ENGINE_BS, ssd_async_writes=False, ssd_codec=codec)
    return Engine(loaded, cfg)


@pytest.mark.parametrize("codec", CODECS)
def test_engine_with_a_codec_equals_mlx_lm(loaded, tmp_path, codec):
    text = open("kvtool/assets/demo_prompt.txt", encoding="utf-8").read()
    ids = loaded.tokenizer.encode(text)[: 3 * ENGINE_BS + 10]
    ref = reference_tokens(loaded.model, loaded.tokenizer, ids)

    eng = make_engine(loaded, tmp_path, codec)
    assert eng.cache.ssd.expected.codec == codec
    cold = eng.generate(ids, max_tokens=MAX_TOKENS)
    assert cold.token_ids == ref and cold.cached_tokens == 0
    ram = eng.generate(ids, max_tokens=MAX_TOKENS)
    assert ram.token_ids == ref and ram.ram_hit_tokens == len(ids) - 1
    assert eng.close().shutdown_clean
    ns = eng.cache.layout_key

    eng2 = make_engine(loaded, tmp_path, codec)  # restart: empty RAM, same SSD tier
    assert eng2.cache.layout_key == ns
    ssd = eng2.generate(ids, max_tokens=MAX_TOKENS)
    assert ssd.token_ids == ref and ssd.ssd_hit_tokens == len(ids) - 1
    header = seg.parse_header(*_open_size(segment_files(tmp_path / "kv" / ns)[0]))
    assert {s.codec for s in header.slots} == {codec}
    assert ssd.ssd_bytes_read == sum(s.nbytes for p in segment_files(tmp_path / "kv" / ns)
                                     for s in seg.parse_header(*_open_size(p)).slots)
    assert eng2.close().shutdown_clean

    plain = make_engine(loaded, tmp_path, "none")  # a plain namespace: separate, a cold miss
    assert plain.cache.layout_key != ns
    res = plain.generate(ids, max_tokens=MAX_TOKENS)
    assert res.token_ids == ref and res.cached_tokens == 0
    meta = json.dumps(plain.cache._namespace_meta(ENGINE_BS))  # noqa: SLF001
    assert "kv_codec" not in meta
    plain.close()


def _open_size(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, os.fstat(fd).st_size, 0), os.fstat(fd).st_size
    finally:
        os.close(fd)


@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("codec", CODECS)
def test_validate_reads_compressed_records(tmp_path, codec, deep):
    """Plain `validate` too: it compared a compressed record's token digest with nothing (the
    record is read whole, not into the digests) and "repaired" every row of a clean namespace."""
    from kvtool.ops.validate import validate

    store = codec_store(tmp_path, codec)
    chain, _ = saved_chain(store)
    store.close()
    (rep,) = validate(tmp_path / "kv", deep=deep).namespaces
    assert (rep.status, rep.outcome, rep.problems, rep.rows) == ("ok", "clean", 0, len(chain)), rep.details
    store = codec_store(tmp_path, codec)
    flip_record_byte(store, chain[K].block_hash)
    store.close()
    (rep,) = validate(tmp_path / "kv", deep=deep).namespaces
    assert rep.outcome == "repaired" and rep.problems >= 1
    (again,) = validate(tmp_path / "kv", deep=deep).namespaces
    assert again.outcome == "clean" and again.rows < len(chain)
    store = codec_store(tmp_path, codec)
    assert store.index.get(chain[K].block_hash) is None and store.index.get(chain[0].block_hash) is not None
    store.close()
