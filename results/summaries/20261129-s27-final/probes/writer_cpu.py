import sys, time, statistics, tempfile, shutil, functools
from pathlib import Path
sys.path.insert(0, "/work/main")
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache
from kvtool import KVToolConfig, PrefixCache
from kvtool.models.loader import load_model
from kvtool.server.adapter import KVToolPromptCache
import kvtool.tiers.writer as W
import kvtool.tiers.writer_batch as WB
SYSTEM, USER, GEN = 2000, 60, [5, 6, 7]
wt = {"save": [], "nblocks": []}

cls = [c for c in vars(W).values() if isinstance(c, type) and hasattr(c, "_save_and_settle")][0]
o = cls._save_and_settle
def patched(self, blocks):
    t = time.thread_time(); w = time.perf_counter()
    try: return o(self, blocks)
    finally: wt["save"].append(((time.thread_time() - t) * 1e3, (time.perf_counter() - w) * 1e3)); wt["nblocks"].append(len(blocks))
cls._save_and_settle = patched
tiny = load_model("tiny")
system = np.random.default_rng(0).integers(10, 1000, SYSTEM).tolist()
seg_end = SYSTEM + USER
def prompt(i): return system + np.random.default_rng(100 + i).integers(10, 1000, USER).tolist() + GEN
def extract(cache):
    out = []
    for c in cache:
        n = KVCache(); n.keys, n.values = mx.contiguous(c.keys[..., : c.offset, :]), mx.contiguous(c.values[..., : c.offset, :]); n.offset = c.offset; out.append(n)
    return out
main = {"fetch": [], "seg": [], "final": []}
def request(pc, p, rec=True):
    t = time.thread_time(); cache, rest = pc.fetch_nearest_cache("m", p); f = time.thread_time() - t
    cache = cache if cache is not None else make_prompt_cache(tiny.model)
    start = len(p) - len(rest)
    if start < seg_end:
        tiny.model(mx.array([p[start:seg_end]]), cache=cache); mx.eval([c.state for c in cache])
        t = time.thread_time(); pc.insert_cache("m", p[:seg_end], extract(cache), cache_type="user"); s = time.thread_time() - t
    tiny.model(mx.array([p[max(start, seg_end):-1]]), cache=cache)
    toks = [p[-1]]
    for _ in range(8):
        lg = tiny.model(mx.array([[toks[-1]]]), cache=cache); toks.append(int(mx.argmax(lg[0, -1]).item()))
    t = time.thread_time(); pc.insert_cache("m", p + toks[1:-1], extract(cache), cache_type="assistant"); fi = time.thread_time() - t
    if rec: main["fetch"].append(f * 1e3); main["seg"].append(s * 1e3); main["final"].append(fi * 1e3)
    time.sleep(0.05)  # let the writer finish: its CPU is counted apart
work = Path(tempfile.mkdtemp())
cfg = KVToolConfig(ssd_cache_dir=work, block_size=64, ram_bytes=256 << 20)
pc = KVToolPromptCache(PrefixCache.for_model(tiny.model, cfg, model_id="m" * 32), model_key="m")
request(pc, prompt(-1), False); wt["save"].clear(); wt["nblocks"].clear()
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30): request(pc, prompt(i))
pc.close(); shutil.rmtree(work, ignore_errors=True)
med = lambda v: statistics.median(v)
print("main-thread CPU ms: fetch %.3f seg-insert %.3f final-insert %.3f" % (med(main["fetch"]), med(main["seg"]), med(main["final"])))
print("writer calls %d over %d requests, blocks/call median %s; CPU ms per call median %.3f (wall %.3f); CPU per request %.3f" % (
    len(wt["save"]), len(main["fetch"]), med(wt["nblocks"]), med([c for c, _ in wt["save"]]), med([w for _, w in wt["save"]]), sum(c for c, _ in wt["save"]) / len(main["fetch"])))
