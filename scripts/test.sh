#!/usr/bin/env bash
# The test command: set up (venv, torch==2.14.1, build), run the whole test suite, then the CPU speed gate.
set -euo pipefail
cd "$(dirname "$0")/.."
# the CUDA kernels are compiled wherever nvcc is, GPU or not, so that a CUDA compile error fails the tests
export FGFW_CUDA=${FGFW_CUDA:-AUTO}
# Without a GPU the CUDA kernels are only compiled, for one architecture: sm_80 (scripts/test_stack.sh oldest compiles
# sm_90, so CI compiles both of the default list's, one each). A GPU machine builds the default list.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  export TORCH_CUDA_ARCH_LIST=8.0
fi
bash scripts/setup.sh
started=$(date +%s)
# setup.sh has just built fgfw._C: the session fails (tests/conftest.py) if it does not import, instead
# of skipping the kernel tests and running the optimizers on the reference backend.
export FGFW_REQUIRE_EXTENSION=1
# The CUDA kernels are compiled, GPU or not, when CMake finds nvcc (CUDACXX, $CUDA_PATH/bin or PATH, as
# its check_language(CUDA) looks) and torch is a CUDA build, unless FGFW_CUDA=OFF: then they must be
# registered. A value already set (e.g. 0) is kept.
if [ -z "${FGFW_REQUIRE_CUDA_KERNELS:-}" ]; then
  FGFW_REQUIRE_CUDA_KERNELS=0
  fgfw_cuda=${FGFW_CUDA:-AUTO}
  if [ "${fgfw_cuda^^}" != OFF ] \
      && { [ -n "${CUDACXX:-}" ] || [ -x "${CUDA_PATH:-/nonexistent}/bin/nvcc" ] || command -v nvcc >/dev/null; } \
      && .venv/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
    FGFW_REQUIRE_CUDA_KERNELS=1
  fi
fi
export FGFW_REQUIRE_CUDA_KERNELS
# A test skipped here and not selected by --gpu-only (scripts/gpu_check.sh tests) would run nowhere: fail on it
export FGFW_NO_SKIP_EVERYWHERE=${FGFW_NO_SKIP_EVERYWHERE:-1}
echo "test.sh: FGFW_REQUIRE_EXTENSION=$FGFW_REQUIRE_EXTENSION FGFW_REQUIRE_CUDA_KERNELS=$FGFW_REQUIRE_CUDA_KERNELS" \
  "FGFW_NO_SKIP_EVERYWHERE=$FGFW_NO_SKIP_EVERYWHERE"
# The sources live under python/, so `import fgfw` here is the installed package with its compiled _C.
# pytest-xdist, one worker per core (FGFW_TEST_WORKERS=0: one process): most tests are single-threaded Python, and
# one process left the second of CI's two cores idle. --dist worksteal: each worker starts on its share of the
# tests in collection order and an idle one takes from the others' remainders (whole files per worker left one
# worker alone on the last long file for minutes); a module fixture runs again only on a worker that steals into
# its file.
workers=${FGFW_TEST_WORKERS:-auto}
parallel=(-n "$workers" --dist worksteal)
[ "$workers" = 0 ] && parallel=(-p no:xdist)
status=0
.venv/bin/python -m pytest -q -ra "${parallel[@]}" tests "$@" || status=$?
echo "test.sh: tests ($(($(date +%s) - started)) s), exit $status"
# The CPU speed gate (issue 29): each fused set's step (L1, L-infinity, L2, k-sparse) on one 1e7 tensor, one thread,
# against a copy of its bytes timed beside it; one below its ratio to copy (bench/kernel_bench.py's CPU_GATE) fails
# the command, so that a kernel that halves does not land unseen. After the tests, on a quieter machine; ~15 s.
# The ratios are the CI VM's (bench/RESULTS.md, "The CPU speed gate"): FGFW_SPEED_GATE=0 skips the gate.
if [ "${FGFW_SPEED_GATE:-1}" != 0 ]; then
  gate_started=$(date +%s)
  gate_status=0
  .venv/bin/python bench/kernel_bench.py --quick || gate_status=$?
  echo "test.sh: CPU speed gate ($(($(date +%s) - gate_started)) s), exit $gate_status"
  [ "$status" != 0 ] || status=$gate_status
fi
exit $status
