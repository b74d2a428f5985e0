"""Fine-tune a Hugging Face causal LM with AFGFW at inference memory: no backward pass, no stored activations.

    python examples/finetune_gpt2.py                                    # a small GPT-2, random weights, no download
    python examples/finetune_gpt2.py --model gpt2 --text corpus.txt     # GPT-2 small (downloaded, or from the cache)
    python examples/finetune_gpt2.py --model ./my-checkpoint --device cuda --dtype bfloat16

Each step runs the model forward once, carrying K random tangents u (fgfw's lean engine: a parameter's
tangent exists only while the layer that uses it runs), which gives the directional derivatives
c = <grad loss, u>; AFGFW averages c u into its momentum v and takes a Frank-Wolfe step towards the
vertex of an L1 ball per row (fgfw.AFGFW). The step's memory is an inference forward's plus v.

Before training, the script measures the memory one step takes above the weights, AFGFW's beside a
backprop step's (AdamW: forward + backward, its two moments included), on the same batch. Then it trains
with a progress bar and reports the validation loss before and after. Text: ``--text`` (a UTF-8 file),
else the sources of Python's ``json`` package (real text on every machine); tokens: the model's tokenizer
with ``--model``, else bytes. The last tenth of the text is the validation split.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import torch
import torch.nn.functional as F

import fgfw
from fgfw.experiments import LinearDecay
from fgfw.lean import measure_peak


def load_model(args):
    """(model, encode): the causal LM and a text -> token ids function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype))
        return model, lambda text: tokenizer(text)["input_ids"]
    # dropout 0: the K tangents of a step must see one function (fine-tuning recipes often turn it off too)
    config = GPT2Config(vocab_size=256, n_positions=args.length, n_embd=args.width, n_layer=args.layers, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).to(getattr(torch, args.dtype)), lambda text: list(text.encode())


def read_text(path: str | None) -> str:
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read()
    folder = os.path.dirname(json.__file__)
    return "".join(open(os.path.join(folder, name), encoding="utf-8").read()
                   for name in sorted(os.listdir(folder)) if name.endswith(".py"))


def batches(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    """Random windows of length + 1 tokens: inputs and next-token targets, forever."""
    while True:
        starts = torch.randint(0, len(tokens) - length - 1, (batch,), generator=generator)
        window = torch.stack([tokens[s:s + length + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def lm_loss(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@torch.no_grad()
def validation_loss(model, tokens: torch.Tensor, batch: int, length: int, device) -> float:
    """Mean loss over the validation split, cut into consecutive windows (at most 8 batches)."""
    windows = tokens[:(len(tokens) - 1) // length * length + 1]
    starts = list(range(0, len(windows) - length, length))[:8 * batch]
    total = 0.0
    for i in range(0, len(starts), batch):
        w = torch.stack([windows[s:s + length + 1] for s in starts[i:i + batch]]).to(device)
        total += float(lm_loss(model, w[:, :-1], w[:, 1:])) * len(w)
    return total / len(starts)


def step_memory(model, opt, x, y, device) -> tuple[float, float]:
    """MiB above the weights of AFGFW's first step and of a backprop AdamW first step (on a copy), same batch."""
    twin = copy.deepcopy(model)
    adamw = torch.optim.AdamW(twin.parameters(), lr=1e-5)

    def backprop():
        lm_loss(twin, x, y).backward()
        adamw.step()  # the first step makes AdamW's two moments
        adamw.zero_grad(set_to_none=True)

    _, backprop_bytes = measure_peak(backprop, device)
    del twin, adamw
    _, afgfw_bytes = measure_peak(lambda: opt.step(lambda: lm_loss(model, x, y)), device)
    return afgfw_bytes / 2**20, backprop_bytes / 2**20


def progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model name or folder (default: a small "
                                                       "random GPT-2 over bytes)")
    parser.add_argument("--text", default=None, help="UTF-8 text to fine-tune on (default: Python's json sources)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--num-tangents", type=int, default=1,
                        help="K tangents per step, carried in one pass (memory grows with K)")
    parser.add_argument("--step-size", type=float, default=0.002, help="alpha, decayed linearly to 2 %% of it")
    parser.add_argument("--averaging-weight", type=float, default=0.1, help="gamma, the new estimate's weight in v")
    parser.add_argument("--radius", type=float, default=2.0, help="each row's L1 ball: this x its initial L1 norm")
    parser.add_argument("--layers", type=int, default=4, help="the default model's layers")
    parser.add_argument("--width", type=int, default=256, help="the default model's width")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model, encode = load_model(args)
    model.to(device).train()
    tokens = torch.tensor(encode(read_text(args.text)), dtype=torch.long)
    split = len(tokens) * 9 // 10
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    stream = batches(train_tokens, args.batch, args.length, torch.Generator().manual_seed(args.seed))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {params / 1e6:.1f} M parameters ({args.dtype}, {device}); text: "
          f"{len(train_tokens):,} training and {len(val_tokens):,} validation tokens")

    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball.relative_to_init(args.radius, scope="row"),
                     step_size=LinearDecay(args.step_size, args.steps),
                     averaging_weight=args.averaging_weight, num_tangents=args.num_tangents,
                     tangents_in_one_pass=True, seed=args.seed)
    before = validation_loss(model, val_tokens, args.batch, args.length, device)
    x, y = (t.to(device) for t in next(stream))
    afgfw_mib, backprop_mib = step_memory(model, opt, x, y, device)  # also AFGFW's first training step
    print(f"one step's memory above the weights (tensors torch allocated; batch {args.batch} x {args.length}):\n"
          f"  AFGFW (K = {args.num_tangents}, one forward pass): {afgfw_mib:8.1f} MiB\n"
          f"  backprop + AdamW:                   {backprop_mib:8.1f} MiB  (AFGFW takes "
          f"{afgfw_mib / backprop_mib:.2f} x)")

    bar = progress(args.steps - 1)
    start = time.perf_counter()
    for k in range(2, args.steps + 1):
        x, y = (t.to(device) for t in next(stream))
        loss = float(opt.step(lambda: lm_loss(model, x, y)))
        if not math.isfinite(loss):
            raise SystemExit(f"step {k}: the loss is {loss}; try a smaller --step-size")
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update()
        elif k % max(1, args.steps // 10) == 0:
            print(f"  step {k}/{args.steps}: loss {loss:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    if bar is not None:
        bar.close()
    after = validation_loss(model, val_tokens, args.batch, args.length, device)
    print(f"validation loss: {before:.4f} before, {after:.4f} after {args.steps} steps "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
