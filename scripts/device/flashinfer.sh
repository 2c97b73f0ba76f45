#!/usr/bin/env bash
# FlashInfer on the offline GPU machine, from the repository root (vLLM installed by .device/install.sh):
#   OUT=/some/dir bash scripts/device/flashinfer.sh
# Carries .device/flashinfer/*.whl (flashinfer-python 0.6.14, vLLM 0.26's pin, with apache-tvm-ffi,
# cuda-tile, nvidia-cudnn-frontend, nvidia-cutlass-dsl: `pip download --no-deps` for cp312), installs them
# under /tmp, says whether `import flashinfer` works and whether its JIT (nvcc) builds vLLM's kernels, then
# makes the h100-qwen2.5-7b-flashinfer-eager fixture, replays it, plants scale x1.02, and compares
# greedy tokens traced and untraced on the tiny preset (scripts/device/tokens.py). Writes $OUT/flashinfer.log
# and, when it ran, $OUT/flashinfer-fixture.tar and $OUT/tokens.json.
set -uo pipefail
OUT=${OUT:?set OUT to the output directory}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
exec > >(tee -a "$OUT/flashinfer.log") 2>&1
START=$(date +%s)
# shellcheck disable=SC1091
source .device/install.sh env
SITE=/tmp/flashinfer-site
python3 -m pip install -q --no-index --no-deps --target "$SITE" .device/flashinfer/*.whl || exit 1
export PYTHONPATH="$REPO:$PYTHONPATH:$SITE" VLLM_ENABLE_V1_MULTIPROCESSING=0
which nvcc ninja; nvcc --version | tail -1
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || { echo "FLASHINFER: import fails"; exit 1; }
W=$(mktemp -d /tmp/pt-fi-XXXX)
timeout 420 python3 scripts/make_fixtures.py "$W/made" h100-qwen2.5-7b-flashinfer-eager --timeout 400
echo "fixture: exit $? after $(( $(date +%s) - START )) s"
tail -n 30 "$W/made/make_fixtures.log" 2>/dev/null
cp "$W/made/replay.json" "$OUT/flashinfer-replay.json" 2>/dev/null
if [ -f "$W/made/h100-qwen2.5-7b-flashinfer-eager.tar" ]; then
  cp "$W/made/h100-qwen2.5-7b-flashinfer-eager.tar" "$OUT/flashinfer-fixture.tar"
  mkdir -p "$W/fx" && tar -C "$W/fx" -xf "$OUT/flashinfer-fixture.tar"
  T="$W/fx/h100-qwen2.5-7b-flashinfer-eager"
  python3 -m pagedtrace show "$T" 2>&1 | grep -E "tensors|backend|KV cache" || true
  python3 -m pagedtrace replay "$T" --no-save 2>&1 | tail -4
  timeout 100 python3 benchmarks/sensitivity.py "$T" --mutations scale
  timeout 100 python3 -m pagedtrace backends "$T" 2>&1 | grep -v "INFO\|WARNING"
fi
# Greedy tokens untraced, traced, untraced (eager: FlashInfer's graph capture autotunes for minutes).
python3 scripts/device/tokens.py "$OUT/tokens.json" --budget-s "${PAGEDTRACE_TOKENS_BUDGET_S:-240}" "FLASHINFER eager"
echo "flashinfer.sh: done in $(( $(date +%s) - START )) s"
rm -rf "$W"
