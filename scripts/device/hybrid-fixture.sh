#!/usr/bin/env bash
# The hybrid fixture tests/fixtures/h100-gemma2-hybrid: Gemma-2's shape (random weights,
# pagedtrace_random) in vLLM's default graph mode, two KV-cache groups (layer 0 in the 64-token
# sliding-window group, layer 1 in the full one) recorded in the manifest (format 5), tensors of
# both layers, prompts longer than the window. Its row is scripts/make_fixtures.py's; from the
# repository root on the device machine:
#   source .device/install.sh env && OUT=$OUT bash scripts/device/hybrid-fixture.sh
# Writes $OUT/h100-gemma2-hybrid.tar (unpack into tests/fixtures/), $OUT/replay.json (replayed on
# the device) and $OUT/make_fixtures.log. The fixture's name says the card it was made on: rename
# it (and its row) when another card makes it.
set -euo pipefail
: "${OUT:?OUT must name the output directory}"
python3 scripts/make_fixtures.py "$OUT" h100-gemma2-hybrid --timeout 420
