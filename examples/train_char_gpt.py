"""Train a character-level GPT on the Python standard library's sources with FrankWolfe on Scion's sets:
hidden matrices in spectral-norm balls, embeddings and the output layer in L-infinity balls, norms
unconstrained (docs/transformers.md).

    python examples/train_char_gpt.py --steps 500
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fgfw  # noqa: E402
from char_gpt import CharData, CharGPT, evaluate, loss, stdlib_text  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--step-size", type=float, default=0.001)  # the best found on bench/lm.py's validation split
    parser.add_argument("--scale", type=float, default=8.0, help="radius scale of every set")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    data = CharData(stdlib_text(1_000_000))
    model = CharGPT(data.vocab)
    hidden = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
    outer = [model.embed.weight, model.position.weight, model.head.weight]
    norms = [p for p in model.parameters() if all(p is not q for q in hidden + outer)]
    opt = fgfw.FrankWolfe([{"params": hidden, "constraint": fgfw.SpectralNormBall.operator_norm(args.scale)},
                           {"params": outer, "constraint": fgfw.LInfBall.relative_to_init(args.scale)},
                           {"params": norms, "constraint": None}],
                          constraint=fgfw.L1Ball(radius=1.0), step_size=args.step_size, momentum=0.9)
    val = data.windows("val", 64, 128)
    batches = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = data.batch("train", 32, 64, batches)
        opt.zero_grad()
        loss(model, x, y).backward()
        opt.step()
        if step % 100 == 0 or step == args.steps:
            print(f"step {step:5d}  val loss {evaluate(model, *val):.3f} nats/char  gap {float(opt.last_gap):.3g}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
