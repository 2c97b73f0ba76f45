#!/usr/bin/env bash
# Trace the qwen2.5-7b-instruct preset on an H200 (FlashAttention 3) in three modes.
# Run on the device machine after vLLM is installed there (see README, "Tracing on a GPU"):
#   source .device/install.sh env; bash scripts/h200-traces.sh "$OUT"
# Writes OUT/eager (tensors, a few steps: the GPU test fixture), OUT/piecewise,
# OUT/default (FULL_AND_PIECEWISE: decode steps replay in CUDA graphs, so the tracer
# reports them as gaps) and a log per mode.
set -uo pipefail
OUT=${1:?usage: h200-traces.sh OUTDIR}
mkdir -p "$OUT"
pip install -q --no-deps --no-build-isolation --target /tmp/vllm-site . >"$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
export PYTHONPATH="/tmp/vllm-site:$PWD:${PYTHONPATH:-}"
export VLLM_ENABLE_V1_MULTIPROCESSING=0
common=(--model qwen2.5-7b-instruct --prompts 4 --prompt-len 8:24 --shared-prefix 32 --seed 0 --max-model-len 2048)
run() {  # name, extra args...
  local name=$1; shift
  local t0=$(date +%s)
  ${PAGEDTRACE:-python3 scripts/pagedtrace_run.py} run -o "$OUT/$name" "${common[@]}" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s"
  grep -E "Using FlashAttention|cudagraph|Traceback|Error" "$OUT/$name.log" | grep -v "^ " | head -5
}
run eager --max-tokens 6 --budget-mb 8
run piecewise --max-tokens 6 --no-tensors --cudagraph-mode PIECEWISE
run default --max-tokens 6 --no-tensors --cudagraph-mode FULL_AND_PIECEWISE
for d in eager piecewise default; do
  [ -f "$OUT/$d/steps.jsonl" ] && python3 - "$OUT/$d" <<'PY'
import sys, json
from tracer.format import Trace
t = Trace.open(sys.argv[1])
kinds = {}
for r in t.records: kinds[r.kind] = kinds.get(r.kind, 0) + 1
print(sys.argv[1], "backend", t.run.attention_backend, "FA", t.run.flash_attn_version, "mode", t.run.cudagraph_mode,
      "records", kinds, "gaps", [(g.step, g.kind, g.reason[:40]) for g in t.gaps][:12])
kv = t.run.kv_cache
print("  kv", kv.shape, kv.stride, kv.layout, kv.dtype, kv.backend_stride_order)
PY
done
du -sh "$OUT"/* | head -20
# Results come back as at most 8 files, 2 folders deep: one tar per trace.
for d in eager piecewise default; do
  [ -d "$OUT/$d" ] && tar -C "$OUT" -cf "$OUT/$d.tar" "$d" && rm -rf "$OUT/$d"
done
ls -la "$OUT"
