#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one command that fits a short lease of an H100/H200 (about
# 5 minutes with the build; the steps' time limits add up to under 10 minutes, a lease's longest command). The machine is expected to hold torch with CUDA, triton, nvcc, cmake,
# ninja, scikit-build-core, pytest (pytest-xdist if present), and compute-sanitizer; no network.
#
#   OUT=results/gpu bash scripts/gpu_check.sh        # OUT defaults to results/gpu
#
# Steps, each under its own `timeout` so that one hang cannot eat the lease:
#   1. a fresh build for sm_90 only (a new target and build folder every run: never the old build)
#   2. the GPU test files, compiled (CUDA kernels, tangent stream, Triton, compile, optimizers)
#   3. a few CUDA kernel tests under compute-sanitizer memcheck and racecheck
#   4. the reduced kernel benchmark: sizes 1e6, 1e7, 1e8; AFGFW, FGFW and backprop FW; fused, triton,
#      eager, compile (AFGFW at 1e8 only: each shape compiles anew), copy; the 200-tensor model; the 12 x 1024 MLP with row
#      balls; and AFGFW with 4 Gaussian tangents at 1e8.
# At most 8 files land in $OUT (no sub-folders): summary.txt (environment, each step's status and time,
# the benchmark tables), build.log, tests.log, sanitizer.log, kernel_gpu.csv, kernel_gpu.log,
# kernel_gpu.png. The longer benchmarks (training step, memory, activity) are scripts/gpu_bench_full.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
export PYTHONUNBUFFERED=1
status=0

# run NAME SECONDS CMD...: runs CMD under a timeout and records its exit status and time in the summary.
run() {
  local name=$1 limit=$2 begin rc
  shift 2
  begin=$(date +%s)
  timeout -k 10 "$limit" "$@"
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - begin)) s (limit ${limit} s)" | tee -a "$summary"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name())"
  nvcc --version | tail -1
  c++ --version | head -1
} 2>&1 | tee -a "$summary"

site=$(mktemp -d /tmp/fgfw-site.XXXXXX)
build=$(mktemp -d /tmp/fgfw-build.XXXXXX)
if ! run build 150 env TORCH_CUDA_ARCH_LIST=9.0 FGFW_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    python3 -m pip install -v --no-build-isolation --no-deps --upgrade --target "$site" -C build-dir="$build" . \
    >"$out/build.log" 2>&1; then
  tail -30 "$out/build.log"
  exit 1
fi
export PYTHONPATH=$site
python3 -c "import fgfw, torch; print('fgfw from', fgfw.__file__); \
assert torch._C._dispatch_has_kernel_for_dispatch_key('fgfw::l1_fw_step_', 'CUDA'), 'no CUDA kernels'" \
  2>&1 | tee -a "$summary" || exit 1

xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n 8)
run tests 220 python3 -m pytest -q -ra "${xdist[@]}" -p no:cacheprovider \
  tests/test_cuda_kernels.py tests/test_cuda_graphs.py tests/test_tangent_stream.py tests/test_triton.py \
  tests/test_triton_compile.py tests/test_kernel_resources.py tests/test_backends.py tests/test_compile.py \
  tests/test_optim.py tests/test_activity.py tests/test_cuda_sets.py tests/test_triton_sets.py tests/test_readme.py \
  >"$out/tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -25 | tee -a "$summary"

# A small subset: under the sanitizer every launch is slow. Sizes cross a chunk boundary, unaligned
# views take the scalar path, 600 tensors take several launches, row balls at the warp limit take both
# paths; racecheck looks at the shared-memory reductions of the step and the finalize.
sanitize_subset="sizes_match_reference and 4096 and dtype0 or unaligned_views and dtype0 or more_tensors \
or single_element or nan_direction or row_balls_at_the_warp_ball_limit"
: >"$out/sanitizer.log"
for tool in memcheck racecheck; do
  run "compute-sanitizer $tool" 55 compute-sanitizer --tool "$tool" --error-exitcode 99 \
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k "$sanitize_subset" \
    >>"$out/sanitizer.log" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$out/sanitizer.log" | tail -2 | tee -a "$summary"
done

bench=(python3 bench/kernel_bench.py --device cuda --min-time 0.25)
run "kernel benchmark" 120 "${bench[@]}" --sizes 1e6 1e7 1e8 --modes afgfw fgfw fw \
  --backends fused,triton,eager,compile,copy --compile-sizes 1e8 --compile-modes afgfw --mlp-rows \
  --out "$out/kernel_gpu.csv" --figure "$out/kernel_gpu.png" >"$out/kernel_gpu.log" 2>&1
run "kernel benchmark, 4 tangents" 40 "${bench[@]}" --sizes 1e8 --modes afgfw --tangents 4 \
  --backends fused,triton,copy --model-width 0 --append --out "$out/kernel_gpu.csv" \
  --figure /tmp/kernel_gpu_k4.png >>"$out/kernel_gpu.log" 2>&1
grep -E "^\|" "$out/kernel_gpu.log" | tee -a "$summary"
echo "gpu_check: exit $status" | tee -a "$summary"
exit $status
