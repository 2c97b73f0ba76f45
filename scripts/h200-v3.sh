#!/usr/bin/env bash
# The format-3 tracer on the H200 (issue "Trace the engine users really run"), after
#   source .device/install.sh env; bash scripts/h200-v3.sh OUT
# Small traces, each replayed on that host, as OUT/<name>.tar (committable fixtures), then the
# write log attached to a running engine (scripts/h200_writelog_check.py) in PIECEWISE and fp8.
#   qwen2.5-7b-default-v3    vLLM's default FULL_AND_PIECEWISE, metadata, layers 0 and 27:
#                            decode steps replay full graphs and are recorded
#   gemma2-default-v3        gemma-2-9b preset (two KV-cache groups: window and full), default mode, metadata
#   qwen2.5-7b-writelog      PIECEWISE, tensors for layer 0 as a write log, whole blocks every 3rd step
#   llama3.1-8b-fp8-writelog PIECEWISE, fp8 KV cache, write log for layer 0, check every 2nd step
#   qwen2.5-7b-default-tensors  default FULL_AND_PIECEWISE, tensors for layers 0 and 27 inside the full
#                            graphs (tracer.staging), whole blocks every 3rd step
#   gemma2-default-tensors   gemma-2-9b (soft-cap, window and full layers), default mode, tensors of layers 0, 1
#   llama3.1-8b-fp8-default-tensors  fp8 KV cache, default mode, tensors of layer 0, check every 2nd step
set -uo pipefail
OUT=${1:?usage: h200-v3.sh OUTDIR}
ONLY=${ONLY:-}
LOG="$OUT/v3.log"
H200_GREP="pagedtrace:|Traceback|Error"
source scripts/h200-common.sh
h200_prepare
run() {  # name, args...
  local name=$1 d="$OUT/work/$1"
  h200_run "$@" || return
    python3 - "$d" >>"$LOG" 2>&1 <<'PY'
import collections, sys
from tracer.format import Trace
t = Trace.open(sys.argv[1])
req = t.steps(kind="request")
steps = sorted({r.step for r in req})
gaps = collections.Counter(g.reason.split(":")[0] for g in t.gaps if g.kind == "request")
modes = collections.Counter(r.cudagraph for r in req)
print(" mode", t.run.cudagraph_mode, "request steps recorded", len(steps), "request gaps", dict(gaps),
      "records by graph", dict(modes), "layers", t.layers)
for r in req[:3] + req[-2:]:
    print("  step", r.step, r.layer.split(".")[2], r.cudagraph, "padded", r.padded_tokens, "tokens",
          r.num_actual_tokens, "seq_lens", r.seq_lens[:6], "epoch", r.kv_log_epoch, "tensors", r.tensor_names[:3])
try:
    from tracer.format.kvlog import verify_write_log
    res = verify_write_log(t)
    print(" write log verify:", len(res), "check steps;", [str(x) for x in res][:4])
except Exception as exc:
    print(" write log verify error", repr(exc))
try:
    from reference_impl.replay import replay_trace
    rep = replay_trace(t)
    print(" replay ok", rep.ok, "steps", len(rep.steps), "worst", max((s.max_abs for s in rep.steps), default=None),
          "metadata ok", sum(m.ok for m in rep.metadata), "of", len(rep.metadata))
except Exception as exc:
    print(" replay error", repr(exc))
PY
    tar -C "$OUT/work" -cf "$OUT/$name.tar" "$name"
}
run qwen2.5-7b-default-v3 --model qwen2.5-7b-instruct --prompts 4 --shared-prefix 32 --prompt-len 8:40 \
  --max-tokens 16 --layers 0,27 --no-tensors --cudagraph-mode FULL_AND_PIECEWISE
run gemma2-default-v3 --model gemma-2-9b --prompts 3 --shared-prefix 16 --prompt-len 8:60 --max-tokens 8 \
  --layers 0,1 --no-tensors --cudagraph-mode FULL_AND_PIECEWISE
run qwen2.5-7b-writelog --model qwen2.5-7b-instruct --prompts 3 --shared-prefix 32 --prompt-len 8:24 \
  --max-tokens 8 --layers 0 --kv-check-every 3 --budget-mb 12 --cudagraph-mode PIECEWISE
run llama3.1-8b-fp8-writelog --model llama-3.1-8b --prompts 2 --shared-prefix 32 --prompt-len 8:24 \
  --max-tokens 6 --layers 0 --kv-cache-dtype fp8 --kv-check-every 2 --budget-mb 8 --cudagraph-mode PIECEWISE
run qwen2.5-7b-default-tensors --model qwen2.5-7b-instruct --prompts 4 --shared-prefix 32 --prompt-len 8:40 \
  --max-tokens 16 --layers 0,27 --kv-check-every 3 --budget-mb 24 --cudagraph-mode FULL_AND_PIECEWISE
run gemma2-default-tensors --model gemma-2-9b --prompts 3 --shared-prefix 16 --prompt-len 8:60 --max-tokens 8 \
  --layers 0,1 --kv-check-every 3 --budget-mb 24 --cudagraph-mode FULL_AND_PIECEWISE
run llama3.1-8b-fp8-default-tensors --model llama-3.1-8b --prompts 2 --shared-prefix 32 --prompt-len 8:24 \
  --max-tokens 8 --layers 0 --kv-cache-dtype fp8 --kv-check-every 2 --budget-mb 12 --cudagraph-mode FULL_AND_PIECEWISE
if [ -z "$ONLY" ] || [[ " $ONLY " == *" attach "* ]]; then
  timeout 240 python3 scripts/h200_writelog_check.py "$OUT/work/attach" >"$OUT/work/attach.log" 2>&1
  echo "== attach (PIECEWISE, write log after a prefix-cache fill): exit $?" | tee -a "$LOG"
  grep -v "^INFO\|^(EngineCore\|^WARNING" "$OUT/work/attach.log" | tail -5 >>"$LOG"
  cp "$OUT/work/attach/writelog-check.json" "$OUT/attach-check.json" 2>/dev/null
fi
if [ -z "$ONLY" ] || [[ " $ONLY " == *" attach-default "* ]]; then
  timeout 240 python3 scripts/h200_writelog_check.py "$OUT/work/attach-default" --mode FULL_AND_PIECEWISE --layers all >"$OUT/work/attach-default.log" 2>&1
  echo "== attach-default (tracer started on a running default-mode engine): exit $?" | tee -a "$LOG"
  grep -v "^INFO\|^(EngineCore\|^WARNING" "$OUT/work/attach-default.log" | tail -5 >>"$LOG"
  cp "$OUT/work/attach-default/writelog-check.json" "$OUT/attach-default-check.json" 2>/dev/null
fi
du -sh "$OUT"/work/*/ | tee -a "$LOG"
rm -rf "$OUT/work"
ls -la "$OUT"
