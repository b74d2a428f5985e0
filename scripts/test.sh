#!/usr/bin/env bash
# The test command: set up (venv, torch==2.14.1, build) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The sources live under python/, so `import fgfw` here is the installed package with its compiled _C.
.venv/bin/python -m pytest -q -ra tests "$@"
