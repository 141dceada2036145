"""Shared-prefix at C clients, servers alternated per round: PORTS ROUNDS CLIENTS QSEED."""
import sys, time, random, json, statistics, http.client, threading
ports = [int(p) for p in sys.argv[1].split(",")]; rounds = int(sys.argv[2]); C = int(sys.argv[3]); QSEED = int(sys.argv[4])
rng = random.Random(0)
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
system = " ".join(rng.choice(words) for _ in range(800))
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
    return (first - t0) * 1e3
for p in ports: ask(p, "prime")
res = {p: [] for p in ports}
for rd in range(rounds):
    qrng = random.Random(QSEED + rd)
    qs = [" ".join(qrng.choice(words) for _ in range(14)) for _ in range(6 * C)]
    order = ports[rd % len(ports):] + ports[:rd % len(ports)]
    for p in order:
        out = []
        def worker(k):
            for q in qs[k::C]:
                out.append(ask(p, q))
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(C)]
        [t.start() for t in ts]; [t.join() for t in ts]
        res[p].append(statistics.median(out))
print({p: (round(statistics.median(v), 2), [round(x, 1) for x in v]) for p, v in res.items()})
