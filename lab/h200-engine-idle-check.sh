#!/usr/bin/env bash
# Where a metadata trace's held steps go over on the H200 when vLLM's engine core runs in a process
# of its own (``LLM`` with multiprocessing, as ``vllm serve`` runs it): one GPU, so vLLM's UniProc
# executor steps the model on the engine core's busy-loop thread, and the tracer hands the held
# steps over there when that loop runs out of work. Prints the finished manifest's ``extra["tracer"]``.
#   source .device/install.sh env; bash lab/h200-engine-idle-check.sh [OUT]
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
# the plugin (vLLM's general_plugins entry point) must be installed for the engine core process
pip install -q --no-deps --no-build-isolation --target /tmp/vllm-site . >"$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
export PYTHONPATH="/tmp/vllm-site:$PWD:${PYTHONPATH:-}" VLLM_ENABLE_V1_MULTIPROCESSING=1
rm -rf /tmp/engine-idle
t0=$(date +%s)
timeout "${T:-150}" python3 scripts/pagedtrace_run.py run -o /tmp/engine-idle --model qwen2.5-7b-instruct --multiprocess \
  --no-tensors --cudagraph-mode PIECEWISE --prompts 8 --prompt-len 64:128 --max-tokens 16 --max-model-len 2048 \
  >"$OUT/engine-idle.log" 2>&1
echo "run: exit $? in $(( $(date +%s) - t0 )) s"
grep -E "Traceback|Error|pagedtrace:" "$OUT/engine-idle.log" | head -5
python3 - /tmp/engine-idle <<'PY' | tee "$OUT/engine-idle.txt"
import json, sys
from tracer.format import Trace
t = Trace.open(sys.argv[1])
session = json.load(open(sys.argv[1] + "/session.json"))
print("traced pid", t.run.extra["pid"], "front end pid", session["frontend_pid"], "finished", t.run.extra["finished"])
print("tracer", json.dumps(t.run.extra.get("tracer")))
print("records", len(t.records), "request", len(t.steps(kind="request")), "gaps", [(g.kind, g.reason[:30]) for g in t.gaps][:6], "problems", t.problems[:3])
PY
