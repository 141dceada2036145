cd /work/main
for r in 1 2 3 4 5; do
  if [ $((r % 2)) -eq 1 ]; then order="kvtool|kvtool:--policy evict_only|kvtool:--no-ssd|mlx-lm-1000"; else order="mlx-lm-1000|kvtool:--no-ssd|kvtool:--policy evict_only|kvtool"; fi
  IFS='|'; for v in $order; do
    echo "r$r $(.venv/bin/python bench_configs/serve_paired.py --workload multi-turn --clients 1 --turns 8 --servers "$v" 2>&1 | tail -1) load $(cut -d' ' -f1 /proc/loadavg)"
  done; unset IFS
done
