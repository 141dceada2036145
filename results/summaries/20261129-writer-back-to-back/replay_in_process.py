"""Multi-turn replay in one process: per turn, fetch + prefill of the rest + first token (TTFT-like),
kvtool's KVToolPromptCache vs mlx-lm's LRUPromptCache(1000). 8 conversations x TURNS turns round robin."""
import sys, time, statistics, tempfile, shutil, json
from pathlib import Path
tree = sys.argv[1]; which_all = sys.argv[2].split(","); turns = int(sys.argv[3]); extra = sys.argv[4:] 
sys.path.insert(0, tree)
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import KVCache, LRUPromptCache, make_prompt_cache
from kvtool import KVToolConfig, PrefixCache
from kvtool.models.loader import load_model
from kvtool.server.adapter import KVToolPromptCache
import os, gc, threading
GCT = [0.0, 0]
_g = {}
def _cb(phase, info):
    if phase == "start": _g["t"] = time.perf_counter()
    else: GCT[0] += time.perf_counter() - _g["t"]; GCT[1] += 1
gc.callbacks.append(_cb)
COPY = bool(os.environ.get('COPY')); SPLIT = bool(os.environ.get('SPLIT'))
tiny = load_model("tiny")
GEN = [5, 6, 7]
def extract(cache):
    out = []
    for c in cache:
        n = KVCache(); n.keys, n.values = mx.contiguous(c.keys[..., :c.offset, :]), mx.contiguous(c.values[..., :c.offset, :]); n.offset = c.offset; out.append(n)
    return out
def run(which):
    work = Path(tempfile.mkdtemp(prefix="mtcalls-"))
    if which == "mlx-lm":
        pc = LRUPromptCache(max_size=1000)
    else:
        kw = dict(ssd_cache_dir=work, block_size=64, ram_bytes=256 << 20)
        if which == "kvtool-nossd": kw["ssd_enabled"] = False
        cfg = KVToolConfig(**kw)
        pc = KVToolPromptCache(PrefixCache.for_model(tiny.model, cfg, model_id="m" * 32), model_key="m", model=tiny.model)
    rng = np.random.default_rng(0)
    convs = [rng.integers(10, 1000, int(rng.integers(1500, 3000))).tolist() for _ in range(8)]
    per_turn = {t: {"fetch": [], "mat": [], "fw1": [], "rest": [], "flt": [], "ttft": [], "final": [], "seg": []} for t in range(turns)}
    for t in range(turns):
        for ci in range(8):
            if t > 0:
                convs[ci] = convs[ci] + rng.integers(10, 1000, 85).tolist()
            p = convs[ci] + GEN
            seg_end = len(convs[ci])
            t0 = time.perf_counter()
            cache, rest = pc.fetch_nearest_cache("m", p)
            t1 = time.perf_counter()
            cache = cache if cache is not None else make_prompt_cache(tiny.model)
            if COPY and which != "mlx-lm" and len(rest) < len(p):
                cache = extract(cache)
            if SPLIT: mx.eval([c.state for c in cache])
            t1b = time.perf_counter()
            start = len(p) - len(rest)
            if start < seg_end:
                import resource; f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; tf1 = time.perf_counter(); tiny.model(mx.array([p[start:seg_end]]), cache=cache); mx.eval([c.state for c in cache])
                ts = time.perf_counter(); per_turn[t]["fw1"].append((ts-tf1)*1e3); per_turn[t]["flt"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0); pc.insert_cache("m", p[:seg_end], extract(cache), cache_type="user"); per_turn[t]["seg"].append((time.perf_counter()-ts)*1e3)
            logits = tiny.model(mx.array([p[max(start, seg_end):]]), cache=cache)
            tok = [int(mx.argmax(logits[0, -1]).item())]
            t2 = time.perf_counter()
            for _ in range(7):
                logits = tiny.model(mx.array([[tok[-1]]]), cache=cache); tok.append(int(mx.argmax(logits[0, -1]).item()))
            tf = time.perf_counter(); pc.insert_cache("m", p + tok[:-1], extract(cache), cache_type="assistant"); per_turn[t]["final"].append((time.perf_counter()-tf)*1e3)
            per_turn[t]["fetch"].append((t1-t0)*1e3); per_turn[t]["rest"].append(len(rest)); per_turn[t]["mat"].append((t1b-t1)*1e3); per_turn[t]["ttft"].append((t2-t0)*1e3)
            convs[ci] = p + tok
    print(which, "threads", [t.name for t in threading.enumerate()], "gc ms", round(GCT[0]*1e3,1), "n", GCT[1], "objs", len(gc.get_objects()), "active MB", mx.get_active_memory()>>20, "cache MB", mx.get_cache_memory()>>20, flush=True); GCT[0]=0; GCT[1]=0
    if which != "mlx-lm": pc.close()
    shutil.rmtree(work, ignore_errors=True)
    return {t: {k: round(statistics.median(v), 2) if v else None for k, v in d.items()} for t, d in per_turn.items()}
res = {}
for r in range(int(extra[0]) if extra else 1):
    for w in (which_all if r % 2 == 0 else which_all[::-1]):
        res.setdefault(w, []).append(run(w))
for w, runs in res.items():
    for t in range(turns):
        print(w, "turn", t+1, " ".join(f"{k}={statistics.median([r[t][k] for r in runs if r[t][k] is not None]) if any(r[t][k] is not None for r in runs) else '-'}" for k in ("rest","fetch","mat","fw1","flt","ttft","seg","final")))
