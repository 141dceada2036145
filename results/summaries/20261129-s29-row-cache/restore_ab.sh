#!/bin/bash
# restore.py (fresh process per repeat) before/after alternated: b, a, a, b
OUT=/work/mb/s29/bench
for t in before after after before; do
  n=$((n+1))
  if [ $t = before ]; then d=/work/wt-before; else d=/work/main; fi
  cd $d && PYTHONPATH=$d /work/main/.venv/bin/python bench_configs/restore.py --shapes tiny --lengths 4096,16384,32768 --repeats 3 --parts load --out $OUT/restore-$n-$t > $OUT/restore-$n-$t.log 2>&1
  echo "$n $t $(uptime)" >> $OUT/load.txt
done
