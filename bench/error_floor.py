"""The feasibility step's error floor: f(theta_k) - f* of long Frank-Wolfe runs, float32 against float64 and a plain
float32 Frank-Wolfe, on least-squares problems over each fused set with a certified optimum (issue 21).

f(x) = ||A x - b||^2 (A 100 x 50 Gaussian, float32; b = A x_far with x_far three radii outside the set), from
x_0 = 0, over the set of radius 1 (``fgfw.testing.problems.least_squares_over``: f* from an accelerated projected
gradient in float64, certified by the Frank-Wolfe gap of its point). Rows:

* ``FrankWolfe`` - fgfw's step (``--backend``, default cpu) on the exact (backprop) gradient, alpha = 2/(k+2) (k
                   counting steps from 1);
* ``plain``      - Frank-Wolfe in torch ops with the same gradient, schedule and vertex:
                   theta <- (1 - alpha) theta + alpha s, rounded once per operation, nothing keeping it in the set
                   (the yardstick of the floor);
* ``AFGFW``      - fgfw's AFGFW (one Gaussian tangent, alpha = 1/k, gamma = 1/sqrt(k), seed 0; the L1 ball only).

Each row: f - f* after 1,000 / 5,000 / 10,000 / 20,000 steps and the largest gauge(theta_k) / r - 1 over the run
(> 0: the iterate left the set). About 10 s per 20,000-step row on one core. Results: bench/RESULTS.md,
"Feasibility without an error floor".

    .venv/bin/python bench/error_floor.py --out bench/results/error_floor.csv
"""
from __future__ import annotations

import argparse
import time

import torch

import fgfw
from fgfw.experiments import write_csv
from fgfw.testing.problems import least_squares_over

MARKS = (1_000, 5_000, 10_000, 20_000)
SETS = {"L1": fgfw.L1Ball(radius=1.0), "L2": fgfw.L2Ball(radius=1.0), "L-inf": fgfw.LInfBall(radius=1.0),
        "k-sparse k=5": fgfw.KSparsePolytope(radius=1.0, k=5)}


class _Point(torch.nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(dim, dtype=dtype))


def run(method: str, name: str, dtype: torch.dtype, steps: int, backend: str) -> dict:
    constraint = SETS[name]
    problem = least_squares_over(constraint)
    a, b = problem.a.to(dtype), problem.b.to(dtype)
    point = _Point(a.shape[1], dtype)
    theta = point.theta
    loss = lambda: ((a @ theta - b) ** 2).sum()  # noqa: E731
    if method == "FrankWolfe":
        opt = fgfw.FrankWolfe([theta], constraint=constraint, backend=backend)
    elif method == "AFGFW":
        opt = fgfw.AFGFW(point, constraint=constraint, seed=0, backend=backend)
    row = {"method": method, "set": name, "dtype": str(dtype).replace("torch.", ""), "backend": backend}
    worst = 0.0
    for k in range(steps):
        if method == "AFGFW":
            opt.step(loss)
        else:
            theta.grad = None
            loss().backward()
            if method == "FrankWolfe":
                opt.step()
            else:
                with torch.no_grad():
                    alpha = torch.tensor(2.0 / (k + 3), dtype=dtype)  # alpha_k = 2/(k+2), k counting steps from 1
                    s = constraint.vertex(theta.grad.reshape(-1), 1.0, tuple(theta.shape)).to(dtype)
                    theta.copy_((1 - alpha) * theta + alpha * s)
        worst = max(worst, constraint.norm([theta]) - 1.0)
        if k + 1 in MARKS:
            row[f"f-f* @{k + 1}"] = problem.suboptimality(theta)
    row["max gauge/r - 1"] = worst
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=MARKS[-1])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    parser.add_argument("--methods", default="FrankWolfe,plain,AFGFW")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--out", default=None, help="CSV to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    marks = [m for m in MARKS if m <= args.steps]
    print("| method | set | dtype | " + " | ".join(f"f - f* @{m:,}" for m in marks) + " | max gauge/r - 1 |")
    print("|---|---|---|" + "---:|" * (len(marks) + 1))
    for name in args.sets.split(","):
        for method in args.methods.split(","):
            if method == "AFGFW" and name != "L1":
                continue
            for dtype in args.dtypes.split(","):
                start = time.perf_counter()
                row = run(method, name, getattr(torch, dtype), args.steps, args.backend)
                rows.append(row)
                print(f"| {method} | {name} | {dtype} | " + " | ".join(f"{row[f'f-f* @{m}']:.3g}" for m in marks)
                      + f" | {row['max gauge/r - 1']:+.2g} |  ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.out:
        write_csv(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
