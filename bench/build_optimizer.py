"""Time of building an optimizer with row-scope balls on a Hugging Face GPT-2 (CPU): resolving one radius per row
(Constraint.resolve_radii) and making the start feasible (Constraint.make_feasible_).

Cases (each built for fgfw.FrankWolfe and fgfw.AFGFW):

* ``shrink_every_row``: row L1 balls ``relative_to_init(0.5)`` on the weights, so every row's start is outside its
  ball and is rescaled in; biases and norms unconstrained, row L1 balls ``relative_to_init(0.5)`` on the embeddings
  too (50,257 + 1,024 more rows);
* ``readme_groups``: the README's "Quick start on a real model" groups: row L1 balls ``relative_to_init(5.0)`` on
  the weights (feasible), biases and norms unconstrained, an L-infinity ball per tensor on the embeddings;
* ``centred``: the README's groups with ``"center": "init"`` (no feasibility pass; the radii and the centres).

Timed: thread CPU time (``time.thread_time()``) of the constructor alone, the best of --repeats, the parameters
restored to the model's initial values before each build (untimed). One thread (torch.set_num_threads(1)).

    python bench/build_optimizer.py                       # GPT-2 small: 12 x 768
    python bench/build_optimizer.py --layers 2 --embd 64  # a quick check
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

import fgfw


def groups(model, case: str) -> list[dict]:
    if case == "shrink_every_row":
        shrink = fgfw.L1Ball.relative_to_init(0.5, scope="row")
        return fgfw.param_groups(model, weights=shrink, biases=None, norms={"constraint": None, "step_size": 1e-3},
                                 embeddings=shrink)
    out = fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(5.0, scope="row"), biases=None,
                            norms={"constraint": None, "step_size": 1e-3},
                            embeddings=fgfw.LInfBall.relative_to_init(2.0))
    if case == "centred":
        out = [dict(g, center="init") for g in out]
    return out


def build(optimizer: str, model, case: str):
    if optimizer == "FrankWolfe":
        return fgfw.FrankWolfe(groups(model, case), constraint=fgfw.L1Ball(radius=1.0), step_size=0.004)
    return fgfw.AFGFW(model, params=groups(model, case), constraint=fgfw.L1Ball(radius=1.0), step_size=0.004,
                      averaging_weight=0.1, num_tangents=4, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="shrink_every_row,readme_groups,centred")
    parser.add_argument("--optimizers", default="FrankWolfe,AFGFW")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads))
    params = [p for p in model.parameters()]
    initial = [p.detach().clone() for p in params]
    rows = sum(p.shape[0] for p in params if p.dim() >= 2)
    print(f"GPT-2 {args.layers} x {args.embd}: {sum(p.numel() for p in params):,} parameters, {len(params)} tensors, "
          f"{rows:,} rows of 2-D tensors; torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("case,optimizer,best_s,all_s")
    for case in args.cases.split(","):
        for optimizer in args.optimizers.split(","):
            times = []
            for _ in range(args.repeats):
                with torch.no_grad():
                    for p, p0 in zip(params, initial):
                        p.copy_(p0)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    start = time.thread_time()
                    opt = build(optimizer, model, case)
                    times.append(time.thread_time() - start)
                del opt
            print(f"{case},{optimizer},{min(times):.3f},{' '.join(f'{t:.3f}' for t in times)}", flush=True)


if __name__ == "__main__":
    main()
