"""Language-model benchmark (issue 24): a character-level GPT trained from scratch on the Python standard
library's sources, with FrankWolfe on Scion's sets against AdamW and torch.optim.Muon.

Methods (each on the same token budget, batches drawn from the same seeded stream):

* ``adamw``: torch.optim.AdamW on every parameter (betas 0.9/0.95, no weight decay).
* ``muon``: torch.optim.Muon on the hidden matrices (``adjust_lr_fn="match_rms_adamw"``, so one learning
  rate fits both) and AdamW on the embeddings, the output layer and the norms, as Muon's docs ask.
* ``fw_scion``: fgfw.FrankWolfe with momentum 0.9 and a constant step size, Scion's constrained update:
  hidden matrices in ``SpectralNormBall.operator_norm(scale)``, embeddings and the output layer in
  ``LInfBall.relative_to_init(scale)`` (the sign vertex), norms unconstrained (``constraint=None``).
* ``fw_l1``: the same with row-wise L1 balls (``L1Ball.relative_to_init(scale, scope="row")``) on every
  matrix: the sparsity-promoting set.

Protocol, fixed before the run: each method's small grid below is run with seed 0 and judged by its final
validation loss; the chosen setting is then run with seeds 0, 1 and 2; the validation curve is taken every
``--eval-every`` steps (loss against steps and against seconds); the test split is read once per final run.
Writes a CSV of every curve point, a summary CSV and a figure; prints the summary table.

    python bench/lm.py                 # CPU size (about 20 minutes on 2 cores)
    python bench/lm.py --quick         # a smoke run (seconds)
    python bench/lm.py --device cuda --preset gpu
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fgfw  # noqa: E402
from char_gpt import CharData, CharGPT, evaluate, loss, stdlib_text  # noqa: E402
from fgfw.experiments import write_csv  # noqa: E402

HERE = Path(__file__).resolve().parent
PRESETS = {  # model width, layers, heads, context, batch, steps, characters of text
    "cpu": dict(width=128, layers=2, heads=4, context=64, batch=32, steps=1500, chars=3_000_000),
    "gpu": dict(width=384, layers=6, heads=6, context=256, batch=64, steps=3000, chars=20_000_000),
    "quick": dict(width=32, layers=1, heads=2, context=16, batch=8, steps=30, chars=200_000),
}
# Each method's grid, fixed before the run: (name, settings)
GRIDS = {
    "adamw": [{"lr": lr} for lr in (3e-4, 1e-3, 3e-3)],
    "muon": [{"lr": lr} for lr in (3e-3, 1e-2, 3e-2)],
    "fw_scion": [{"step_size": g, "scale": s} for g in (0.01, 0.03) for s in (2.0, 8.0)],
    "fw_l1": [{"step_size": g, "scale": s} for g in (0.01, 0.03) for s in (1.0, 4.0)],
}


def _hidden_matrices(model: CharGPT) -> list[nn.Parameter]:
    return [p for block in model.blocks for p in block.parameters() if p.dim() == 2]


def _others(model: CharGPT, chosen) -> list[nn.Parameter]:
    ids = {id(p) for p in chosen}
    return [p for p in model.parameters() if id(p) not in ids]


def make_optimizer(method: str, model: CharGPT, setting: dict):
    """The optimizer(s) of a method: a list, stepped together."""
    if method == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=setting["lr"], betas=(0.9, 0.95), weight_decay=0.0)]
    if method == "muon":
        hidden = _hidden_matrices(model)
        return [torch.optim.Muon(hidden, lr=setting["lr"], weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(_others(model, hidden), lr=setting["lr"], betas=(0.9, 0.95), weight_decay=0.0)]
    scale = setting["scale"]
    hidden = _hidden_matrices(model)
    outer = [model.embed.weight, model.position.weight, model.head.weight]
    norms = _others(model, hidden + outer)
    if method == "fw_scion":
        spectral = {k: setting[k] for k in ("quintic_dtype", "quintic_steps") if k in setting}
        groups = [{"params": hidden, "constraint": fgfw.SpectralNormBall.operator_norm(scale, **spectral)},
                  {"params": outer, "constraint": fgfw.LInfBall.relative_to_init(scale)}]
    elif method == "fw_l1":
        groups = [{"params": hidden + outer, "constraint": fgfw.L1Ball.relative_to_init(scale, scope="row")}]
    else:
        raise ValueError(f"unknown method {method!r}")
    groups.append({"params": norms, "constraint": None})
    return [fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=1.0), step_size=setting["step_size"],
                            momentum=0.9)]


def train(method: str, setting: dict, seed: int, data: CharData, size: dict, device: torch.device,
          eval_every: int, val, test=None) -> dict:
    """One run: the validation curve [(step, seconds, loss)], the final validation loss, the test loss (when
    ``test`` is given) and the training time per step."""
    torch.manual_seed(seed)
    model = CharGPT(data.vocab, size["width"], size["layers"], size["heads"], size["context"]).to(device)
    opts = make_optimizer(method, model, setting)
    batches = torch.Generator().manual_seed(1000 + seed)  # the same batches for every method of a seed
    val_x, val_y = (t.to(device) for t in val)
    curve = [(0, 0.0, evaluate(model, val_x, val_y))]
    seconds = 0.0
    for step in range(1, size["steps"] + 1):
        x, y = (t.to(device) for t in data.batch("train", size["batch"], size["context"], batches))
        begin = time.perf_counter()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss(model, x, y).backward()
        for opt in opts:
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - begin
        if step % eval_every == 0 or step == size["steps"]:
            curve.append((step, seconds, evaluate(model, val_x, val_y)))
    out = dict(curve=curve, val=curve[-1][2], seconds_per_step=seconds / size["steps"])
    if test is not None:
        out["test"] = evaluate(model, *(t.to(device) for t in test))
    return out


def steps_to_reach(curve, target: float) -> float:
    """The first evaluated step whose validation loss is <= target, or inf."""
    return next((step for step, _, value in curve if value <= target), float("inf"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="the 'quick' preset and one seed: a smoke run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", nargs="+", choices=sorted(GRIDS), default=list(GRIDS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lm.csv")
    parser.add_argument("--figure", type=Path, default=HERE / "figures" / "lm.png")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = PRESETS["quick" if args.quick else args.preset]
    seeds = args.seeds[:1] if args.quick else args.seeds
    eval_every = max(1, size["steps"] // 5) if args.quick else args.eval_every
    device = torch.device(args.device)
    data = CharData(stdlib_text(size["chars"]))
    val = data.windows("val", size["context"], 256)
    test = data.windows("test", size["context"], 256)
    print(f"# {len(data.parts['train']):,} training characters, vocabulary {data.vocab}; preset {size}; "
          f"device {device}; torch {torch.__version__}; {torch.get_num_threads()} threads", flush=True)

    points, summary = [], []
    for method in args.methods:
        # the grid, seed 0, judged on the validation split
        grid = []
        for setting in GRIDS[method]:
            run = train(method, setting, seeds[0], data, size, device, eval_every, val, test)
            grid.append((run["val"], setting, run))
            print(f"grid {method:>8} {setting}: val {run['val']:.4f}", flush=True)
        best_val, chosen, first = min(grid, key=lambda g: g[0])
        runs = {seeds[0]: first}
        for seed in seeds[1:]:
            runs[seed] = train(method, chosen, seed, data, size, device, eval_every, val, test)
        for seed, run in runs.items():
            points += [dict(method=method, setting=str(chosen), seed=seed, step=s, seconds=t, val_loss=v)
                       for s, t, v in run["curve"]]
        vals = [r["val"] for r in runs.values()]
        tests = [r["test"] for r in runs.values()]
        summary.append(dict(method=method, setting=str(chosen), seeds=len(runs), val_mean=statistics.mean(vals),
                            val_sd=statistics.stdev(vals) if len(vals) > 1 else 0.0, test_mean=statistics.mean(tests),
                            test_sd=statistics.stdev(tests) if len(tests) > 1 else 0.0,
                            ms_per_step=1e3 * statistics.mean(r["seconds_per_step"] for r in runs.values()),
                            curves=[r["curve"] for r in runs.values()]))
        print(f"chosen {method:>8} {chosen}: val {statistics.mean(vals):.4f}", flush=True)

    by_method = {s["method"]: s for s in summary}
    if "adamw" in by_method:  # steps to reach AdamW's final validation loss (each seed's curve against the mean final of AdamW's seeds)
        target = by_method["adamw"]["val_mean"]
        for s in summary:
            reached = [steps_to_reach(c, target) for c in s["curves"]]
            # per seed (a mean would be inf as soon as one seed misses: AdamW's own seeds straddle their mean)
            s["steps_to_adamw_final"] = "/".join(str(int(r)) if r != float("inf") else "-" for r in reached)
    rows = [{k: v for k, v in s.items() if k != "curves"} for s in summary]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(args.out, points)
    write_csv(args.out.with_name(args.out.stem + "_summary.csv"), rows)
    _plot(summary, args.figure, f"char-GPT on stdlib sources, {size['steps']} steps ({device})")
    print("\n| method | chosen setting | val loss (mean +- sd) | test loss | steps to AdamW's final val (per seed; - not reached) | ms/step |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        reach = r.get("steps_to_adamw_final", "")
        print(f"| {r['method']} | {r['setting']} | {r['val_mean']:.4f} +- {r['val_sd']:.4f} | {r['test_mean']:.4f} | "
              f"{reach} | {r['ms_per_step']:.1f} |")
    print(f"\nCSV: {args.out}\nPNG: {args.figure}")


def _plot(summary, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for m, s in enumerate(summary):
        for i, curve in enumerate(s["curves"]):  # every seed of a method in the method's colour
            steps, seconds, values = zip(*curve)
            axes[0].plot(steps, values, color=f"C{m}", alpha=0.8, label=s["method"] if i == 0 else None)
            axes[1].plot(seconds, values, color=f"C{m}", alpha=0.8)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("seconds (training only)")
    for ax in axes:
        ax.set_ylabel("validation loss (nats/char)")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
