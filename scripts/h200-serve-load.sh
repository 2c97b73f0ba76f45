#!/usr/bin/env bash
# `vllm serve` under load on the H200 (scripts/serve_load.py): the qwen2.5-7b-instruct preset in
# vLLM's default graph mode, traced through the plugin (no tensors), 64 concurrent completions,
# then the trace checked against the replies:
#   bash scripts/h200-serve-load.sh OUT [extra serve_load.py flags]
# Writes OUT/serve-load.json (the verdict, the summary, every reply), OUT/serve.log and
# OUT/serve-load.tgz (the trace and the log); exits as serve_load.py does (0 passed, 1 failed).
set -uo pipefail
OUT=${1:?usage: h200-serve-load.sh OUTDIR [serve_load.py flags]}; shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$REPO" || exit 1
if [ -f .device/install.sh ]; then
  # shellcheck disable=SC1091
  source .device/install.sh env
else
  echo "no .device/install.sh: using the python3 on PATH and PYTHONPATH as they are" >&2
fi
# The plugin is found through its entry point, so pagedtrace must be installed; --upgrade replaces
# an older copy, and the checkout comes first on PYTHONPATH so its code is what runs.
SITE=/tmp/pagedtrace-site
python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target "$SITE" "$REPO" >"$OUT/pip.log" 2>&1 \
  || { cat "$OUT/pip.log"; exit 2; }
export PYTHONPATH="$REPO:$SITE:${PYTHONPATH:-}"
WORK=/tmp/pagedtrace-serve-load
rm -rf "$WORK"
start=$(date +%s)
python3 scripts/serve_load.py --out "$WORK" --model qwen2.5-7b-instruct --requests 64 --max-tokens 32 "$@"
rc=$?
cp "$WORK/serve-load.json" "$WORK/serve.log" "$OUT/" 2>/dev/null
tar -czf "$OUT/serve-load.tgz" -C "$WORK" serve-trace serve.log 2>/dev/null
echo "h200-serve-load: exit $rc after $(( $(date +%s) - start )) s; wrote $OUT/serve-load.json, serve.log, serve-load.tgz"
exit $rc
