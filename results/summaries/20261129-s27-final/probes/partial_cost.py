import sys, os
src = open("/tmp/prof/writer_cpu.py").read()
if os.environ.get("NOPARTIAL"):
    src = src.replace("import kvtool.tiers.writer as W", "import kvtool.tiers.writer as W\nimport kvtool.cache.extend as EX\nEX.extend = lambda *a, **k: None\nimport kvtool.cache.prefix as PFX\nPFX.extend = EX.extend")
exec(src)
