"""Step overhead: what one optimizer update costs beyond the bytes it moves, what param groups add, and
what a whole forward-gradient training step costs beside a backprop step.

Two tables, each timed interleaved (one call of each case in turn, medians) on one thread.

Updates, for each model and each of FrankWolfe, FGFW and AFGFW (per-tensor L1 balls, constant schedules):

* ``one group``        - the optimizer's update with every parameter in one param group: ``step()`` on fixed
                         gradients (FrankWolfe, momentum 0.9), or the part of ``step()`` after the forward
                         passes for FGFW/AFGFW (the fused update from a given directional derivative);
* ``group per tensor`` - the same with one param group per tensor (how per-layer radii are set);
* ``eager``            - the same update written as per-tensor torch ops (lerp, randn, abs-argmax, index_add);
* ``copy``             - a copy of the bytes the update must move: 20 B per float32 parameter for FrankWolfe
                         (read theta, g, v; write theta, v), 16 for AFGFW (theta, v), 8 for FGFW (theta).

Training steps, batch 64, cross-entropy on random data: an AFGFW step (one tangent) with each forward-mode
engine (``lean``, ``forward_ad``), a FrankWolfe step with backprop (zero_grad, forward, backward, step)
and a plain forward under no_grad; ratios to the backprop step.

Models: the paper's 784-10-10-10-10-10 net (8,290 parameters, 10 tensors), an 8 x 512 MLP and a 12 x 1024
MLP (12.6 M parameters). Prints two Markdown tables and writes a CSV:

    PYTHONPATH=python python bench/step_overhead.py --out bench/results/step_overhead.csv
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw.experiments import write_csv
from fgfw.models import paper_mlp
from kernel_bench import time_cpu  # bench/ is the script's folder: on sys.path

RHO = 0.9
ALPHA = 1e-3
GAMMA = 0.1  # AFGFW's averaging weight, constant like the step size: the update's cost, not a schedule's
COEFF = 0.37  # the directional derivative the forward-gradient updates are given
BYTES_PER_PARAM = {"FrankWolfe": 20, "FGFW": 8, "AFGFW": 16}
BATCH = 64


def mlp(width: int, layers: int) -> nn.Sequential:
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


# name -> (model, its input width)
MODELS = {"paper net": (paper_mlp, 784), "8x512 MLP": (lambda: mlp(512, 8), 512),
          "12x1024 MLP": (lambda: mlp(1024, 12), 1024)}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    return model


def _radius(params) -> float:
    return 2.0 * max(float(p.detach().abs().sum()) for p in params)  # a feasible start: nothing is rescaled


def update_step(algorithm: str, name: str, per_tensor: bool):
    """The optimizer's update as a no-argument callable."""
    model = _model(name)
    params = list(model.parameters())
    groups = [{"params": [p]} for p in params] if per_tensor else [{"params": params}]
    ball = fgfw.L1Ball(radius=_radius(params))
    if algorithm == "FrankWolfe":
        return fgfw.FrankWolfe(groups, constraint=ball, step_size=ALPHA, momentum=RHO, check_finite=False).step
    schedules = dict(step_size=ALPHA) if algorithm == "FGFW" else dict(step_size=ALPHA, averaging_weight=GAMMA)
    opt = getattr(fgfw, algorithm)(model, groups, constraint=ball, seed=1, check_finite=False, **schedules)
    return forward_gradient_update(opt)


def forward_gradient_update(opt):
    """What ``opt.step()`` of FGFW/AFGFW does after its forward passes (``_update_from_coefficients``), as a
    no-argument callable: the fused update from the directional derivative COEFF, Gaussian tangents."""
    coeffs = torch.tensor([COEFF], dtype=torch.float64)
    return lambda: opt._update_from_coefficients(coeffs)


