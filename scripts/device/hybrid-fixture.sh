#!/usr/bin/env bash
# The hybrid H200 fixture: Gemma-2's shape (random weights, pagedtrace_random) in vLLM's default
# graph mode, two KV-cache groups (layer 0 in the 64-token sliding-window group, layer 1 in the
# full one) recorded in the manifest (format 5), tensors of both layers, prompts long enough
# (100-180 tokens) that the window group gives back blocks and its tables hold the null block.
# From the repository root on the device machine:
#   source .device/install.sh env && bash scripts/device/hybrid-fixture.sh
# Writes $OUT/h200-gemma2-hybrid.tar (unpack into tests/fixtures/), $OUT/replay.json (replayed on
# the H200) and $OUT/make_fixtures.log, through scripts/make_fixtures.py's maker. Once the fixture is
# committed, its row (below) goes into make_fixtures.FIXTURES, whose table lists the committed ones.
set -euo pipefail
: "${OUT:?OUT must name the output directory}"
python3 - "$OUT" <<'PY'
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("make_fixtures", "scripts/make_fixtures.py")
maker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(maker)
maker.FIXTURES["h200-gemma2-hybrid"] = maker.Fixture(
    "default graph mode, two KV-cache groups recorded (window 64 and full), tensors of layers 0 and 1,"
    " long prompts: the window group's tables hold the null block",
    f"{maker.GEMMA} --prompts 3 --shared-prefix 16 --prompt-len 100:180 --max-tokens 12 --layers 0,1"
    f" --query-rows 16 --kv-check-every 4 --budget-mb 40 {maker.DEFAULT_MODE}",
)
sys.exit(maker.main([sys.argv[1], "h200-gemma2-hybrid", "--timeout", "420"]))
PY
