"""The cost of ``rescale=`` (a step per ball, stepped in torch ops by fgfw.reference.fw_step_) against the fused step.

AFGFW's update alone (``_update_from_coefficients``: the tangent, the momentum, the vertex, the step; no forward pass) on
an MLP 784-W-W-10 with one centred L2 ball per row (each bias vector one ball), with and without
``rescale="gradient"``; the best of ``--repeats`` after two warm-up steps, one thread, CPU.

    python bench/rescale_step.py --widths 256,1024
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import fgfw


def update_ms(width: int, rescale: str | None, repeats: int) -> tuple[float, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    ball = fgfw.L2Ball.relative_to_init(5.0, scope="row")
    opt = fgfw.AFGFW(model, [{"params": list(model.parameters()), "constraint": ball, "center": "init"}],
                     constraint=ball, step_size=1e-2, averaging_weight=0.01, rescale=rescale, seed=0)
    coeffs = torch.tensor([0.5], dtype=torch.float64)
    for _ in range(2):
        opt._update_from_coefficients(coeffs)
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        opt._update_from_coefficients(coeffs)
        best = min(best, time.perf_counter() - begin)
    balls = sum(len(r) if isinstance(r, (list, tuple)) else int(torch.as_tensor(r).numel())
                for r in opt.param_groups[0]["radii"])
    return 1e3 * best, balls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'width':>6} {'balls':>6} {'fused ms':>9} {'rescaled ms':>12} {'ratio':>6}")
    for width in (int(w) for w in args.widths.split(",")):
        fused, balls = update_ms(width, None, args.repeats)
        rescaled, _ = update_ms(width, "gradient", args.repeats)
        print(f"{width:>6} {balls:>6} {fused:>9.1f} {rescaled:>12.1f} {rescaled / fused:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
