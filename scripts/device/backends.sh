#!/usr/bin/env bash
# Every attention backend vLLM 0.26 runs on CUDA, on an H100 or H200, in under 9 minutes (from the repo root):
#   OUT=/some/dir bash scripts/device/backends.sh
# 1. makes the backend fixtures with tensors (scripts/make_fixtures.py): TRITON_ATTN in the default graph
#    mode and eager, FLEX_ATTENTION eager, FLASHINFER eager when `import flashinfer` works, FlashAttention with the HND
#    layout (qwen2.5-7b preset shape, random weights, 3 short prompts, layer 0), and replays them here;
# 2. plants scale x1.02 into each (benchmarks/sensitivity.py --mutations scale): it must be caught;
# 3. runs vLLM's own kernels on the HND FlashAttention trace: replay --kernel vllm:TRITON_ATTN and
#    vllm:FLASH_ATTN, then `pagedtrace backends` on every fixture;
# 4. greedy tokens untraced, traced, untraced per backend (scripts/device/tokens.py, tiny preset).
# PAGEDTRACE_BACKEND_FIXTURES (names of scripts/make_fixtures.py) picks the fixtures, PAGEDTRACE_TOKEN_CASES
# (comma-separated cases of scripts/device/tokens.py) the token cases.
# Writes into $OUT (5 files): backends.log (everything), fixtures.tar (the traces, for tests/fixtures/),
# replay.json (the replays on this host), backends-tables.txt, tokens.json. Phases past the time budget
# are skipped and said so in the log.
set -uo pipefail
OUT=${OUT:?set OUT to the output directory}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 1
exec > >(tee -a "$OUT/backends.log") 2>&1
START=$(date +%s)
BUDGET=${PAGEDTRACE_BACKENDS_BUDGET_S:-520}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
if [ -f .device/install.sh ]; then
  # shellcheck disable=SC1091
  source .device/install.sh env
else
  echo "no .device/install.sh: the python3 on PATH as it is"
fi
export PYTHONPATH="$REPO:${PYTHONPATH:-}" VLLM_ENABLE_V1_MULTIPROCESSING=0
W=$(mktemp -d /tmp/pt-backends-XXXX)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"

# shellcheck disable=SC2206
NAMES=(${PAGEDTRACE_BACKEND_FIXTURES:-h100-qwen2.5-7b-hnd-eager h100-qwen2.5-7b-flex-eager h100-qwen2.5-7b-triton-default h100-qwen2.5-7b-triton-eager})
if python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"; then
  NAMES+=(h100-qwen2.5-7b-flashinfer-eager)
else
  echo "FLASHINFER: flashinfer does not import here: no FlashInfer fixture"
fi

echo "== 1. fixtures ($(left) s left)"
timeout $(( $(left) - 100 )) python3 scripts/make_fixtures.py "$W/made" "${NAMES[@]}" --timeout 150
cp "$W/made/replay.json" "$OUT/replay.json" 2>/dev/null || echo "no replay.json"
mkdir -p "$W/fx"
for n in "${NAMES[@]}"; do [ -f "$W/made/$n.tar" ] && tar -C "$W/fx" -xf "$W/made/$n.tar"; done
(cd "$W/fx" && tar -cf "$OUT/fixtures.tar" .) && ls -la "$OUT/fixtures.tar"
TRACES=()
for n in "${NAMES[@]}"; do [ -f "$W/fx/$n/manifest.json" ] && TRACES+=("$W/fx/$n"); done
for t in "${TRACES[@]}"; do
  echo "-- show $(basename "$t")"; python3 -m pagedtrace show "$t" 2>&1 | grep -E "tensors|CUDA graphs|KV cache|backend" || true
  echo "-- replay $(basename "$t")"; python3 -m pagedtrace replay "$t" --no-save 2>&1 | tail -4
done

echo "== 2. planted scale x1.02 ($(left) s left)"
[ "$(left)" -gt 70 ] && timeout 60 python3 benchmarks/sensitivity.py "${TRACES[@]}" --mutations scale

echo "== 3. vLLM's kernels ($(left) s left)" | tee "$OUT/backends-tables.txt"
HND="$W/fx/h100-qwen2.5-7b-hnd-eager"
if [ -d "$HND" ] && [ "$(left)" -gt 50 ]; then
  for k in vllm:TRITON_ATTN vllm:FLASH_ATTN; do
    echo "-- replay hnd --kernel $k" | tee -a "$OUT/backends-tables.txt"
    timeout 40 python3 -m pagedtrace replay "$HND" --kernel "$k" 2>&1 | tail -3 | tee -a "$OUT/backends-tables.txt"
  done
fi
for t in "${TRACES[@]}"; do
  [ "$(left)" -gt 50 ] || { echo "skipped backends on $(basename "$t"): time"; continue; }
  echo "-- backends $(basename "$t")" | tee -a "$OUT/backends-tables.txt"
  timeout 45 python3 -m pagedtrace backends "$t" 2>&1 | grep -v "INFO\|WARNING" | tee -a "$OUT/backends-tables.txt"
done

echo "== 4. greedy tokens, traced vs untraced ($(left) s left)"
IFS=, read -r -a CASES <<< "${PAGEDTRACE_TOKEN_CASES:-TRITON_ATTN default,TRITON_ATTN eager,FLEX_ATTENTION eager,FLASH_ATTN HND eager}"
[ "$(left)" -gt 60 ] && python3 scripts/device/tokens.py "$OUT/tokens.json" --budget-s "$(left)" "${CASES[@]}"
echo "backends.sh: done in $(( $(date +%s) - START )) s; files: $(ls "$OUT" | tr '\n' ' ')"
rm -rf "$W"
