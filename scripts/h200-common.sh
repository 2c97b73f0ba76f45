# Sourced by scripts/h200-fixtures.sh and scripts/h200-v3.sh (after `source .device/install.sh env`):
# the set-up and the traced run they share. The caller sets OUT and LOG, and may set ONLY (names to
# run) and RUN_TIMEOUT (seconds per run, default 240).
h200_prepare() {  # install pagedtrace's plugin entry point where vLLM finds it; one engine per process
  mkdir -p "$OUT/work"
  pip install -q --no-deps --no-build-isolation --target /tmp/vllm-site . >"$OUT/work/pip.log" 2>&1 || cat "$OUT/work/pip.log"
  export PYTHONPATH="/tmp/vllm-site:$PWD:${PYTHONPATH:-}"
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
}
h200_run() {  # name, pagedtrace run args...: trace into $OUT/work/NAME; false when skipped or no trace came
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 1; fi
  local t0 d="$OUT/work/$name" rc
  t0=$(date +%s)
  timeout "${RUN_TIMEOUT:-240}" python3 scripts/pagedtrace_run.py run -o "$d" --seed 0 --max-model-len 2048 "$@" >"$OUT/work/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s: $*" | tee -a "$LOG"
  grep -E "${H200_GREP:-Traceback|Error}" "$OUT/work/$name.log" | grep -v "^ " | head -8 >>"$LOG"
  [ $rc = 0 ] || tail -25 "$OUT/work/$name.log" >>"$LOG"
  [ -f "$d/manifest.json" ] || return 1
  cp "$OUT/work/$name.log" "$d/engine.log"
}
