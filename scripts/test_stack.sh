#!/usr/bin/env bash
# CI's other stacks, beside scripts/test.sh's main one (torch 2.14.1, Triton 3.8):
#
#   bash scripts/test_stack.sh oldest   # torch 2.11.0 + Triton 3.6.0: what the GPU machines run
#   bash scripts/test_stack.sh newest   # torch 2.15.0 (Triton 3.9.0): the newest release on the package index
#
# Each stack gets its own venv under $FGFW_STACK_CACHE (default ~/.cache/fgfw-ci), kept between runs while its
# versions are unchanged (a stamp names them; torch's CUDA build downloads about 5 GB once), and its own build
# folder. In it:
#   oldest: the build (CUDA kernels too where nvcc matches torch's CUDA, as on the GPU machines); the torch.compile
#           tests on the CPU (dynamo differs between releases); every Triton kernel variant the optimizers launch,
#           compiled ahead of time for sm_90 with Triton 3.6 and checked for spills and at most 128 registers
#           (python -m fgfw.triton.aot; its kernels and ptxas reports cached in the stack's folder); the smoke
#           subset of the optimizer tests.
#   newest: the build (the CPU kernels only) and the smoke subset.
# One line per phase with its time; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
stack=${1:-}
case "$stack" in
  oldest) torch_version=2.11.0; triton_version=3.6.0 ;;
  newest) torch_version=2.15.0; triton_version=3.9.0 ;;
  *) echo "usage: bash scripts/test_stack.sh oldest|newest" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
cache=${FGFW_STACK_CACHE:-$HOME/.cache/fgfw-ci}
venv=$cache/venv-$stack
want="python $("$PY" -c 'import sys; print(sys.version.split()[0])') torch $torch_version triton $triton_version"
started=$(date +%s)
phase_start=$started
phase() {  # phase "what is done": its time since the last phase
  local now
  now=$(date +%s)
  echo "stack $stack: $1 ($((now - phase_start)) s)"
  phase_start=$now
}

if [ ! -f "$venv/stamp" ] || [ "$(cat "$venv/stamp")" != "$want" ]; then
  echo "stack $stack: installing $want into $venv (a CUDA build of torch: about 5 GB, 2 minutes, once)..."
  rm -rf "$venv"
  mkdir -p "$cache"
  "$PY" -m venv "$venv"
  # PIP_CONSTRAINT: a machine-wide pip constraint may cap torch at the main stack's version
  PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "torch==$torch_version" "triton==$triton_version" \
    numpy "scikit-build-core>=0.10" ninja "cmake>=3.26" pytest pytest-xdist hypothesis
  echo "$want" >"$venv/stamp"
  phase "installed"
else
  echo "stack $stack: reusing $venv ($want)"
fi
# the tests run under pytest-xdist as in scripts/test.sh (a venv installed before it was used gets it here)
"$venv/bin/python" -c "import xdist" 2>/dev/null || PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q pytest-xdist

# The CUDA kernels are compiled where nvcc's CUDA major is torch's (CMakeLists.txt refuses other pairs), as
# scripts/test.sh does for the main stack; FGFW_CUDA=OFF skips them.
# The newest stack builds the CPU kernels only: CI's time limit (40 minutes) has room for one CUDA compile beside the
# main stack's, and that one goes to the torch the GPU machines run.
cuda=OFF
torch_cuda=$("$venv/bin/python" -c 'import torch; print(torch.version.cuda or "")')
if [ "$stack" = oldest ] && [ "${FGFW_CUDA:-AUTO}" != OFF ] && command -v nvcc >/dev/null && [ -n "$torch_cuda" ] \
    && [ "$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')" = "${torch_cuda%%.*}" ]; then
  cuda=AUTO
fi
echo "stack $stack: building fgfw against torch $torch_version (FGFW_CUDA=$cuda; nvcc $(command -v nvcc >/dev/null && \
  nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p' || echo absent), torch's CUDA ${torch_cuda:-none})..."
# sm_90 only, the GPU machines' (the main stack compiles the default list): half the CUDA compile time
FGFW_CUDA=$cuda TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} "$venv/bin/python" -m pip install -q \
  --no-build-isolation --no-deps --force-reinstall --config-settings=build-dir="build/stack-$stack" .
phase "built"

export FGFW_REQUIRE_EXTENSION=1
export FGFW_REQUIRE_CUDA_KERNELS=$([ "$cuda" = AUTO ] && echo 1 || echo 0)
# The sources live under python/, so `import fgfw` is this venv's build (as in scripts/test.sh).
run_tests() {  # test files (under tests/), then pytest options
  local files=() arg
  while [ $# -gt 0 ] && [[ "$1" == *.py ]]; do files+=("tests/$1"); shift; done
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${FGFW_TEST_WORKERS:-auto}" --dist worksteal "${files[@]}" "$@"
}
# The smoke subset: the optimizers' steps on every backend the CPU runs (C++ kernels, reference, the Triton
# interpreter), their state, errors and grouping; about two minutes.
smoke=(test_extension_loaded.py test_optim.py test_backends.py test_hardening.py test_grouping.py test_row_scope.py
       test_unconstrained.py test_centred.py test_testing_problems.py)
# Triton 3.6's interpreter cannot run fgfw's kernels (it cannot loop over a kernel argument: "only 0-dimensional
# arrays can be converted to Python scalars"), so the oldest stack leaves the interpreter's tests out; its
# Triton kernels are compiled for sm_90 instead, below.
deselect=()
[ "$stack" = oldest ] && deselect=(-k "not triton")
if [ "$stack" = oldest ]; then
  run_tests test_compile.py "${deselect[@]}"
  phase "torch.compile tests on the CPU"
  triton_cache=$venv/triton-cache
  env -u TRITON_INTERPRET TRITON_CACHE_DIR="$triton_cache" "$venv/bin/python" -m fgfw.triton.aot --capability 90 \
    --max-registers 128 --jobs "${FGFW_AOT_JOBS:-2}" --report-cache "$venv/ptxas-reports.json"
  phase "Triton kernels compiled for sm_90"
fi
run_tests "${smoke[@]}" "${deselect[@]}"
phase "smoke tests"
echo "stack $stack: passed ($(($(date +%s) - started)) s)"
