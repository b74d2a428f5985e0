#!/usr/bin/env bash
# Builds an fgfw wheel for the torch installed beside $PYTHON (default .venv/bin/python):
#   bash scripts/build_wheel.sh cpu  [OUT]   # C++ CPU kernels only
#   bash scripts/build_wheel.sh cuda [OUT]   # also the CUDA kernels, for the release architectures
#                                            # (CMakeLists.txt: FGFW_RELEASE_CUDA_ARCHS, PTX for the newest)
# OUT defaults to dist/. The wheel is named and pinned for that torch: version 0.1.0+torch2.14.1.cpu
# (or .cu130), requirement torch==2.14.1 (the extension loads only into the torch it was built with).
# No torch library goes into the wheel: it links against the installed torch's.
set -euo pipefail
cd "$(dirname "$0")/.."
variant=${1:-cpu}
out=${2:-dist}
PY=${PYTHON:-.venv/bin/python}
torch_version=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
case "$variant" in
  cpu)
    export FGFW_CUDA=OFF
    local_tag="torch${torch_version}.cpu" ;;
  cuda)
    cuda=$("$PY" -c "import torch; print((torch.version.cuda or '').replace('.', ''))")
    if [ -z "$cuda" ]; then echo "build_wheel.sh cuda: torch $torch_version is a CPU-only build" >&2; exit 2; fi
    export FGFW_CUDA=ON
    unset TORCH_CUDA_ARCH_LIST  # it would override the release list
    local_tag="torch${torch_version}.cu${cuda}" ;;
  *)
    echo "usage: bash scripts/build_wheel.sh cpu|cuda [OUT]" >&2; exit 2 ;;
esac
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
# --no-build-isolation: build against the installed torch (an isolated build would fetch another one)
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$raw" \
  -C build-dir="build/wheel-$variant" -C cmake.define.FGFW_CUDA_ARCHS=release .
wheel=$("$PY" scripts/retag_wheel.py "$raw"/fgfw-*.whl --local "$local_tag" --torch "$torch_version" --out "$out")
echo "$wheel ($(du -k "$wheel" | cut -f1) KiB)"
