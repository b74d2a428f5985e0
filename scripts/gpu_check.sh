#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one command, for a machine that has one (H100/H200: torch with
# CUDA, nvcc, cmake, ninja, scikit-build-core, pytest, triton already installed; no network needed):
# build the extension from source for sm_90, run the CUDA and Triton tests compiled, then the kernel,
# training-step and memory benchmarks. Results go to ${OUT:-results/gpu}; copy the tables into
# bench/RESULTS.md with the card's name and these commands.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} python3 -m pip install -q --no-build-isolation --no-deps \
  --target /tmp/fgfw-site . 2>&1 | tail -5 || exit 1
export PYTHONPATH=/tmp/fgfw-site
status=0
python3 -m pytest -q -ra tests/test_cuda_kernels.py tests/test_tangent_stream.py tests/test_triton.py \
  tests/test_compile.py tests/test_backends.py tests/test_activity.py 2>&1 | tee "$out/gpu_tests.log" || status=1
python3 bench/kernel_bench.py --device cuda --backends fused,triton,eager,compile,copy \
  --out "$out/kernel_gpu.csv" --figure "$out/kernel_gpu.png" 2>&1 | tee "$out/kernel_gpu.log" || status=1
python3 bench/train_step.py --device cuda --out "$out/train_step" 2>&1 | tee "$out/train_step_gpu.log" || status=1
python3 bench/memory.py --device cuda --out "$out/memory_gpu.csv" 2>&1 | tee "$out/memory_gpu.log" || status=1
python3 bench/activity.py --device cuda --out "$out/activity_gpu.csv" 2>&1 | tee "$out/activity_gpu.log" || status=1
exit $status
