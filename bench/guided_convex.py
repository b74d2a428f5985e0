"""Guided tangents (AFGFW ``guided=True``, issue 31 item 3) on the convex check's problem, at equal directional
derivatives: f(theta) - f* after the same number of JVPs for

* ``guided_k2``: AFGFW, K = 2, guided (one tangent along v, one random tangent orthogonal to it), S steps;
* ``plain_k2``: AFGFW, K = 2, the paper's estimate averaged over two tangents, S steps;
* ``plain_k1``: AFGFW, K = 1, 2 S steps;
* ``fw_exact`` (a reference, no JVPs): FrankWolfe on the exact gradient with AFGFW's alpha_k = 1/k, S steps: where
  an estimate equal to the gradient would end.

The problem is bench/convex.py's (``fgfw.testing.problems.least_squares_problem``: f = 0.5 ||Q theta - y||^2 over
the L1 ball of radius 1, float64, f* in closed form), at each ``--dims``, the paper's schedules (alpha_k = 1/k,
gamma_k = 1/sqrt(k)), tangent seeds ``--seeds``.

    PYTHONPATH=python python bench/guided_convex.py --dims 50,500 --steps 2000 --seeds 0,1,2

Writes ``guided_convex.csv`` (method, dim, seed, steps, jvps, final f - f*, mean over the last 10 % of the JVPs)
into ``--out`` and prints mean +- sample std over the seeds.

    PYTHONPATH=python python bench/guided_convex.py --dims 50,500 --steps 2000 --seeds 0 --alignment

instead prints, for the two K = 2 methods, the mean over the last 10 % of the steps of cos^2(v_{k-1}, grad f(theta_k))
(the running direction against the exact gradient), on which the guided estimate's variance depends:
d ||P grad f||^2 / (K-1) = d sin^2 ||grad f||^2, against (d+1) ||grad f||^2 / K for the plain one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import fgfw
from fgfw.experiments import write_csv
from fgfw.testing.convex import convex_suboptimality
from fgfw.testing.problems import least_squares_problem

# method -> (num_tangents, guided, steps per S)
METHODS = {"guided_k2": (2, True, 1), "plain_k2": (2, False, 1), "plain_k1": (1, False, 2), "fw_exact": (0, False, 1)}


def alignment(dim: int, seed: int, steps: int, guided: bool) -> float:
    """The mean of cos^2(v_{k-1}, grad f(theta_k)) over the last 10 % of ``steps`` steps of AFGFW, K = 2."""
    f, _, _ = least_squares_problem(dim, 1.0)
    theta = nn.Parameter(torch.zeros(dim, dtype=torch.float64))
    point = nn.ParameterList([theta])
    opt = fgfw.AFGFW(point, constraint=fgfw.L1Ball(1.0), seed=seed, num_tangents=2, guided=guided)
    cosines = []
    for k in range(steps):
        if k >= steps - steps // 10:
            with torch.enable_grad():
                grad, = torch.autograd.grad(f(theta), theta)
            v = opt.state[theta]["momentum"]
            cosines.append(float((v @ grad) ** 2 / (v @ v) / (grad @ grad)))
        opt.step(lambda: f(theta))
    return statistics.fmean(cosines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="50,500")
    parser.add_argument("--steps", type=int, default=2000, help="S: the K = 2 methods' steps (2 S JVPs each)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--methods", default="guided_k2,plain_k2,plain_k1")
    parser.add_argument("--suffix", default="", help="appended to the CSV's name (guided_convex<suffix>.csv)")
    parser.add_argument("--alignment", action="store_true", help="only cos^2(v, grad f) of the K = 2 methods")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.alignment:
        for dim in (int(d) for d in args.dims.split(",")):
            for method in ("guided_k2", "plain_k2"):
                values = [alignment(dim, int(seed), args.steps, METHODS[method][1]) for seed in args.seeds.split(",")]
                print(f"d={dim:<4d} {method:10s} mean cos^2(v, grad f) over the last 10 % of {args.steps} steps: "
                      f"{', '.join(f'{x:.3f}' for x in values)} (seeds {args.seeds})", flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for dim in (int(d) for d in args.dims.split(",")):
        for method in args.methods.split(","):
            k, guided, per = METHODS[method]
            begin = time.perf_counter()
            for seed in (int(s) for s in args.seeds.split(",")):
                steps = per * args.steps
                curve = (convex_suboptimality("fw", seed, steps, dim, step_size="1/k") if method == "fw_exact" else
                         convex_suboptimality("afgfw", seed, steps, dim, num_tangents=k, guided=guided))
                tail = curve[-steps // 10:]
                rows.append(dict(method=method, dim=dim, seed=seed, steps=steps, jvps=k * steps, final=curve[-1],
                                 last_10pct=sum(tail) / len(tail)))
            done = [r for r in rows if r["method"] == method and r["dim"] == dim]
            spread = {key: (statistics.fmean(r[key] for r in done), statistics.stdev(r[key] for r in done)
                            if len(done) > 1 else 0.0) for key in ("final", "last_10pct")}
            print(f"d={dim:<4d} {method:10s} {done[0]['jvps']} JVPs: final f - f* {spread['final'][0]:.4g} +- "
                  f"{spread['final'][1]:.2g}, last 10 % {spread['last_10pct'][0]:.4g} +- {spread['last_10pct'][1]:.2g}"
                  f" ({time.perf_counter() - begin:.0f} s)", flush=True)
    path = os.path.join(args.out, f"guided_convex{args.suffix}.csv")
    write_csv(path, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
