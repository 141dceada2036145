import os, sys, time, tempfile, statistics, collections
from pathlib import Path
sys.path.insert(0, sys.argv[2] if len(sys.argv) > 2 else "/work/main")
import mlx.core as mx
import mlx_lm.models.cache
from kvtool.bench import restore_worker as rw
from kvtool.bench.restore import SHAPES
from kvtool.bench.restore_pagecache import warm
from kvtool.cache import prefix as P
from kvtool.tiers import stack as S
from kvtool.kv import buffers as B
from kvtool.disk import restore as R
acc = collections.defaultdict(list)
cur = {}
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); cur[label] = cur.get(label, 0) + time.perf_counter() - t; return r
    setattr(obj, name, g)
wrap(P.PrefixCache, "hashes", "hashes"); wrap(P.PrefixCache, "_chain", "chain")
wrap(S.TierStack, "collect", "collect"); wrap(B.KVBuffers, "allocate", "allocate")
wrap(R, "_plan", "plan"); wrap(R, "_run", "run"); wrap(B.KVBuffers, "ready", "ready"); wrap(B.KVBuffers, "caches", "caches")
wrap(P.PrefixCache, "release", "release"); wrap(R.seg, "preadv_all", "preadv"); wrap(R.seg, "record_checksum", "cksum"); from kvtool.disk import namespace as NS, header_cache as HC; wrap(NS.SSDStore, "open_segment", "openseg"); wrap(R, "_readahead", "readahead"); wrap(HC.HeaderCache, "read", "hdr"); wrap(NS.SSDStore, "seg_path", "segpath"); wrap(NS.SSDStore, "lookup", "lookup"); wrap(B, "_blank_arrays", "blank"); wrap(B, "prefault", "prefault")
import os
if os.environ.get("ZEROS"): B.BLANK_MIN_TENSOR_BYTES = 1 << 40
if os.environ.get("BLANK"): B.BLANK_MIN_TENSOR_BYTES = 0
if os.environ.get("INLINE"): R.PARALLEL_MIN_BYTES = 1 << 40
if os.environ.get("CACHE_LIMIT"): mx.set_cache_limit(int(os.environ["CACHE_LIMIT"]) << 20)
n = int(sys.argv[1])
shape = SHAPES[os.environ.get("SHAPE", "tiny")]; root = Path(tempfile.mkdtemp())
ids = rw.token_ids(n); pairs = rw.synthetic_kv(shape, n)
cd = root / "kv"; rw.store_kv(cd, shape, ids, rw.make_cache(pairs)); del pairs
warm([cd]); pc = rw.open_prefix_cache(cd, shape)
def one():
    t = time.perf_counter()
    hit = pc.fetch(ids); mx.eval(rw.cache_pairs(hit.cache)); pc.release(hit)
    cur["total"] = time.perf_counter() - t
    if os.environ.get("CLEAR"): del hit; mx.clear_cache()
for _ in range(20): one(); cur.clear()
for _ in range(100):
    one()
    for k, v in cur.items(): acc[k].append(v * 1e3)
    cur.clear()
for k, v in acc.items(): print(f"{k:10s} {statistics.median(v):.3f}")
import sys; sys.exit(0)
import cProfile, pstats
pr=cProfile.Profile(); pr.enable()
for _ in range(100): one()
pr.disable(); st=pstats.Stats(pr); st.sort_stats("cumtime").print_callees("open_segment|header_cache.py.*read|check_header|open_read|check_regular")
import os; print(len(os.listdir(cd)), [len(f) for f in os.walk(cd)][:3])
