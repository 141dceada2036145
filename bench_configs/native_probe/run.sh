#!/usr/bin/env bash
# Compiled floors of `validate --deep`'s two big costs on a cache built by million_blocks.py
# (see README.md): the index read, and the segment files' read and digests on every core.
# Needs gcc, sqlite3.h (Debian: libsqlite3-dev) and libxxhash.so.0 (Debian: libxxhash0).
#   bench_configs/native_probe/run.sh CACHE_DIR [REPEATS]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="$1"; repeats="${2:-3}"
ns="$(find "$cache" -mindepth 1 -maxdepth 1 -type d | head -1)"
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT
gcc -O2 -o "$out/index_read" "$here/index_read.c" -lsqlite3 -lm
gcc -O2 -o "$out/segment_read" "$here/segment_read.c" -l:libxxhash.so.0
cores="$(nproc)"
for _ in $(seq "$repeats"); do
  sync
  echo "index: $("$out/index_read" "$ns/index.sqlite")"
  sync
  start=$(date +%s%N)
  for p in $(seq 0 $((cores - 1))); do "$out/segment_read" "$ns" "$p" "$cores" & done; wait
  echo "segments on $cores cores: $(( ($(date +%s%N) - start) / 1000000 )) ms wall"
done
