"""Quantized KV (8-bit, group 64): slice_blocks of a run and rebuild_cache of its blocks + first write, ms. TREE LAYERS TOKENS"""
import sys, time, statistics, copy
sys.path.insert(0, sys.argv[1])
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import KVCache
from kvtool.disk.kvlayout import KVLayout
from kvtool.kv.blocks import cache_capacity, rebuild_cache
try:
    from kvtool.kv.cut import slice_blocks
except ImportError:
    from kvtool.kv.blocks import slice_blocks
L, T, D, BS = int(sys.argv[2]), int(sys.argv[3]), 64, 64
kv = KVLayout.uniform(L, 2, D, "bfloat16", bits=8, group_size=64)
src = [KVCache() for _ in range(L)]
for c in src:
    k = mx.random.normal((1, 2, T, D)).astype(mx.bfloat16); c.update_and_fetch(k, -k)
src = [c.to_quantized(group_size=64, bits=8) for c in src]
mx.eval([c.keys for c in src])
ids = np.arange(T, dtype=np.int32)
sp = [(f"{i+1:032x}", f"{i:032x}", i * BS, (i + 1) * BS) for i in range(T // BS)]
blocks = slice_blocks(src, ids, sp, kv)
one = mx.zeros((1, 2, 1, D), dtype=mx.bfloat16)
def build():
    r = rebuild_cache(blocks, L, cache_capacity(T + 30), kv=kv); mx.eval([c.update_and_fetch(one, one) for c in r])
def mlxlm():
    r = copy.deepcopy(src); mx.eval([c.update_and_fetch(one, one) for c in r])
def cut():
    b = slice_blocks(src, ids, sp, kv); mx.eval([x.keys for x in b])  # arrays asked for (as the writer does)
ts = {"build": [], "mlx-lm deepcopy": [], "slice_blocks": []}
for _ in range(15):
    for k, f in (("build", build), ("mlx-lm deepcopy", mlxlm), ("slice_blocks", cut)):
        t0 = time.perf_counter(); f(); ts[k].append((time.perf_counter() - t0) * 1e3)
m = {k: statistics.median(v) for k, v in ts.items()}
print(sys.argv[1].split("/")[-1], f"{L} layers {T} tokens q8:", {k: round(v, 2) for k, v in m.items()}, "build/mlx-lm %.2fx" % (m["build"] / m["mlx-lm deepcopy"]))
