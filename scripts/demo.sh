#!/usr/bin/env bash
# The demo: set up, then train the paper's MLP shape on scikit-learn's digits with FW, FGFW and AFGFW.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m fgfw demo "$@"
