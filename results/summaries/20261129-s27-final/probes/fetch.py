import sys, time, numpy as np
from pathlib import Path
import mlx.core as mx
import mlx_lm.models.cache
from kvtool.bench.restore_worker import open_prefix_cache, cache_pairs
from kvtool.bench.restore import SHAPES
d = Path(sys.argv[1]); shape = SHAPES[sys.argv[2] if len(sys.argv) > 2 else "tiny"]
mode = sys.argv[3] if len(sys.argv) > 3 else "time"
ids = np.load(d / "ids.npy")
pc = open_prefix_cache(d, shape)
def one():
    t0 = time.perf_counter(); hit = pc.fetch(ids); mx.eval(cache_pairs(hit.cache)); ms = (time.perf_counter()-t0)*1e3
    pc.release(hit); return ms, hit
if mode == "prof":
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable(); one(); pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
else:
    ms = [one()[0] for _ in range(6)]
    print("fresh-first %.2f then %s" % (ms[0], " ".join("%.2f" % m for m in ms[1:])))
pc.close()
