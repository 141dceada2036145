import sys, time, numpy as np, functools
from pathlib import Path
import mlx.core as mx
import mlx_lm.models.cache
from kvtool.bench.restore_worker import open_prefix_cache, cache_pairs
from kvtool.bench.restore import SHAPES
import kvtool.disk.restore as R, kvtool.kv.buffers as B, kvtool.tiers.stack as S, kvtool.cache.prefix as P, kvtool.tiers.ssd as SSD
import kvtool.disk.namespace as NS
T = {}
def wrap(obj, name):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: T[name] = T.get(name, 0) + (time.perf_counter()-t0)*1e3
    setattr(obj, name, w)
for o, n in [(R, "_plan"), (R, "_run"), (B.KVBuffers, "allocate"), (B.KVBuffers, "ready"), (S.TierStack, "collect"),
             (S.TierStack, "fill"), (P.PrefixCache, "_build"), (P.PrefixCache, "hashes"), (P.PrefixCache, "_chain"),
             (R, "restore_chain"), (R, "_read_chunk"), (R, "_tasks"), (R, "_contiguous_runs"), (R, "record_digest"), (R, "_first_wrong_tokens"), (B, "_host_views"), (B, "prefault"), (B, "_blank_arrays"), (NS.SSDStore if hasattr(NS,'SSDStore') else NS.Namespace, "lookup")]:
    try: wrap(o, n)
    except AttributeError as e: print("skip", n, e)
d = Path(sys.argv[1]); shape = SHAPES[sys.argv[2] if len(sys.argv) > 2 else "tiny"]
ids = np.load(d / "ids.npy")
pc = open_prefix_cache(d, shape)
for i in range(8):
    T.clear()
    t0 = time.perf_counter(); hit = pc.fetch(ids); t1 = time.perf_counter(); mx.eval(cache_pairs(hit.cache)); t2 = time.perf_counter()
    print("fetch %.2f eval %.2f | " % ((t1-t0)*1e3, (t2-t1)*1e3) + " ".join("%s=%.2f" % kv for kv in T.items()))
    pc.release(hit); del hit
pc.close()
