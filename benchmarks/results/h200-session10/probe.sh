#!/usr/bin/env bash
# On the H200: the PIECEWISE overhead probe with the SM clock sampled (session 9).
#   copy to .device/probe.sh, send with .device/install.sh (carry), then: T=575 U=455 bash .device/probe.sh
source .device/install.sh env
export PYTHONPATH=$PWD:$PYTHONPATH VLLM_LOGGING_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,power.limit,pstate --format=csv | tee "$OUT/gpu.txt"
nproc >> "$OUT/gpu.txt"
timeout "${T:-575}" python3 scripts/h200_overhead_probe.py --mode PIECEWISE --rounds 400 --until "${U:-430}" --no-profile \
  --variants "${V:-untraced,metadata,metadata-inline}" \
  --clocks "$OUT/clocks.txt" --json "$OUT/probe.json" > "$OUT/probe.txt" 2>&1
echo "probe rc $?"
grep -v "^round " "$OUT/probe.txt" | grep -v "^\(INFO\|WARNING\|\[\)" | tail -60
xz -9 -k "$OUT/clocks.txt" && rm "$OUT/clocks.txt"
ls -la "$OUT"
