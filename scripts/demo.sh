#!/usr/bin/env bash
# The demo: set up (without the CUDA kernels unless a GPU is visible: scripts/setup.sh), then train the
# paper's MLP shape on scikit-learn's digits with FW, FGFW and AFGFW. One line per phase, with its time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
started=$(date +%s)
.venv/bin/python -m fgfw demo "$@"
echo "demo: trained and plotted ($(($(date +%s) - started)) s)"
