"""Aten ops one optimizer step dispatches, on Hugging Face GPT-2 (issue 29: launches per step independent of the
number of tensors).

Counted with a TorchDispatchMode around one ``opt.step()`` after two warm-up steps (the plan is built by then),
on the CPU: the step takes the same Python path on every device, so the count stands for the GPU's launches as
far as that holds (today the finiteness check is one C++ op on the CPU and per-tensor torch ops on CUDA). Views
and metadata ops count too: each is a dispatcher round trip on the host.

  python bench/op_count.py                      # width 64, 2 and 12 layers
  python bench/op_count.py --max-ops 30         # exits 1 if an fgfw method dispatches more, or if its count
                                                # changes with the depth
  python bench/op_count.py --forward-gradient   # issue 30: a whole lean AFGFW step against an inference forward

Methods: bench/optimizer_step.py's, by the same names: ``adamw_fused`` and ``adamw_foreach`` (torch.optim.AdamW),
``fw_readme_groups`` (FrankWolfe with the README's groups: L1 row balls on the weights, unconstrained biases and
norms, an L-infinity ball on the embeddings), ``fw_l1`` (one L1 ball per tensor over every tensor) and
``afgfw_update`` (AFGFW with the README's groups: its step after the forward pass).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import optimizer_step  # noqa: E402  (the methods, defined once)

import fgfw  # noqa: E402


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def gpt2(layers: int, width: int):
    return optimizer_step.gpt2(dict(n_layer=layers, n_embd=width, n_head=2, vocab_size=256, n_positions=64),
                               torch.device("cpu"))


METHODS = ("adamw_fused", "adamw_foreach", "fw_readme_groups", "fw_l1", "afgfw_update")


def count(method: str, layers: int, width: int) -> collections.Counter:
    model = gpt2(layers, width)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
    case = optimizer_step.Case(method, model, torch.device("cpu"))
    for _ in range(2):
        case.step()
    counter = OpCounter()
    with counter:
        case.step()
    return counter.ops


def count_forward_gradient(layers: int, width: int, batch: int = 4, length: int = 64) -> tuple[int, int]:
    """(ops of an inference forward of the loss, ops of one lean AFGFW step: the forward-mode pass and the update)
    on GPT-2 in eval mode (no dropout), the README's groups, one tangent, after two warm-up steps."""
    model = gpt2(layers, width).eval()
    tokens = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(2))

    def closure():
        return model(tokens, labels=tokens).loss

    opt = fgfw.AFGFW(model, params=optimizer_step.readme_groups(model), constraint=fgfw.L1Ball(radius=1.0), seed=0,
                     engine="lean")
    for _ in range(2):
        opt.step(closure)
    inference, step = OpCounter(), OpCounter()
    with torch.no_grad(), inference:
        closure()
    with step:
        opt.step(closure)
    return sum(inference.ops.values()), sum(step.ops.values())


def forward_gradient_main(args) -> int:
    print("| layers | inference forward | lean AFGFW step | ratio |")
    print("|---:|---:|---:|---:|")
    failures = []
    for n in args.layers:
        inference, step = count_forward_gradient(n, args.width)
        print(f"| {n} | {inference} | {step} | {step / inference:.2f} |", flush=True)
        if args.max_ratio is not None and step > args.max_ratio * inference:
            failures.append(f"{n} layers: the lean step dispatches {step / inference:.2f}x the inference forward's "
                            f"ops (at most {args.max_ratio})")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--max-ops", type=int, default=None,
                        help="fail (exit 1) if an fgfw method dispatches more ops, or a different number at two depths")
    parser.add_argument("--top", type=int, default=0, help="print the most frequent ops of each fgfw row")
    parser.add_argument("--forward-gradient", action="store_true",
                        help="count a whole lean AFGFW step (forward-mode pass + update) against an inference forward "
                             "instead (issue 30), batch 4 x 64")
    parser.add_argument("--max-ratio", type=float, default=None,
                        help="with --forward-gradient: fail (exit 1) if the step dispatches more than this many times "
                             "the inference forward's ops")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.forward_gradient:
        return forward_gradient_main(args)
    print("| method | " + " | ".join(f"{n} layers" for n in args.layers) + " |")
    print("|---|" + "---:|" * len(args.layers))
    failures = []
    for method in args.methods:
        counts = [count(method, n, args.width) for n in args.layers]
        totals = [sum(c.values()) for c in counts]
        print(f"| {method} | " + " | ".join(str(t) for t in totals) + " |", flush=True)
        if method.startswith(("fw", "afgfw")):
            if args.top:
                print("    " + ", ".join(f"{op} {k}" for op, k in counts[-1].most_common(args.top)))
            if args.max_ops is not None and (max(totals) > args.max_ops or len(set(totals)) > 1):
                failures.append(f"{method}: {totals} ops at {args.layers} layers (at most {args.max_ops}, the same "
                                f"at every depth)")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
