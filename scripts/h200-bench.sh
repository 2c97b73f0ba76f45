#!/usr/bin/env bash
# The tracer's GPU overhead (benchmarks/gpu_overhead.py) on the H200, the issue's workload:
#   bash scripts/h200-bench.sh OUT [extra flags]      e.g. --modes default,piecewise, then --modes eager
# Writes OUT/gpu-overhead.json and OUT/gpu-overhead.md (the README table) and prints each case's
# wall time as it ends. A second call into the same OUT merges its cases with the first's (same
# workload), so the cases can be split across calls; cases that would end after
# PAGEDTRACE_BENCH_LIMIT_S (default 510 s) are skipped and listed, so one call stays under ~9 minutes.
set -uo pipefail
OUT=${1:?usage: h200-bench.sh OUTDIR [benchmark flags]}; shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$REPO" || exit 1
if [ -f .device/install.sh ]; then
  # shellcheck disable=SC1091
  source .device/install.sh env  # vLLM 0.26 on PYTHONPATH (installed from the parts); FlashInfer's sampler off
else
  echo "no .device/install.sh: using the python3 on PATH and PYTHONPATH as they are" >&2
fi
export PYTHONPATH="$REPO:${PYTHONPATH:-}"  # tracer and tracer.format from this checkout; no libcst needed
merge=()
[ -f "$OUT/gpu-overhead.json" ] && merge=(--merge "$OUT/gpu-overhead.json")
start=$(date +%s)
python3 benchmarks/gpu_overhead.py --model qwen2.5-7b-instruct \
  --json "$OUT/gpu-overhead.json" --md "$OUT/gpu-overhead.md" \
  --time-limit "${PAGEDTRACE_BENCH_LIMIT_S:-510}" "${merge[@]}" "$@"
rc=$?
echo "h200-bench: exit $rc after $(( $(date +%s) - start )) s; wrote $OUT/gpu-overhead.json and $OUT/gpu-overhead.md"
exit $rc
