"""Mixed RAM+SSD hit TTFT: tree, preset, tokens. Prints ttft of the mixed hits (median of N)."""
import sys, tempfile, statistics, shutil
sys.path.insert(0, sys.argv[1])
import numpy as np
from kvtool import KVToolConfig
from kvtool.engine import Engine
preset, T, N = sys.argv[2], int(sys.argv[3]), 8
d = tempfile.mkdtemp()
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 3000, T).tolist() for _ in range(N)]
eng = Engine.from_spec(preset, KVToolConfig(ssd_cache_dir=d))
for p in prompts:
    eng.generate(p, max_tokens=1)
eng.close()
eng = Engine.from_spec(preset, KVToolConfig(ssd_cache_dir=d))
ttft, split = [], []
for p in prompts:
    eng.generate(p[: T // 2 + 3], max_tokens=1)  # SSD hit, promoted into RAM
    r = eng.generate(p, max_tokens=1)
    ttft.append(r.ttft_ms); split.append((r.ram_hit_tokens, r.ssd_hit_tokens))
eng.close(); shutil.rmtree(d)
print(sys.argv[1].split("/")[-1], preset, T, "mixed-hit TTFT ms median %.2f [%.2f-%.2f]" % (statistics.median(ttft), min(ttft), max(ttft)), split[0])
