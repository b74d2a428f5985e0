#!/usr/bin/env bash
# Builds the CPU wheel, installs it into a fresh venv and runs scripts/wheel_smoke.py there, from outside
# the checkout. Run by CI after the test suite.
#
# torch is not installed a second time: a CUDA build of torch takes 5.5 GB, and a second copy once filled
# a CI machine's disk. Instead pip first resolves the wheel's requirements as a user's pip would
# (--dry-run: nothing is downloaded or unpacked), then the fresh venv gets the test venv's installed
# distributions (torch and its dependencies, setuptools included; never fgfw or pip) as symlinks, the wheel is
# installed without dependencies, and `pip check` confirms that what the wheel requires is what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=$(bash scripts/build_wheel.sh cpu "$work/dist" | cut -d' ' -f1)
python3 -m venv "$work/venv"
venv_py="$work/venv/bin/python"
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
test_site=$("$PY" -c "$purelib")
fresh_site=$("$venv_py" -c "$purelib")
"$venv_py" -m pip install -q --no-cache-dir --dry-run "$wheel"
# The venv's bundled setuptools is older than torch requires: the test venv's replaces it.
"$venv_py" -m pip uninstall -q -y setuptools
linked=0
for entry in "$test_site"/*; do
  case "$(basename "$entry")" in
    fgfw | fgfw-* | fgfw.* | _editable_skbc_fgfw* | __editable__* | pip | pip-* | __pycache__) continue ;;
  esac
  ln -s "$entry" "$fresh_site/"
  linked=$((linked + 1))
done
"$venv_py" -m pip install -q --no-cache-dir --no-deps "$wheel"
"$venv_py" -m pip check
cp scripts/wheel_smoke.py "$work/"
(cd "$work" && "$venv_py" wheel_smoke.py)
echo "wheel: $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB (dependencies: $linked entries linked from $test_site)"
