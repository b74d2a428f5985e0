#!/usr/bin/env bash
# Builds the CPU wheel, installs it into a fresh venv (torch comes from pip, as for a user) and runs
# scripts/wheel_smoke.py there, from outside the checkout. Run by CI after the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=$(bash scripts/build_wheel.sh cpu "$work/dist" | cut -d' ' -f1)
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel"
cp scripts/wheel_smoke.py "$work/"
(cd "$work" && "$work/venv/bin/python" wheel_smoke.py)
echo "wheel: $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB"
