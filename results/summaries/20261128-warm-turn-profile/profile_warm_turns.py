import dataclasses, subprocess, sys, tempfile, time, importlib.util
from pathlib import Path
sys.path.insert(0, '/work/main')
spec_ = importlib.util.spec_from_file_location("sp", "/work/main/bench_configs/serve_paired.py"); sp = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(sp)
from kvtool.bench.loadcell import WARMUP_MESSAGES, build_workloads, load_serve_load
from kvtool.bench.loadgen import LoadRequest, LoadSpec, run_load
from kvtool.models.loader import resolve_spec
kind = sys.argv[1]
spec = load_serve_load("/work/main/bench_configs/serve_load.toml")
w = dict(sp.MULTI_TURN, conversations=8, turns=10, restart_after=0)
spec = dataclasses.replace(spec, workloads={"multi-turn": w})
model_path = str(resolve_spec(spec.model)[0])
(workload,) = build_workloads(spec, model_path)
reqs = [dataclasses.replace(r, after=None) for ph in workload.measured for r in workload.phase_requests(ph)]
prime, measured = [r for r in reqs if r.key.endswith("t0")], [r for r in reqs if not r.key.endswith("t0")]
work = Path(tempfile.mkdtemp())
s = sp.start(kind, 0, spec, model_path, work)
try:
    run_load(s.base_url, [LoadRequest("warmup", WARMUP_MESSAGES, 2, "warmup")], LoadSpec(clients=1))
    run_load(s.base_url, prime, LoadSpec(clients=1))
    spy = subprocess.Popen(["/work/main/.venv/bin/py-spy", "record", "--pid", str(s.proc.pid), "--threads", "--idle", "-f", "raw", "-o", f"/work/mb/s19/prof-nb-{kind}.txt", "-r", "200", "--nonblocking"])
    time.sleep(1)
    t = []
    for r in measured:
        res = run_load(s.base_url, [r], LoadSpec(clients=1)); t.append(res.records[0].ttft_ms)
    spy.send_signal(2); spy.wait(60)
    import statistics; print(kind, "warm TTFT p50", statistics.median(t), len(t))
finally:
    s.stop()
