"""The convex check as a plot: f(theta_k) - f* for FW, FGFW and AFGFW on a problem with a certified optimum.

f(theta) = 0.5 ||Q theta - y||^2 over the L1 ball of radius 1 (Q with orthonormal columns: theta* is the
projection of Q^T y onto the ball, in closed form; ``fgfw.testing.problems.least_squares_problem``). Every
method starts at theta_0 = 0 with the paper's schedules: FW on the exact gradient and FGFW with
alpha_k = 2/(k+2), AFGFW with alpha_k = 1/k, gamma_k = 1/sqrt(k). Theorem 1 predicts that FGFW stalls
at a floor set by the variance of its gradient estimate; Theorem 2 that AFGFW converges (O(1/sqrt(k))).

    PYTHONPATH=python python bench/convex.py --steps 5000 --seeds 0,1,2 --out bench/results/convex \
        --figure bench/figures/convex.png

Writes ``convex.csv`` (method, seed, step, suboptimality) and ``convex.png`` (mean over seeds, min-max
band, log-log axes) into ``--out``; ``--figure`` also saves a copy of the plot there.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import time

import torch

from fgfw.testing.convex import convex_suboptimality

LABELS = {"fw": "FW (exact gradient), alpha=2/(k+2)", "fgfw": "FGFW (Alg. 1), alpha=2/(k+2)",
          "afgfw": "AFGFW (Alg. 2), alpha=1/k, gamma=1/sqrt(k)"}


def plot(path: str, curves: dict[str, list[list[float]]], dim: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, runs in curves.items():
        steps = range(1, len(runs[0]) + 1)
        mean = [sum(v) / len(v) for v in zip(*runs)]
        runs_label = "deterministic" if method == "fw" else f"{len(runs)} seeds, band min-max"
        line, = ax.plot(steps, mean, label=f"{LABELS[method]} ({runs_label})", lw=1.2)
        if len(runs) > 1:
            ax.fill_between(steps, [min(v) for v in zip(*runs)], [max(v) for v in zip(*runs)],
                            color=line.get_color(), alpha=0.2, lw=0)
    ax.set(xscale="log", yscale="log", xlabel="step k", ylabel="f(theta_k) - f*",
           title=f"L1-constrained least squares, d={dim}, certified optimum")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument("--seeds", default="0,1,2", help="tangent seeds (comma-separated)")
    parser.add_argument("--methods", default="fw,fgfw,afgfw")
    parser.add_argument("--out", default="bench/results/convex")
    parser.add_argument("--figure", default=None, help="also copy the plot to this path (e.g. bench/figures/convex.png)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a 10-dimensional problem: threads only add overhead
    os.makedirs(args.out, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    curves = {}
    for method in args.methods.split(","):
        # FW on the exact gradient is deterministic: one run
        runs = seeds[:1] if method == "fw" else seeds
        start = time.perf_counter()
        curves[method] = [convex_suboptimality(method, seed, args.steps, args.dim) for seed in runs]
        last = [sum(c[-args.steps // 10:]) / (args.steps // 10) for c in curves[method]]
        print(f"{method:6s}: mean f - f* over the last 10% of steps {sum(last) / len(last):.4g} "
              f"(per seed {', '.join(f'{v:.3g}' for v in last)}), {time.perf_counter() - start:.0f}s", flush=True)
    with open(os.path.join(args.out, "convex.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "seed", "step", "suboptimality"])
        for method, runs in curves.items():
            for seed, curve in zip(seeds, runs):
                writer.writerows((method, seed, k, value) for k, value in enumerate(curve, 1))
    path = os.path.join(args.out, "convex.png")
    plot(path, curves, args.dim)
    if args.figure:
        os.makedirs(os.path.dirname(args.figure) or ".", exist_ok=True)
        shutil.copyfile(path, args.figure)
    print(f"wrote {path} and convex.csv")


if __name__ == "__main__":
    main()
