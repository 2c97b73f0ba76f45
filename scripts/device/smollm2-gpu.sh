#!/usr/bin/env bash
# The smollm2-135m preset on the GPU machine (no network, no PyPI), from the repository root:
#   bash scripts/device/smollm2-gpu.sh part          once per call that carries .device/smollm2/ files
#                                                    (scripts/device/smollm2-bundle.sh makes them); the
#                                                    call that completes the parts joins them, checks the
#                                                    sha256 and converts the GGUF into /tmp/smollm2-135m
#   bash scripts/device/smollm2-gpu.sh trace MODEL_DIR   trace MODEL_DIR (a converted model directory) in
#                                                    vLLM's default graph mode (FULL_AND_PIECEWISE) with
#                                                    tensors on the demo's four chats, then replay it
# vLLM comes from `source .device/install.sh env` (its parts sent first). Everything under /tmp lasts
# only while the machine stays up. Output of `trace`: $OUT/smollm2-trace.tar (the trace, one file: the
# device gives back at most 8), $OUT/run.log, $OUT/replay-checks.json, $OUT/summary.txt.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
if [ -f .device/install.sh ]; then
  # shellcheck disable=SC1091
  source .device/install.sh env  # sets its own S and P: ours come after it
fi
P=/tmp/smollm2-parts
SITE=/tmp/smollm2-site
MODEL=/tmp/smollm2-135m
PARTS=5
PY=${PYTHON:-python3}  # the device's python3 (torch, and vLLM from .device/install.sh)
export PYTHONPATH="$REPO:${PYTHONPATH:+$PYTHONPATH:}$SITE"
case "${1:-}" in
  part)
    set -e
    mkdir -p "$P"
    cp .device/smollm2/* "$P"/
    have=$(ls "$P" | grep -c '^part-' || true)
    echo "have $have of $PARTS parts"
    [ "$have" -ge "$PARTS" ] || exit 0
    cat "$P"/part-* > /tmp/smollm2.gguf
    echo "$(cat "$P/gguf.sha256")  /tmp/smollm2.gguf" | sha256sum -c -
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$P"/gguf-*.whl
    rm -rf "$MODEL.building" && mkdir -p "$MODEL.building"
    start=$(date +%s)
    "$PY" - "$MODEL.building" <<'PY'
import sys
from pathlib import Path

from tracer.gguf_model import convert_gguf
from tracer.models import read_model_config

convert_gguf(Path("/tmp/smollm2.gguf"), read_model_config("smollm2-135m"), Path(sys.argv[1]))
PY
    rm -rf "$MODEL" && mv "$MODEL.building" "$MODEL" && rm -f /tmp/smollm2.gguf
    echo "converted into $MODEL in $(( $(date +%s) - start )) s:"; ls -l "$MODEL" ;;
  trace)
    DIR=${2:?usage: smollm2-gpu.sh trace MODEL_DIR}
    : "${OUT:?set OUT to the output directory}"
    mkdir -p "$OUT"
    T=$(mktemp -d /tmp/smollm2-trace-XXXX)
    trap 'tar -C "$T" -cf "$OUT/smollm2-trace.tar" trace 2>/dev/null; rm -rf "$T"' EXIT
    "$PY" -c "import torch; print('device:', torch.cuda.get_device_name())" | tee "$OUT/summary.txt"
    start=$(date +%s)
    "$PY" scripts/pagedtrace_run.py run -o "$T/trace" --model "$DIR" \
      --prompts-file pagedtrace/presets/smollm2-demo.jsonl --max-tokens 32 \
      --cudagraph-mode FULL_AND_PIECEWISE >"$OUT/run.log" 2>&1
    rc=$?
    echo "run: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
    tail -n 40 "$OUT/run.log"
    [ "$rc" -eq 0 ] || exit "$rc"
    "$PY" - "$T/trace" <<'PY' | tee -a "$OUT/summary.txt"
import json
import sys
from pathlib import Path

from tracer.format import Trace

trace = Trace.open(sys.argv[1])
session = json.loads((Path(sys.argv[1]) / "session.json").read_text())
for text in session["output_texts"]:
    print("output:", repr(text))
graphs = {}
for r in trace.steps(kind="request"):
    graphs[r.cudagraph] = graphs.get(r.cudagraph, 0) + 1
print("request steps by CUDA graph:", graphs, "| with tensors:", sum(1 for r in trace.records if r.tensors))
print("backend:", trace.run.attention_backend, "FA", trace.run.flash_attn_version, "| mode:", trace.run.cudagraph_mode)
PY
    start=$(date +%s)
    "$PY" scripts/replay_checks.py -o "$OUT/replay-checks.json" "$T/trace" 2>&1 | tail -n 20 | tee -a "$OUT/summary.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then  # replay_checks.py records verdicts; the trace must replay ok
      "$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); sys.exit(0 if all(t.get('ok') for t in d['traces'].values()) else 1)" \
        "$OUT/replay-checks.json" || rc=1
    fi
    echo "replay: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
    exit "$rc" ;;
  *) echo "usage: bash scripts/device/smollm2-gpu.sh part | trace MODEL_DIR" >&2; exit 2 ;;
esac
