#!/usr/bin/env bash
# Set-up from a fresh clone: a venv in .venv with torch 2.14.1, the build and test tools, and fgfw built
# from source (C++ CPU kernels always; CUDA kernels when nvcc is present). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.14.1" numpy "scikit-build-core>=0.10" ninja "cmake>=3.26" \
  pytest hypothesis scikit-learn matplotlib tqdm
# --no-build-isolation: build against the torch just installed (an isolated build would install a second
# torch, 5.5 GB, and could compile against another version than the one that loads the extension)
.venv/bin/python -m pip install -q --no-build-isolation ${FGFW_EDITABLE:+-e} . 
