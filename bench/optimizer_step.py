"""Time of one whole optimizer step (issue 24): FrankWolfe on Scion's sets against torch.optim.AdamW and
torch.optim.Muon, on the same GPT (bench/char_gpt.py's CharGPT) with the same fixed gradients.

Each method's optimizers (bench/lm.py's make_optimizer) step the model's parameters with gradients drawn once;
the step alone is timed (no forward or backward): the median of --repeats timed steps after --warmup untimed
ones, all methods interleaved in one process so that the ratios share the machine's state. Rows:

* ``adamw``, ``muon`` (Muon on the hidden matrices + AdamW on the rest), ``fw_l1`` (row L1 balls, fused op);
* ``fw_scion``: spectral-norm balls on the hidden matrices (one batched Newton-Schulz per matrix shape on a GPU,
  one per matrix on the CPU, where that is faster: ``SpectralNormBall.BATCH_ON_CPU``), sign
  (L-infinity) balls on the embeddings and the output layer, norms unconstrained;
* ``fw_scion_unbatched``: the same with one Newton-Schulz per matrix (SpectralNormBall.batch_vertices off);
  ``fw_scion_batched``: batched by shape on the CPU too (``BATCH_ON_CPU``);
* ``fw_scion_bf16``: the quintic steps' products in bfloat16 (``quintic_dtype``, as Muon's), the cubic ones in
  float32; ``fw_scion_bf16_5``: the same with Muon's 5 quintic steps instead of 7.

    python bench/optimizer_step.py --threads 2                       # CPU, a 6 x 256 model
    python bench/optimizer_step.py --device cuda --preset gpt2       # a GPT-2 124M-like model (12 x 768)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fgfw  # noqa: E402
from char_gpt import CharGPT  # noqa: E402
from fgfw.experiments import write_csv  # noqa: E402
from lm import make_optimizer  # noqa: E402

HERE = Path(__file__).resolve().parent
PRESETS = {"cpu": dict(vocab=101, width=256, layers=6, heads=4, context=256),
           "gpt2": dict(vocab=50257, width=768, layers=12, heads=12, context=1024),
           "quick": dict(vocab=31, width=32, layers=2, heads=2, context=16)}
SETTINGS = {"adamw": {"lr": 1e-3}, "muon": {"lr": 1e-2}, "fw_l1": {"step_size": 0.01, "scale": 1.0},
            "fw_scion": {"step_size": 0.01, "scale": 2.0}, "fw_scion_unbatched": {"step_size": 0.01, "scale": 2.0},
            "fw_scion_batched": {"step_size": 0.01, "scale": 2.0},
            "fw_scion_bf16": {"step_size": 0.01, "scale": 2.0, "quintic_dtype": "bfloat16"},
            "fw_scion_bf16_5": {"step_size": 0.01, "scale": 2.0, "quintic_dtype": "bfloat16", "quintic_steps": 5}}


def build(method: str, size: dict, device: torch.device):
    torch.manual_seed(0)
    model = CharGPT(size["vocab"], size["width"], size["layers"], size["heads"], size["context"]).to(device)
    opts = make_optimizer("fw_scion" if method.startswith("fw_scion") else method, model, SETTINGS[method])
    gen = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():
        p.grad = 1e-3 * torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype)
    return model, opts


def timed_step(method: str, opts, device: torch.device) -> float:
    saved = fgfw.SpectralNormBall.batch_vertices, fgfw.SpectralNormBall.BATCH_ON_CPU
    if method == "fw_scion_unbatched":
        fgfw.SpectralNormBall.batch_vertices = None  # the optimizer then calls vertex() once per matrix
    if method == "fw_scion_batched":
        fgfw.SpectralNormBall.BATCH_ON_CPU = True
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        for opt in opts:
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - begin
    finally:
        fgfw.SpectralNormBall.batch_vertices, fgfw.SpectralNormBall.BATCH_ON_CPU = saved


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "optimizer_step.csv")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    size = PRESETS[args.preset]
    built = {m: build(m, size, device) for m in args.methods}
    n_params = sum(p.numel() for p in next(iter(built.values()))[0].parameters())
    print(f"# {args.preset}: {size}, {n_params:,} parameters; device {device}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads", flush=True)
    times = {m: [] for m in args.methods}
    for i in range(args.warmup + args.repeats):
        for m in args.methods:  # interleaved: every method sees the same machine state
            t = timed_step(m, built[m][1], device)
            if i >= args.warmup:
                times[m].append(t)
    base = statistics.median(times["adamw"]) if "adamw" in times else float("nan")
    rows = []
    print("\n| method | ms per optimizer step (median) | x AdamW |")
    print("|---|---:|---:|")
    for m in args.methods:
        ms = 1e3 * statistics.median(times[m])
        rows.append(dict(method=m, preset=args.preset, device=str(device), parameters=n_params, ms_per_step=ms,
                         x_adamw=ms / (1e3 * base), threads=torch.get_num_threads()))
        print(f"| {m} | {ms:.2f} | {ms / (1e3 * base):.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, rows)
    print(f"\nCSV: {args.out}")


if __name__ == "__main__":
    main()
