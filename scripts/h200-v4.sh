#!/usr/bin/env bash
# Format 4 on the H200 (kept query rows, key/value stored once), after
#   source .device/install.sh env; bash scripts/h200-v4.sh OUT
# Small traces, each replayed on that host through the Python API (scripts/replay_checks.py,
# OUT/replay-v4.json), then packed as OUT/<name>.tar (committable fixtures):
#   qwen2.5-7b-default-rows   default FULL_AND_PIECEWISE, tensors of layers 0 and 27 inside the full
#                             graphs, 8 query rows a step, whole blocks every 3rd step
#   llama3.1-8b-fp8-rows      fp8 KV cache (the key/value differ from the cache: stored), default
#                             mode, tensors of layer 0, 4 query rows a step, check every 2nd step
set -uo pipefail
OUT=${1:?usage: h200-v4.sh OUTDIR}
ONLY=${ONLY:-}
LOG="$OUT/v4.log"
H200_GREP="pagedtrace:|Traceback|Error"
source scripts/h200-common.sh
h200_prepare
names=()
run() {  # name, args...
  h200_run "$@" && names+=("$OUT/work/$1")
}
run qwen2.5-7b-default-rows --model qwen2.5-7b-instruct --prompts 4 --shared-prefix 32 --prompt-len 40:120 \
  --max-tokens 12 --layers 0,27 --query-rows 8 --kv-check-every 3 --budget-mb 24 --cudagraph-mode FULL_AND_PIECEWISE
run llama3.1-8b-fp8-rows --model llama-3.1-8b --prompts 3 --shared-prefix 32 --prompt-len 40:100 \
  --max-tokens 8 --layers 0 --kv-cache-dtype fp8 --query-rows 4 --kv-check-every 2 --budget-mb 12 \
  --cudagraph-mode FULL_AND_PIECEWISE
if [ ${#names[@]} -gt 0 ]; then
  timeout 240 python3 scripts/replay_checks.py -o "$OUT/replay-v4.json" "${names[@]}" >>"$LOG" 2>&1
  echo "== replay_checks: exit $?" | tee -a "$LOG"
  for d in "${names[@]}"; do
    python3 -c "
import sys
from tracer.format import Trace
t = Trace.open(sys.argv[1]); rec = [r for r in t.records if r.tensors]
print(' ', t.path.name, 'format', t.run.format_version, 'records', len(t.records), 'with tensors', len(rec),
      'kept rows in', sum('query_rows' in r.tensor_names for r in rec), 'key/value once in',
      sum('kv_inputs_written' in r.tensor_names for r in rec), 'graphs', sorted({r.cudagraph for r in rec}))
" "$d" >>"$LOG" 2>&1
    tar -C "$OUT/work" -cf "$OUT/$(basename "$d").tar" "$(basename "$d")"
  done
fi
du -sh "$OUT"/work/*/ | tee -a "$LOG"
rm -rf "$OUT/work"
ls -la "$OUT"
