import sys, time, tempfile, functools, collections, subprocess, os
from pathlib import Path
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
import numpy as np
n = int(sys.argv[1])
if sys.argv[2] == "store":
    from kvtool.bench import restore_worker as rw
    from kvtool.bench.restore import SHAPES
    shape = SHAPES["tiny"]; root = Path(sys.argv[3])
    ids = rw.token_ids(n); pairs = rw.synthetic_kv(shape, n)
    rw.store_kv(root / "kv", shape, ids, rw.make_cache(pairs)); np.save(root / "ids.npy", ids)
    sys.exit()
import mlx.core as mx
import mlx_lm.models.cache
from kvtool.bench import restore_worker as rw
from kvtool.bench.restore import SHAPES
import kvtool.cache.prefix as P, kvtool.tiers.stack as S, kvtool.disk.restore as R, kvtool.kv.buffers as B, kvtool.disk.index as I
acc = collections.defaultdict(float)
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] += time.perf_counter()-t; return r
    setattr(obj, name, w)
for o, nm in [(P.PrefixCache,"hashes"),(S.TierStack,"collect"),(S.TierStack,"fill"),(B.KVBuffers,"allocate"),(B.KVBuffers,"ready"),(B.KVBuffers,"caches"),(R,"_plan"),(R,"_run"),(I.BlockIndex,"get_many")]:
    wrap(o, nm, nm)
root = Path(sys.argv[3]); ids = np.load(root / "ids.npy")
pc = rw.open_prefix_cache(root / "kv", SHAPES["tiny"])
t0 = time.perf_counter(); hit = pc.fetch(ids); t1 = time.perf_counter(); mx.eval(rw.cache_pairs(hit.cache)); t2 = time.perf_counter()
print(f"total {1e3*(t2-t0):.2f} fetch {1e3*(t1-t0):.2f} eval {1e3*(t2-t1):.2f} | " + " ".join(f"{k} {v*1e3:.2f}" for k, v in acc.items()))
