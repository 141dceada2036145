import sys, time, numpy as np, statistics as st
from pathlib import Path
import mlx.core as mx
from kvtool.bench.restore_worker import open_prefix_cache, cache_pairs, load_mlxlm, save_mlxlm
from kvtool.bench.restore import SHAPES
d = Path(sys.argv[1]); shape = SHAPES["tiny"]
ids = np.load(d / "ids.npy")
pc = open_prefix_cache(d, shape)
f = d / "mlx.safetensors"
if not f.exists():
    hit = pc.fetch(ids); mx.eval(cache_pairs(hit.cache))
    from mlx_lm.models.cache import KVCache
    cs = []
    for k, v in cache_pairs(hit.cache):
        c = KVCache(); c.update_and_fetch(k[..., : hit.cached_tokens, :], v[..., : hit.cached_tokens, :]); cs.append(c)
    save_mlxlm(f, cs, ids[: hit.cached_tokens]); pc.release(hit)
ids_m = ids[: len(ids) - 1]
K, M = [], []
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
    t0 = time.perf_counter(); hit = pc.fetch(ids); mx.eval(cache_pairs(hit.cache)); K.append((time.perf_counter()-t0)*1e3); pc.release(hit); del hit
    t0 = time.perf_counter(); c, ok = load_mlxlm(f, ids_m); M.append((time.perf_counter()-t0)*1e3); del c
print("first: kvtool %.2f mlx %.2f | rest median kvtool %.2f [%.2f-%.2f] mlx %.2f [%.2f-%.2f] ratio %.2f" % (K[0], M[0], st.median(K[1:]), min(K[1:]), max(K[1:]), st.median(M[1:]), min(M[1:]), max(M[1:]), st.median(K[1:])/st.median(M[1:])))
pc.close()
