"""Command line: ``python -m fgfw demo`` (and the ``fgfw`` console script)."""
from __future__ import annotations

import argparse
import csv
import json
import os
import warnings

import torch

from .experiments import RunConfig, train
from .models import paper_mlp

# The demo's settings: the paper's schedules do not train this network (see the reproduction issue), so
# the demo uses constant steps small enough to keep the dense initialisation alive for many steps.
DEMO_RUNS = {
    "fw": dict(radius="init:2", step_size=0.002, momentum=0.9),
    "fgfw": dict(radius="init:2", step_size=0.002),
    "afgfw": dict(radius="init:2", step_size=0.002, averaging_weight=0.02),
}


def _write_history(out_dir: str, name: str, rows: list[dict]) -> None:
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _plot_losses(path: str, histories: dict[str, list[dict]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in histories.items():
        epochs = [r["epoch"] for r in rows]
        ax_loss.plot(epochs, [r["train_loss"] for r in rows], label=name.upper())
        ax_acc.plot(epochs, [100 * r["test_accuracy"] for r in rows], label=name.upper())
    ax_loss.set(xlabel="epoch", ylabel="training loss (cross-entropy)", title=title)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title=title)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo(args: argparse.Namespace) -> None:
    from .data import digits_split

    os.makedirs(args.out, exist_ok=True)
    train_data, test_data = digits_split()
    histories, table = {}, []
    print(f"digits: {len(train_data[1])} train / {len(test_data[1])} test images (8x8); model 64-10-10-10-10-10 "
          f"(1,090 parameters); {args.epochs} epochs, batch {args.batch_size}, seed {args.seed}, backend "
          f"{args.backend or 'auto'}")
    for method, settings in DEMO_RUNS.items():
        cfg = RunConfig(method, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, backend=args.backend,
                        **settings)
        torch.manual_seed(args.seed)
        model = paper_mlp(in_features=64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            rows = train(cfg, model, train_data, test_data)
        histories[method] = rows
        _write_history(args.out, method, rows)
        last = rows[-1]
        table.append((method, last["test_accuracy"], last["train_loss"], last["zero_fraction"], last["wall_time_s"],
                      cfg.describe()))
    print(f"\n{'method':<7} {'test acc':>9} {'final loss':>11} {'zeros':>7} {'time':>7}  settings")
    for method, acc, loss, zeros, seconds, settings in table:
        shown = {k: v for k, v in settings.items() if k in ("radius", "step_size", "averaging_weight", "momentum")}
        print(f"{method.upper():<7} {100 * acc:>8.2f}% {loss:>11.4f} {100 * zeros:>6.1f}% {seconds:>6.1f}s  {shown}")
    plot = os.path.join(args.out, "loss_curves.png")
    _plot_losses(plot, histories, "digits, paper MLP shape")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump([dict(method=m, test_accuracy=a, final_loss=l, zero_fraction=z, wall_time_s=t, settings=s)
                   for m, a, l, z, t, s in table], f, indent=2)
    print(f"\nwrote {plot} and per-epoch CSVs to {args.out}/")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fgfw", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train the paper's MLP shape on scikit-learn's digits with FW, FGFW, AFGFW")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="cuda | triton | cpu | torch | auto (default: auto)")
    p.add_argument("--out", default="results/demo", help="folder for the CSVs, summary.json and loss_curves.png")
    p.set_defaults(run=demo)
    args = parser.parse_args(argv)
    args.run(args)
