import sys, time, functools, collections
src = open("/tmp/prof/writer_cpu.py").read()
src = src.replace("import kvtool.tiers.writer as W", """import kvtool.tiers.writer as W
import kvtool.tiers.tail_prefix as TP, kvtool.tiers.siblings as SB, kvtool.tiers.ram as RAMM, kvtool.tiers.ssd as SSDM, kvtool.tiers.pending as PEN
ACC = collections.defaultdict(float)
def wrapf(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.thread_time()
        try: return f(*a, **k)
        finally: ACC[label] += time.thread_time() - t
    setattr(obj, name, w)
wrapf(TP, "candidates", "tail.candidates"); wrapf(TP, "find", "tail.find"); wrapf(SB, "find", "sib.find"); wrapf(SB, "usable_lens", "sib.usable_lens"); wrapf(SB, "truncate", "sib.truncate"); wrapf(RAMM.RamBlockTier, "sibling_used", "ram.sibling_used"); wrapf(RAMM.RamBlockTier, "_children", "ram._children"); wrapf(PEN.PendingTier, "_children", "pen._children")
for cls, lab in ((RAMM.RamBlockTier, "ram"), (SSDM.SsdBlockTier, "ssd"), (PEN.PendingTier, "pending")):
    for m in ("find_any", "sibling_candidates", "longest_prefix"):
        if m in vars(cls) or hasattr(cls, m): wrapf(cls, m, f"{lab}.{m}")
""")
src += "\nn = len(main['fetch'])\nprint('  '.join('%s %.3f' % (k, v * 1e3 / n) for k, v in sorted(ACC.items())))\n"
exec(src)
