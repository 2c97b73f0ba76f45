#!/usr/bin/env bash
# The README's `vllm serve` recipe, run as written on the H200 (after `source .device/install.sh env`):
#   bash lab/h200-serve-check.sh OUT
# Writes OUT/serve.log, OUT/serve-trace (the trace) and prints what replay says of it.
set -uo pipefail
OUT=${1:?usage: h200-serve-check.sh OUTDIR}
mkdir -p "$OUT"; cd "$OUT"
pip install -q --no-deps --no-build-isolation --target /tmp/vllm-site "$OLDPWD" >pip.log 2>&1 || cat pip.log
export PYTHONPATH="/tmp/vllm-site:$OLDPWD:${PYTHONPATH:-}"
python3 -c "from pagedtrace.commands.preset import write_preset; write_preset('tiny', 'tiny-model')" || exit 1  # pagedtrace preset tiny tiny-model (the host lacks libcst, which the full CLI imports)
PAGEDTRACE_DIR=serve-trace PAGEDTRACE_TENSORS=1 VLLM_CPU_KVCACHE_SPACE=1 \
  python3 -m vllm.entrypoints.openai.api_server --model tiny-model --load-format pagedtrace_random \
  --skip-tokenizer-init --block-size 32 --max-model-len 512 --enforce-eager \
  --host 127.0.0.1 --port 8000 >serve.log 2>&1 &
server=$!
for i in $(seq 1 180); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
echo "server up after ${i} s"
body='{"model": "tiny-model", "prompt": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], "max_tokens": 4, "temperature": 0}'
for n in 1 2; do
  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d "$body"; echo
done
kill -INT $server; wait $server; echo "server exit $?"
grep -E "Using FlashAttention|Traceback|Error" serve.log | head -5
python3 - <<'PY'
from tracer.format import Trace
from reference_impl.replay import replay_trace
t = Trace.open("serve-trace", strict=False)
req = [r for r in t.records if r.kind == "request"]
print("backend", t.run.attention_backend, "FA", t.run.flash_attn_version, "block", t.run.kv_cache.block_size,
      "request records", len(req), "seq_lens", [r.seq_lens for r in req][:8], "problems", t.problems[:2])
rep = replay_trace(t)
print("replay ok", rep.ok, "steps", len(rep.steps), "worst", max(s.max_abs for s in rep.steps), "vs",
      min(s.tol for s in rep.steps), "metadata", sum(m.ok for m in rep.metadata), "of", len(rep.metadata), "ok")
PY
tar -czf serve-trace.tgz serve-trace serve.log
