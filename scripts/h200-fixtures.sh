#!/usr/bin/env bash
# The H200 fixtures of issue "Sharp verdicts": traces with tensors, eager unless said, few steps.
# Run on the device machine after vLLM is installed there (with FA2: WITH_FA2=1 bundle):
#   source .device/install.sh env; bash scripts/h200-fixtures.sh "$OUT"
# Writes OUT/<name>.tar (one trace each, its run log as engine.log inside), then replays every
# trace on that host with scripts/replay_checks.py into OUT/replay-device.json, for comparison
# with a replay of the same traces on the CPU machine (the FA2 PIECEWISE question).
#   gemma2-softcap-window  gemma-2-9b preset: soft-cap 50, 64-token window on layer 0 (not 1), layers 0,1
#   llama3.1-8b-fp8        llama-3.1-8b preset, kv_cache_dtype=fp8 (FA3 quantizes the query too)
#   qwen2.5-7b-bs32-chunked  block size 32, 32-token steps: a prompt's prefill split over steps
#   qwen2.5-7b-fa2         FlashAttention-2 (attention_config flash_attn_version=2)
#   qwen2.5-7b-fa2-piecewise  FA2 under PIECEWISE CUDA graphs (3 requests: decode batches padded to 4)
# `pagedtrace run` goes through scripts/pagedtrace_run.py: the CLI imports every subcommand, and the
# GPU host has no libcst for `annotate`.
# Sizes are kept to a few MB (the repo travels in 64 MiB with a 40 MiB bundle part): one layer
# where the layers' attention is the same, few prompts, a tensor budget.
set -uo pipefail
OUT=${1:?usage: h200-fixtures.sh OUTDIR}
ONLY=${ONLY:-}  # space-separated names to run a subset
LOG="$OUT/fixtures.log"
H200_GREP="Using FlashAttention|FLASH_ATTN|fp8|sliding|Traceback|Error|error"
source scripts/h200-common.sh
h200_prepare
run() {  # name, args...
  local name=$1 d="$OUT/work/$1"
  h200_run "$@" || return
    tar -C "$OUT/work" -cf "$OUT/$name.tar" "$name"  # now: a later run past the limit loses only itself
    python3 - "$d" >>"$LOG" 2>&1 <<'PY'
import sys
from tracer.format import Trace
t = Trace.open(sys.argv[1])
kinds, layers = {}, set()
for r in t.records:
    kinds[r.kind] = kinds.get(r.kind, 0) + 1
    layers.add(r.layer)
r0 = t.steps(kind="request")[0]
print(" backend", t.run.attention_backend.rsplit(".", 1)[-1], "FA", t.run.flash_attn_version, "mode", t.run.cudagraph_mode,
      "records", kinds, "layers", sorted(layers), "gaps", len(t.gaps))
kv = t.run.kv_cache
print(" kv", kv.shape, kv.stride, kv.layout, kv.dtype, kv.cache_dtype, "k/v scale", kv.k_scale, kv.v_scale)
for r in t.steps(kind="request")[:8]:
    print("  step", r.step, r.layer.split(".")[2], "tokens", r.num_actual_tokens, "seq_lens", r.seq_lens,
          "window", r.sliding_window, "softcap", r.logits_soft_cap, "scale", round(r.scale, 5),
          "q/k/v", r.q_scale, r.k_scale, r.v_scale, r.query_dtype, "tensors", bool(r.tensors))
PY
}
small=(--model qwen2.5-7b-instruct --shared-prefix 32 --prompt-len 8:24)
# FA2 PIECEWISE first: its device replay answers the issue's open question.
run qwen2.5-7b-fa2-piecewise "${small[@]}" --prompts 3 --max-tokens 4 --budget-mb 6 \
  --flash-attn-version 2 --cudagraph-mode PIECEWISE
[ -d "$OUT/work/qwen2.5-7b-fa2-piecewise" ] && python3 scripts/replay_checks.py -o "$OUT/replay-piecewise.json" \
  "$OUT/work/qwen2.5-7b-fa2-piecewise" 2>&1 | tee -a "$LOG"
run gemma2-softcap-window --model gemma-2-9b --prompts 2 --shared-prefix 16 --prompt-len 8:60 --seed 1 \
  --max-tokens 2 --layers 0,1 --budget-mb 10
run llama3.1-8b-fp8 --model llama-3.1-8b --prompts 2 --shared-prefix 32 --prompt-len 8:24 --max-tokens 4 \
  --kv-cache-dtype fp8 --budget-mb 4
run qwen2.5-7b-bs32-chunked --model qwen2.5-7b-instruct --prompts 2 --shared-prefix 32 --prompt-len 8:40 \
  --block-size 32 --max-num-batched-tokens 32 --max-tokens 2 --budget-mb 4
run qwen2.5-7b-fa2 "${small[@]}" --prompts 2 --max-tokens 4 --budget-mb 4 --flash-attn-version 2
# Replay on this host (CPU torch; the same code the CPU machine runs).
traces=$(ls -d "$OUT"/work/*/ 2>/dev/null | sed 's:/$::')
[ -n "$traces" ] && python3 scripts/replay_checks.py -o "$OUT/replay-device.json" $traces 2>&1 | tee -a "$LOG"
du -sh "$OUT"/work/*/ | tee -a "$LOG"
# Results come back as at most 8 files, 2 folders deep: the tars above, the log, the two replays.
rm -rf "$OUT/work"
ls -la "$OUT"
