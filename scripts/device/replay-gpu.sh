#!/usr/bin/env bash
# Replay on the GPU against the CPU and the engine's generate time (issue: replay at engine speed).
#   bash scripts/device/replay-gpu.sh            (on the device machine, from the repo root; writes under $OUT)
# Runs benchmarks/gpu_overhead.py's 192-step default-mode workload (qwen2.5-7b-instruct preset, 3 batches of 32
# prompts, 64 new tokens) with tensors for layer 0, keeping the trace under $BENCH (default
# /tmp/pagedtrace-bench, which a later call on the same machine reuses: no second engine); then, in one
# process, replays it on the GPU with 4 workers, on the CPU, and on the GPU with its default workers;
# prints each time, steps/s and its ratio to the generate time, and whether the GPU's and the CPU's
# verdicts agree step by step (attention verdict per step and per head, write path, legacy). Then
# `replay_trace` on the GPU in a fresh process per round, ROUNDS times (default 3), and, with
# BASELINE=DIR (the packages of another commit: `git archive COMMIT reference_impl tracer pagedtrace`),
# that commit's replay_trace in the rounds between, side by side. Then times `pagedtrace replay` as a
# user runs it (wall clock, the interpreter's start included) and prints benchmarks/replay_stages.py's
# stage times of one GPU process with its 40 costliest functions (TORCH_PROFILE=1: and torch's 40 costliest
# operators). QUICK=1: no 4-worker run, no CLI run, no stage times.
set -uo pipefail
OUT=${OUT:?set OUT to an output directory}
BENCH=${BENCH:-/tmp/pagedtrace-bench}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
# shellcheck disable=SC1091
source .device/install.sh env
SITE=${PYTHONPATH:-}  # the installed packages, without this tree
export PYTHONPATH="$REPO:$SITE"
mkdir -p "$BENCH"
start=$(date +%s)
if [ ! -f "$BENCH/gpu-overhead.json" ]; then
  python3 benchmarks/gpu_overhead.py --model qwen2.5-7b-instruct --modes default --cases tensors-l0 \
    --out "$BENCH" --json "$BENCH/gpu-overhead.json" > "$BENCH/gpu-overhead.txt" 2>&1
  echo "engine: exit $? after $(( $(date +%s) - start )) s"
fi
cp "$BENCH/gpu-overhead.json" "$BENCH/gpu-overhead.txt" "$OUT/" 2>/dev/null
TRACE="$BENCH/default-tensors-l0"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/replay-gpu.txt"
python3 - "$TRACE" "$BENCH" "$OUT" <<'PY' 2>&1 | tee -a "$OUT/replay-gpu.txt"
import json, os, sys, time
from pathlib import Path
import torch
from reference_impl.replay import replay_trace
from reference_impl.workers import worker_count
from tracer.format import Trace

trace_dir, bench, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
cases = json.loads((bench / "gpu-overhead.json").read_text())
cases = cases["cases"] if isinstance(cases, dict) and "cases" in cases else cases
case = next(c for c in (cases if isinstance(cases, list) else cases.values()) if c.get("case") == "tensors-l0")
generate_s = case["generate_s"]
print(f"engine generate (3 batches, tensors of layer 0): {generate_s:.3f} s")
reports = {}
# The parent must not initialise CUDA before GPU workers fork (each opens its own context), so the runs
# with workers go first and the one-process GPU run last.
runs = (("cuda", 4), ("cpu", None), ("cuda", None)) if not os.environ.get("QUICK") else (("cpu", None), ("cuda", None))
for device, workers in runs:
    start = time.perf_counter()
    report = replay_trace(Trace.open(trace_dir), device=device, workers=workers)
    if device == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    processes = worker_count(workers, len(report.steps), device)
    if workers is None:
        reports[device] = report
        (out / f"replay-{device}.json").write_text(json.dumps(report.to_json(), indent=1))
    n = len(report.steps)
    print(f"replay --device {device} ({processes} processes): {n} steps in {seconds:.2f} s = {n / seconds:.1f} steps/s; "
          f"replay / generate = {seconds / generate_s:.2f}x; verdict {'ok' if report.ok else 'MISMATCH'}", flush=True)
