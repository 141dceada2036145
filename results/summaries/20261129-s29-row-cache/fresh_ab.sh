#!/bin/bash
# first fetch of a fresh process, tiny 4k and 16k, before/after alternated 10x
D=$(mktemp -d)
for n in 4096 16384; do
  mkdir -p $D/$n && /work/main/.venv/bin/python /work/mb/s29/fresh.py $n store $D/$n
  for i in $(seq 10); do
    for t in before after; do
      if [ $t = before ]; then T=/work/wt-before; else T=/work/main; fi
      echo "$n $t $(cd /tmp && TREE=$T PYTHONPATH=$T /work/main/.venv/bin/python /work/mb/s29/fresh.py $n run $D/$n)"
    done
  done
done
rm -rf $D
