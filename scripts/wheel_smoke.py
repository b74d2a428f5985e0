"""Smoke test of an installed fgfw wheel, run by scripts/check_wheel.sh in a fresh venv from outside the
repository (so that nothing is imported from the checkout). Exits non-zero on the first failure.

Checks: fgfw imports from the venv with its compiled extension and registered ops; the version is the
wheel's; one step of FrankWolfe, FGFW and AFGFW with the compiled CPU kernels equals the same step with
the pure-torch reference backend (bit for bit where the paths allow: backprop gradients, Rademacher
tangents); the console script runs.
"""
from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import _ops


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"wheel smoke test FAILED: {what}")
    print(f"ok: {what}")


site = Path(sysconfig.get_paths()["purelib"]).resolve()
check(Path(fgfw.__file__).resolve().is_relative_to(site), f"fgfw imports from the venv ({fgfw.__file__})")
extension = _ops.extension_file()
check(extension is not None and Path(extension).resolve().is_relative_to(site),
      f"the compiled extension loads ({extension}; import error: {_ops.extension_import_error()})")
for op in ("fill_tangent_", "fill_tangent_at_step_", "l1_fw_step_", "linf_fw_step_", "lp_fw_step_",
           "ksparse_fw_step_", "all_finite"):
    check(torch._C._dispatch_has_kernel_for_dispatch_key(f"fgfw::{op}", "CPU"), f"fgfw::{op} has a CPU kernel")
installed = importlib.metadata.version("fgfw")
check(installed.split("+")[0] == fgfw.__version__, f"version {installed} is fgfw.__version__ {fgfw.__version__}")
check(_ops.resolve_backend(None, "cpu") == "cpu", "the default CPU backend is the compiled one")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))


def run(kind: str, backend: str) -> list[torch.Tensor]:
    m = model()
    ball = fgfw.L1Ball.relative_to_init(2.0)  # a feasible start: nothing is rescaled
    if kind == "FrankWolfe":
        opt = fgfw.FrankWolfe(m.parameters(), constraint=ball, momentum=0.9, backend=backend)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    else:
        opt = getattr(fgfw, kind)(m, constraint=ball, seed=5, tangent="rademacher", num_tangents=2, backend=backend)
        for _ in range(3):
            opt.step(lambda: F.cross_entropy(m(x), y))
    return [p.detach().clone() for p in m.parameters()]


for kind in ("FrankWolfe", "FGFW", "AFGFW"):
    fused, spec = run(kind, "cpu"), run(kind, "torch")
    check(all(torch.equal(a, b) for a, b in zip(fused, spec)), f"3 {kind} steps: compiled kernels == reference")

cli = shutil.which("fgfw", path=str(Path(sys.executable).parent))
check(cli is not None, "the fgfw console script is installed")
done = subprocess.run([cli, "--help"], capture_output=True, text=True)
check(done.returncode == 0 and "demo" in done.stdout, "fgfw --help runs")
print("wheel smoke test passed")