gpu, cpu = reports["cuda"], reports["cpu"]
differ = [
    (a.step, a.layer, a.ok, b.ok, [h.ok for h in a.heads] == [h.ok for h in b.heads], a.max_abs, b.max_abs, a.tol, b.tol)
    for a, b in zip(gpu.steps, cpu.steps, strict=True)
    if a.ok != b.ok or [h.ok for h in a.heads] != [h.ok for h in b.heads]
]
worst_tol = max((abs(a.tol - b.tol) / max(b.tol, 1e-300) for a, b in zip(gpu.steps, cpu.steps)), default=0.0)
worst_err = max((abs(a.max_abs - b.max_abs) / max(b.tol, 1e-300) for a, b in zip(gpu.steps, cpu.steps)), default=0.0)
print(f"verdicts agree on {len(gpu.steps) - len(differ)} of {len(gpu.steps)} steps (step and per-head); "
      f"largest |tol_gpu - tol_cpu| / tol_cpu {worst_tol:.2e}, |max_abs_gpu - max_abs_cpu| / tol_cpu {worst_err:.2e}")
for d in differ:
    print("  differs:", d)
print("write paths agree:", [(w.step, w.tokens, w.mismatches) for w in gpu.write_path] == [(w.step, w.tokens, w.mismatches) for w in cpu.write_path],
      "legacy agree:", [(c.step, c.ok) for c in gpu.legacy] == [(c.step, c.ok) for c in cpu.legacy], f"({len(gpu.legacy)} legacy checks)")
PY
# Fresh processes, round by round: this tree's replay_trace and (BASELINE) another commit's, alternating.
cat > /tmp/replay-round.py <<'PY'
import sys, time
import torch
from reference_impl.replay import replay_trace
from tracer.format import Trace
times = []
for _ in range(2):  # the first opens the CUDA context (as a user's replay does), the second finds it open
    start = time.perf_counter()
    report = replay_trace(Trace.open(sys.argv[1]), device="cuda")
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(f"{times[0]:.3f} s (context opened), {times[1]:.3f} s (open); {len(report.steps)} steps, verdict {'ok' if report.ok else 'MISMATCH'}")
PY
generate_s=$(python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c=c.get('cases',c) if isinstance(c,dict) else c; c=c if isinstance(c,list) else list(c.values()); print(next(x for x in c if x.get('case')=='tensors-l0')['generate_s'])" "$BENCH/gpu-overhead.json")
for round in $(seq "${ROUNDS:-3}"); do
  echo "round $round: this tree: $(PYTHONPATH="$REPO:$SITE" python3 /tmp/replay-round.py "$TRACE" 2>&1 | tail -1) (generate $generate_s s)" | tee -a "$OUT/replay-gpu.txt"
  if [ -n "${BASELINE:-}" ]; then
    echo "round $round: baseline: $(cd "$BASELINE" && PYTHONPATH="$BASELINE:$SITE" python3 /tmp/replay-round.py "$TRACE" 2>&1 | tail -1)" | tee -a "$OUT/replay-gpu.txt"
  fi
done
[ -n "${QUICK:-}" ] && { echo "replay-gpu: done after $(( $(date +%s) - start )) s (QUICK: no CLI, no stages)"; exit 0; }
for run in 1; do
  t0=$EPOCHREALTIME
  python3 -m pagedtrace replay "$TRACE" > "$OUT/cli-replay-$run.txt" 2>&1
  rc=$?
  wall=$(awk "BEGIN { printf \"%.2f\", $EPOCHREALTIME - $t0 }")
  echo "pagedtrace replay (wall, run $run): exit $rc in $wall s; last line: $(tail -1 "$OUT/cli-replay-$run.txt")" | tee -a "$OUT/replay-gpu.txt"
done
python3 benchmarks/replay_stages.py "$TRACE" --device cuda --repeat 2 --profile 40 > "$OUT/replay-stages-gpu.txt" 2>&1
if [ -n "${TORCH_PROFILE:-}" ]; then
  python3 benchmarks/replay_stages.py "$TRACE" --device cuda --repeat 2 --torch-profile 40 >> "$OUT/replay-stages-gpu.txt" 2>&1
fi
head -12 "$OUT/replay-stages-gpu.txt"
echo "replay-gpu: done after $(( $(date +%s) - start )) s; outputs under $OUT"
