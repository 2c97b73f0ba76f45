#!/usr/bin/env bash
# The vLLM bundle for the H200 in parts small enough to travel with this working tree:
#   bash scripts/h200-bundle.sh
# ../shared/device/make-bundle.sh splits into 40 MiB parts; a transfer holds 64 MiB with the tree,
# and the tracked tree is ~40 MiB, so the parts here are 23 MiB (5 of them). Then, back to back,
# each call carrying [".device/part-0N", ".device/install.sh"]: bash .device/install.sh part-0N 5
# (N = 0..4); later calls carry [".device/install.sh"] and start with `source .device/install.sh env`.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
SHARED=$(cd "$ROOT/../shared/device" && pwd)
sed -e 's/split -b 40M/split -b 23M/' -e "s#^HERE=.*#HERE=$SHARED#" "$SHARED/make-bundle.sh" > "$ROOT/.device-bundle.sh.tmp"
trap 'rm -f "$ROOT/.device-bundle.sh.tmp"' EXIT
(cd "$ROOT" && bash "$ROOT/.device-bundle.sh.tmp")
