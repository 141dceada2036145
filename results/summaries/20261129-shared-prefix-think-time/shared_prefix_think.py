"""1-client shared-prefix, servers alternated per round (24 distinct questions per round and server)."""
import sys, time, random, json, statistics, http.client
ports = [int(p) for p in sys.argv[1].split(",")]; rounds = int(sys.argv[2]); sys_words = int(sys.argv[3]) if len(sys.argv) > 3 else 800; QSEED = int(sys.argv[4]) if len(sys.argv) > 4 else 100
THINK = float(sys.argv[5]) / 1e3 if len(sys.argv) > 5 else 0.0
rng = random.Random(0)
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
system = " ".join(rng.choice(words) for _ in range(sys_words))
def ask(port, q):
    t0 = time.perf_counter(); first = None
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": "default_model", "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
        "max_tokens": 8, "temperature": 0, "stream": True}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    for line in r:
        if first is None and line.startswith(b"data:") and b'"content"' in line: first = time.perf_counter()
    c.close()
    r = (first - t0) * 1e3; time.sleep(THINK); return r
for p in ports: ask(p, "prime")
res = {p: [] for p in ports}
for rd in range(rounds):
    qrng = random.Random(QSEED + rd)
    qs = [" ".join(qrng.choice(words) for _ in range(14)) for _ in range(24)]
    order = ports[rd % len(ports):] + ports[:rd % len(ports)]
    for p in order:
        res[p].append(statistics.median(ask(p, q) for q in qs))
print({p: (round(statistics.median(v), 2), [round(x, 1) for x in v]) for p, v in res.items()})
