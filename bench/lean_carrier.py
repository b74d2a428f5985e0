"""The lean engine's one-tangent pass with the tangents carried beside the activations (fgfw.tangent_carrier, the
engine since issue 30) against the same pass with forward-AD duals (the engine before it, whose mode the batched
engine still uses), an inference forward and a backprop step with AdamW(foreach), interleaved in one process on
Hugging Face GPT-2 (eval mode, float32, one thread). Prints a Markdown table of medians.

  python bench/lean_carrier.py --layers 2 --width 64 --batch 4 --length 64 --repeats 15    # host-bound
  python bench/lean_carrier.py --layers 4 --width 256 --batch 16 --length 256 --repeats 5  # compute-bound
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.autograd.forward_ad as fwAD

from fgfw import lean


def lean_with_duals(params, make_tangent, closure):
    """The one-tangent pass as it was before the carrier: every tangent-carrying activation a forward-AD dual."""
    def dual_of(j):
        return torch._make_dual(params[j].detach(), make_tangent(j), level)

    with torch.no_grad(), fwAD.dual_level() as level:
        with lean._JustInTimeTangents(params, dual_of):
            loss = closure()
        primal, tangent = torch._unpack_dual(loss, level)
    return primal, tangent


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                     vocab_size=1000, n_positions=args.length, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    tokens = torch.randint(0, 1000, (args.batch, args.length))
    params = list(model.parameters())
    tangents = [torch.randn_like(p) for p in params]
    make_tangent = lambda j: tangents[j].clone()  # noqa: E731  (a fresh tangent per call, as the optimizers draw)
    closure = lambda: model(tokens, labels=tokens).loss  # noqa: E731
    adamw = torch.optim.AdamW(params, foreach=True)

    def backprop():
        adamw.zero_grad(set_to_none=True)
        closure().backward()
        adamw.step()

    methods = {
        "inference": lambda: torch.no_grad()(closure)(),
        "backprop_adamw": backprop,
        "lean_duals": lambda: lean_with_duals(params, make_tangent, closure),
        "lean_carrier": lambda: lean.lean_directional_derivative(model, params, make_tangent, closure),
    }
    c_duals = float(lean_with_duals(params, make_tangent, closure)[1])
    c_carrier = float(lean.lean_directional_derivative(model, params, make_tangent, closure)[1])
    times = {name: [] for name in methods}
    for fn in methods.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    backprop_ms = 1e3 * statistics.median(times["backprop_adamw"])
    print(f"GPT-2 {args.layers} x {args.width}, batch {args.batch} x {args.length}, one thread, medians of "
          f"{args.repeats}; c with duals {c_duals:.6g}, carried {c_carrier:.6g}")
    print("| method | ms | x backprop |")
    print("|---|---:|---:|")
    for name, values in times.items():
        ms = 1e3 * statistics.median(values)
        print(f"| {name} | {ms:.1f} | {ms / backprop_ms:.2f} |")


if __name__ == "__main__":
    main()
