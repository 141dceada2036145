#!/bin/bash
# restore before/after alternated: b, a, a, b
set -x
OUT=/work/mb/s28/bench
for t in before after after before; do
  n=$((n+1))
  cd /work/wt-$t && PYTHONPATH=/work/wt-$t /work/main/.venv/bin/python bench_configs/restore.py --shapes tiny,qwen0.5b-f32 --lengths 4096,16384 --repeats 3 --parts load,writer --out $OUT/restore-$n-$t > $OUT/restore-$n-$t.log 2>&1
  uptime >> $OUT/load.txt
done
