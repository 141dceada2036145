"""Back-to-back multi-turn (closed loop, 1 client): 8 conversations x T turns round-robin, all to ONE
server, then the next server; servers rotate order per round. Assistant turns are synthetic text
(as kvtool bench's multi-turn). Prints per server per round the warm TTFT p50 and mean."""
import sys, time, random, json, statistics, http.client
ports = [int(p) for p in sys.argv[1].split(",")]; turns = int(sys.argv[2]); rounds = int(sys.argv[3]); SEED = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
def ask(port, msgs):
    t0 = time.perf_counter(); first = None
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/chat/completions", body=json.dumps({"model": "default_model", "messages": msgs,
              "max_tokens": 8, "temperature": 0, "stream": True}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    for line in r:
        if first is None and line.startswith(b"data:") and b'"content"' in line: first = time.perf_counter()
    c.close()
    return (first - t0) * 1e3
res = {p: [] for p in ports}
for rd in range(rounds):
    order = ports[rd % len(ports):] + ports[:rd % len(ports)]
    for p in order:
        rng = random.Random(SEED + rd)
        words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
        text = lambda n: " ".join(rng.choice(words) for _ in range(n))
        convs = [[{"role": "system", "content": f"round {SEED + rd} conv {i} " + text(rng.randint(700, 1400))}] for i in range(8)]
        warm = []
        for t in range(turns):
            for conv in convs:
                conv.append({"role": "user", "content": text(30)})
                a = ask(p, conv)
                if t > 0: warm.append(a)
                conv.append({"role": "assistant", "content": text(30)})
        res[p].append((round(statistics.median(warm), 2), round(statistics.fmean(warm), 2)))
        print(rd, p, res[p][-1], flush=True)
print(json.dumps({p: {"p50_med": statistics.median(x[0] for x in v), "mean_med": statistics.median(x[1] for x in v), "runs": v} for p, v in res.items()}))
