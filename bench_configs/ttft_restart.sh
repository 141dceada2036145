#!/usr/bin/env bash
# Cold vs SSD-hit TTFT of one long prompt served by two processes in a row (the closing-note figures).
#   bench_configs/ttft_restart.sh PRESET TOKENS      e.g.  bench_configs/ttft_restart.sh tiny 4096
set -euo pipefail
preset=${1:-tiny}; tokens=${2:-4096}
bin=$(dirname "$0")/../.venv/bin
work=$(mktemp -d)
"$bin/python" - "$preset" "$tokens" "$work/prompt.txt" <<'PY'
import sys, pydoc_data.topics as t
from kvtool.models.loader import load_model
preset, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tok = load_model(preset).tokenizer
ids = tok.encode("\n\n".join(t.topics[k] for k in sorted(t.topics)))[:n]
open(out, "w").write(tok.decode(ids))
PY
for run in cold ssd-hit; do
  KVTOOL_CACHE_DIR=$work/kv "$bin/kvtool" serve-once --model "$preset" --json --prompt-file "$work/prompt.txt" \
    --max-tokens 16 > "$work/$run.json"
  "$bin/python" -c "import json,sys; r=json.load(open(sys.argv[1]))['requests'][0]; print(sys.argv[2], {k: r[k] for k in ('prompt_tokens','ssd_hit_tokens','prefill_tokens','ttft_ms','ssd_load_ms')})" "$work/$run.json" "$run"
done
"$bin/python" -c "import json,sys; a,b=(json.load(open(f))['requests'][0] for f in sys.argv[1:]); print('same token_ids:', a['token_ids']==b['token_ids'], '| TTFT speed-up: %.1fx' % (a['ttft_ms']/b['ttft_ms']))" "$work/cold.json" "$work/ssd-hit.json"
rm -rf "$work"
