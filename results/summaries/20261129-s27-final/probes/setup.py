import sys, numpy as np
from pathlib import Path
from kvtool.bench.restore_worker import synthetic_kv, make_cache, store_kv, token_ids
from kvtool.bench.restore import SHAPES
n = int(sys.argv[1]); d = Path(sys.argv[2]); shape = SHAPES[sys.argv[3] if len(sys.argv) > 3 else "tiny"]
ids = token_ids(n)
cache = make_cache(synthetic_kv(shape, n))
store_kv(d, shape, ids, cache)
np.save(d / "ids.npy", ids)
