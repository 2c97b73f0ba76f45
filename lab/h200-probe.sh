#!/usr/bin/env bash
# The PIECEWISE overhead probe on the H200 (lab/h200_overhead_probe.py), SM clock sampled:
#   T=575 U=455 [V=variants] bash lab/h200-probe.sh
# T: the call's time limit (s); U: no round starts after U s (leave ~100 s for the engine's start
# and the last round); V: the variants, interleaved round by round (default: untraced, the tracer
# as it is by default, and the same with its copies' bytes sent down the pipe). Writes
# $OUT/probe.txt, probe.json, clocks.txt.xz and gpu.txt; read them with lab/probe_analysis.py
# (several runs pool).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
if [ -f .device/install.sh ]; then
  # shellcheck disable=SC1091
  source .device/install.sh env  # vLLM 0.26 on PYTHONPATH (installed from the parts)
else
  echo "no .device/install.sh: using the python3 on PATH and PYTHONPATH as they are" >&2
fi
export PYTHONPATH="$REPO:${PYTHONPATH:-}" VLLM_LOGGING_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,power.limit,pstate --format=csv | tee "$OUT/gpu.txt"
echo "nproc: $(nproc)" >> "$OUT/gpu.txt"
timeout "${T:-575}" python3 lab/h200_overhead_probe.py --mode PIECEWISE --rounds 400 --until "${U:-455}" --no-profile \
  --variants "${V:-untraced,metadata,metadata-pipe}" \
  --clocks "$OUT/clocks.txt" --json "$OUT/probe.json" 2>&1 \
  | grep --line-buffered -v "^\(INFO\|WARNING\|\[\|(EngineCore\)" | grep --line-buffered -v "Capturing CUDA graphs" > "$OUT/probe.txt"
echo "probe rc ${PIPESTATUS[0]}"
grep -v "^round " "$OUT/probe.txt" | tail -40
[ -f "$OUT/clocks.txt" ] && xz -9 -f "$OUT/clocks.txt"
ls -la "$OUT"
