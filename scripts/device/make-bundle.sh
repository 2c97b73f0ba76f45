#!/usr/bin/env bash
# Build the files that carry vLLM 0.26.0 (CUDA build) to an offline H200 machine:
#   bash scripts/device/make-bundle.sh
# (a copy of the device kit's make-bundle.sh, with its pins and install script beside it, whose parts
# are 29 MiB: a transfer holds 64 MiB together with the working tree, which is 3 MiB while
# tests/fixtures (41 MiB) is moved out of the checkout, so two parts travel in one call.)
#
# That machine has Python 3.12 with torch 2.11.0+cu130 (the exact torch that
# vllm==0.26.0 pins) but no network and no vLLM.  One transfer to it holds at most
# 64 MiB including the working tree, so the bundle travels as 29 MiB parts:
#   .device/part-00 .. part-03  (a split tar of: the wheels the image lacks,
#   vLLM's Python code with its FA3 kernels, and vLLM's core CUDA op library)
# Left out: the FA2 kernels (Hopper runs FA3), the MoE kernels, the Rust frontend,
# C++ headers, and FlashInfer, so runs must set VLLM_USE_FLASHINFER_SAMPLER=0
# (`source .device/install.sh env` does that).
#
# Run from anywhere inside the project checkout.  About 3 minutes the first time
# (download + xz); later runs reuse $VLLM_DEVICE_CACHE.
#
# WITH_FA2=1 also carries the FlashAttention-2 kernels (the path vLLM takes on an RTX 4090
# or A100; on the H200 select it with attention_config={"flash_attn_version": 2}): +85 MiB,
# so about 3 more parts, and a few more minutes of xz the first time.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(git rev-parse --show-toplevel)
OUTD="$ROOT/.device"
CACHE=${VLLM_DEVICE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-device-bundle}
grep -qxF '/.device/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.device/' >> "$ROOT/.git/info/exclude"
mkdir -p "$CACHE/whl" "$OUTD"
quiet() { grep -v "^WARNING: Location" || true; }

ls "$CACHE"/vllm-0.26.0-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps -d "$CACHE" vllm==0.26.0 2>&1 | quiet
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$CACHE/whl" -r "$HERE/vllm-gpu-pins.txt" 2>&1 | quiet

if [ ! -f "$CACHE/vllm-py.tar.xz" ] || [ ! -f "$CACHE/C_stable.so.xz" ]; then
  rm -rf "$CACHE/x" && mkdir -p "$CACHE/x"
  (cd "$CACHE/x" && unzip -q "$CACHE"/vllm-0.26.0-*.whl)
  (cd "$CACHE/x" && tar --exclude='vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
      --exclude='vllm/_moe_C_stable_libtorch.abi3.so' --exclude='vllm/vllm-rs' \
      --exclude='vllm/_C_stable_libtorch.abi3.so' --exclude='*.hpp' --exclude='*.cuh' --exclude='*.h' \
      --exclude='vllm/third_party/deep_gemm/_C.cpython-31[0134]*' \
      -cf - vllm vllm-0.26.0.dist-info | xz -T0 -6 > "$CACHE/vllm-py.tar.xz")
  xz -T0 -9 -c "$CACHE/x/vllm/_C_stable_libtorch.abi3.so" > "$CACHE/C_stable.so.xz"
  rm -rf "$CACHE/x"
fi

# Payload: only the pinned wheels, then split into parts.
rm -rf "$CACHE/payload" "$OUTD"/part-* && mkdir -p "$CACHE/payload/whl"
while read -r pin; do
  [ -n "$pin" ] || continue
  name=${pin%%==*}; ver=${pin##*==}
  f=$(ls "$CACHE"/whl/"$name"-"$ver"-*.whl "$CACHE"/whl/"${name//-/_}"-"$ver"-*.whl 2>/dev/null | head -1 || true)
  [ -n "$f" ] || { echo "missing wheel for $pin" >&2; exit 1; }
  cp "$f" "$CACHE/payload/whl/"
done < "$HERE/vllm-gpu-pins.txt"
cp "$CACHE/vllm-py.tar.xz" "$CACHE/C_stable.so.xz" "$CACHE/payload/"
if [ "${WITH_FA2:-0}" = 1 ]; then
  if [ ! -f "$CACHE/fa2.so.xz" ]; then
    rm -rf "$CACHE/x2" && mkdir -p "$CACHE/x2"
    (cd "$CACHE/x2" && unzip -q "$CACHE"/vllm-0.26.0-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so')
    xz -T0 -3 -c "$CACHE/x2/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" > "$CACHE/fa2.so.xz"
    rm -rf "$CACHE/x2"
  fi
  cp "$CACHE/fa2.so.xz" "$CACHE/payload/"
fi
tar -C "$CACHE/payload" -cf - . | split -b 29M -d -a 2 - "$OUTD/part-"
cp "$HERE/install-on-device.sh" "$OUTD/install.sh"
n=$(ls "$OUTD"/part-* | wc -l)
ls -la "$OUTD"
echo
echo "Next, with tests/fixtures moved out of the checkout (mv tests/fixtures /tmp/; back afterwards),"
echo "transfers in a row, two parts each (the GPU machine keeps /tmp only while it stays up, ~30 s idle):"
for i in $(seq 0 2 $((n - 1))); do
  a=$(printf 'part-%02d' "$i"); b=$(printf 'part-%02d' $((i + 1)))
  if [ $((i + 1)) -lt "$n" ]; then
    echo "  carry [\".device/$a\", \".device/$b\", \".device/install.sh\"]   command: bash .device/install.sh $a $n && bash .device/install.sh $b $n"
  else
    echo "  carry [\".device/$a\", \".device/install.sh\"]   command: bash .device/install.sh $a $n"
  fi
done
echo "  the last of them may go on: ... && source .device/install.sh env; ... (carry .device/install.sh every time)"
