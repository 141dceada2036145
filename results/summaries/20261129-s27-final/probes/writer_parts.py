import sys, time, functools, collections
src = open("/tmp/prof/writer_cpu.py").read()
src = src.replace("import kvtool.tiers.writer as W", """import kvtool.tiers.writer as W
import kvtool.disk.namespace_save as NSV, kvtool.disk.segment as SEG, kvtool.disk.index as IDX, kvtool.tiers.writer_batch as WB, kvtool.disk.fsops as FS
ACC = collections.defaultdict(float); CNT = collections.Counter()
def wrapf(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.thread_time()
        try: return f(*a, **k)
        finally: ACC[label] += time.thread_time() - t; CNT[label] += 1
    setattr(obj, name, w)
S = [c for c in vars(NSV).values() if isinstance(c, type) and hasattr(c, "_write_segment")][0]
for m in ("_save_locked", "_write_segment", "_write_file", "save_blocks"): wrapf(S, m, "save." + m)
wrapf(SEG, "encode", "seg.encode"); wrapf(NSV.seg, "tokens_digest", "seg.tokens_digest")
wrapf(IDX.BlockIndex, "insert_segment", "idx.insert_segment"); wrapf(IDX.BlockIndex, "get_many", "idx.get_many")
wrapf(WB.Counters, "inc", "counters.inc"); wrapf(WB.RetryPolicy, "save_batch", "policy.save_batch")
""")
src += "\nn = len(main['fetch'])\nfor k, v in sorted(ACC.items()): print('%-28s %.3f ms/req  %.1f calls/req' % (k, v * 1e3 / n, CNT[k] / n))\n"
exec(src)
