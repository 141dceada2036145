#!/bin/bash
OUT=/work/mb/s29/bench
CFG=/work/main/results/summaries/20261128-prefill-budget/serve_warm_restart_repeats.toml
for t in after before; do
  if [ $t = before ]; then D=/work/wt-before; else D=/work/main; fi
  cd $D && uptime >> $OUT/load.txt && PYTHONPATH=$D /work/main/.venv/bin/python -c "import sys; from kvtool.cli.app import main; sys.argv[0]='kvtool'; sys.exit(main())" bench $CFG --out $OUT/serve-$t > $OUT/serve-$t.log 2>&1
  uptime >> $OUT/load.txt
done
