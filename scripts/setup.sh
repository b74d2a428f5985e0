#!/usr/bin/env bash
# Set-up from a fresh clone: a venv in .venv with torch 2.14.1, the build and test tools, and fgfw built
# from source (C++ CPU kernels always). Idempotent. Each phase announced when it starts, its time when it ends.
#
# The CUDA kernels are compiled when a GPU is visible (nvidia-smi lists one) or when FGFW_CUDA asks:
# FGFW_CUDA=ON forces them (an error without nvcc), OFF skips them, AUTO builds them wherever nvcc and a
# CUDA build of torch are (scripts/test.sh and CI use AUTO, so a CUDA compile error fails CI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Each phase is announced before it starts (with what it does and about how long it takes), then its time
phase_start=$(date +%s)
begin() {  # begin WHAT: announces the next phase
  echo "setup: $1..."
  phase_start=$(date +%s)
}
done_() {  # done_ WHAT: the phase's end and its time
  echo "setup: $1 ($(($(date +%s) - phase_start)) s)"
}

if [ ! -x .venv/bin/python ]; then
  begin "creating the venv .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
done_ "venv ready"
begin "installing torch 2.14.1, the build and the test tools (a minute or two in a fresh venv, seconds after)"
# torchvision 0.29.1 is the release built for torch 2.14.1 (another would pull a different torch)
.venv/bin/python -m pip install -q "torch==2.14.1" numpy "scikit-build-core>=0.10" ninja "cmake>=3.26" \
  pytest pytest-xdist hypothesis scikit-learn matplotlib tqdm "torchvision==0.29.1" transformers
done_ "torch and the build and test tools installed"
if [ -z "${FGFW_CUDA:-}" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    export FGFW_CUDA=AUTO
  else
    export FGFW_CUDA=OFF
    echo "setup: no GPU visible: the CUDA kernels are not built (FGFW_CUDA=ON or AUTO builds them)"
  fi
fi
if [ "${FGFW_CUDA^^}" = OFF ]; then
  begin "building fgfw: the C++ CPU kernels (about 2 minutes on 2 cores)"
else
  begin "building fgfw: the C++ CPU kernels, and the CUDA kernels wherever nvcc and a CUDA build of torch are \
(FGFW_CUDA=$FGFW_CUDA; about 4 minutes on 2 cores with them; FGFW_CUDA=OFF skips them)"
fi
# --no-build-isolation: build against the torch just installed (an isolated build would install a second
# torch, 5.5 GB, and could compile against another version than the one that loads the extension)
.venv/bin/python -m pip install -q --no-build-isolation ${FGFW_EDITABLE:+-e} .
done_ "fgfw built and installed (FGFW_CUDA=$FGFW_CUDA)"