def eager_step(algorithm: str, name: str):
    """The same update in per-tensor torch ops, as a user would write it (tangents from torch.randn)."""
    model = _model(name)
    params = list(model.parameters())
    moms = [torch.zeros_like(p) for p in params]
    radius = _radius(params)
    gen = torch.Generator().manual_seed(1)

    @torch.no_grad()
    def step():
        for p, v in zip(params, moms):
            if algorithm == "FrankWolfe":
                v.lerp_(p.grad, 1 - RHO)
                d = v
            else:
                u = torch.randn(p.shape, generator=gen)
                if algorithm == "FGFW":
                    d = u.mul_(COEFF)
                else:
                    d = v.mul_(1 - GAMMA).add_(u, alpha=GAMMA * COEFF)
            flat_d, flat_p = d.view(-1), p.view(-1)
            i = torch.argmax(flat_d.abs())
            p.mul_(1 - ALPHA)
            flat_p.index_add_(0, i.view(1), (-ALPHA * radius * torch.sign(flat_d[i])).view(1))
    return step


def copy_step(numel: int, bytes_per_param: int):
    words = numel * bytes_per_param // 16  # each float64 word is read from src and written to dst
    src, dst = torch.empty(words, dtype=torch.float64), torch.empty(words, dtype=torch.float64)
    return lambda: dst.copy_(src)


def training_steps(name: str):
    """{case: one training step} on a batch of BATCH: AFGFW with each engine, backprop FW, a forward."""
    width = MODELS[name][1]
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(BATCH, width, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
    steps = {}
    for engine in fgfw.forward_grad.ENGINES:
        model = _model(name)
        opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=_radius(model.parameters())), engine=engine, seed=1)
        steps[f"AFGFW {engine}"] = (lambda m, o: lambda: o.step(lambda: F.cross_entropy(m(x), y)))(model, opt)
    model = _model(name)
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=_radius(model.parameters())),
                          momentum=RHO)

    def backprop():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    steps["FrankWolfe backprop"] = backprop
    forward_model = _model(name)

    @torch.no_grad()
    def forward():
        F.cross_entropy(forward_model(x), y)
    steps["forward (no_grad)"] = forward
    return steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--algorithms", nargs="+", choices=list(BYTES_PER_PARAM), default=list(BYTES_PER_PARAM))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds of timed calls per table and model")
    parser.add_argument("--out", type=Path, default=None, help="CSV path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        model = _model(name)
        numel, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
        for algorithm in args.algorithms:
            steps = {"one group": update_step(algorithm, name, False),
                     "group per tensor": update_step(algorithm, name, True),
                     "eager": eager_step(algorithm, name), "copy": copy_step(numel, BYTES_PER_PARAM[algorithm])}
            medians = {k: statistics.median(v) for k, v in time_cpu(steps, args.min_time, warmup=3).items()}
            for case, seconds in medians.items():
                rows.append(dict(table="update", model=name, params=numel, tensors=tensors, algorithm=algorithm,
                                 case=case, threads=args.threads, median_ms=seconds * 1e3,
                                 gbps=numel * BYTES_PER_PARAM[algorithm] / seconds / 1e9,
                                 frac_copy=medians["copy"] / seconds, vs_eager=medians["eager"] / seconds,
                                 vs_backprop=""))
                print(f"{name:>12} {algorithm:>10} {case:>17} {seconds * 1e3:9.4f} ms", file=sys.stderr, flush=True)
        steps = training_steps(name)
        medians = {k: statistics.median(v) for k, v in time_cpu(steps, args.min_time, warmup=3).items()}
        for case, seconds in medians.items():
            rows.append(dict(table="training step", model=name, params=numel, tensors=tensors,
                             algorithm=case.split()[0], case=case, threads=args.threads, median_ms=seconds * 1e3,
                             gbps="", frac_copy="", vs_eager="",
                             vs_backprop=seconds / medians["FrankWolfe backprop"]))
            print(f"{name:>12} {case:>28} {seconds * 1e3:9.4f} ms", file=sys.stderr, flush=True)
    print("| model | params | tensors | update | case | median (ms) | GB/s | of copy | vs eager |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        if r["table"] == "update":
            print(f"| {r['model']} | {r['params']:,} | {r['tensors']} | {r['algorithm']} | {r['case']} | "
                  f"{r['median_ms']:.4g} | {r['gbps']:.2f} | {r['frac_copy']:.0%} | {r['vs_eager']:.2f} |")
    print()
    print(f"| model | training step (batch {BATCH}) | median (ms) | / backprop step |")
    print("|---|---|---:|---:|")
    for r in rows:
        if r["table"] == "training step":
            print(f"| {r['model']} | {r['case']} | {r['median_ms']:.4g} | {r['vs_backprop']:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
