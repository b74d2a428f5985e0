"""Step overhead: what one optimizer update costs beyond the bytes it moves, and what param groups add.

For each model it times, interleaved (one call of each in turn, medians), on one thread:

* ``one group``       - ``FrankWolfe.step()`` (momentum 0.9, per-tensor L1 balls) with every parameter in
                        one param group, on fixed gradients;
* ``group per tensor`` - the same step with one param group per tensor (how per-layer radii or step
                        rules are set); since issue 12 both make one fused call;
* ``eager``           - the same update written as per-tensor torch ops (lerp, abs-argmax, index_add);
* ``copy``            - a copy of the bytes the step must move (20 B per float32 parameter: read theta,
                        g, v; write theta, v).

Models: the paper's 784-10-10-10-10-10 net (8,290 parameters, 10 tensors), an 8 x 512 MLP and a
12 x 1024 MLP (12.6 M parameters). Prints a Markdown table and writes a CSV:

    PYTHONPATH=python python bench/step_overhead.py --out bench/results/step_overhead.csv
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

import fgfw
from fgfw.experiments import write_csv
from fgfw.models import paper_mlp
from kernel_bench import time_cpu  # bench/ is the script's folder: on sys.path

RHO = 0.9


def mlp(width: int, layers: int) -> nn.Sequential:
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


MODELS = {"paper net": lambda: paper_mlp(), "8x512 MLP": lambda: mlp(512, 8), "12x1024 MLP": lambda: mlp(1024, 12)}


def _with_grads(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    return model


def frank_wolfe_step(per_tensor: bool, make):
    model = _with_grads(make())
    params = list(model.parameters())
    groups = [{"params": [p]} for p in params] if per_tensor else [{"params": params}]
    radius = 2.0 * max(float(p.detach().abs().sum()) for p in params)  # feasible start: no rescale
    opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=radius), step_size=1e-3, momentum=RHO,
                          check_finite=False)
    return opt.step


def eager_step(make):
    """The same update in per-tensor torch ops, as a user would write it."""
    model = _with_grads(make())
    params = list(model.parameters())
    moms = [torch.zeros_like(p) for p in params]
    radius = 2.0 * max(float(p.detach().abs().sum()) for p in params)
    alpha = 1e-3

    @torch.no_grad()
    def step():
        for p, v in zip(params, moms):
            v.lerp_(p.grad, 1 - RHO)
            flat_v, flat_p = v.view(-1), p.view(-1)
            i = torch.argmax(flat_v.abs())
            p.mul_(1 - alpha)
            flat_p.index_add_(0, i.view(1), (-alpha * radius * torch.sign(flat_v[i])).view(1))
    return step


def copy_step(make):
    numel = sum(p.numel() for p in make().parameters())
    src, dst = torch.empty(numel * 20 // 8, dtype=torch.float64), torch.empty(numel * 20 // 8, dtype=torch.float64)
    return lambda: dst.copy_(src)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds of timed steps per model")
    parser.add_argument("--out", type=Path, default=None, help="CSV path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        make = MODELS[name]
        steps = {"one group": frank_wolfe_step(False, make), "group per tensor": frank_wolfe_step(True, make),
                 "eager": eager_step(make), "copy": copy_step(make)}
        times = time_cpu(steps, args.min_time, warmup=3)
        numel = sum(p.numel() for p in make().parameters())
        tensors = len(list(make().parameters()))
        medians = {k: statistics.median(v) for k, v in times.items()}
        for case, seconds in medians.items():
            rows.append(dict(model=name, params=numel, tensors=tensors, case=case, threads=args.threads,
                             median_ms=seconds * 1e3, gbps=numel * 20 / seconds / 1e9,
                             frac_copy=medians["copy"] / seconds, vs_eager=medians["eager"] / seconds))
            print(f"{name:>12} {case:>17} {seconds * 1e3:9.4f} ms", file=sys.stderr, flush=True)
    print("| model | params | tensors | case | median (ms) | GB/s (20 B/param) | of copy | vs eager |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['params']:,} | {r['tensors']} | {r['case']} | {r['median_ms']:.4g} | "
              f"{r['gbps']:.2f} | {r['frac_copy']:.0%} | {r['vs_eager']:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
