"""How far the paper's network gets on the shared MNIST split: FW settings on a validation split, and
unconstrained Adam for the network's ceiling.

* ``fw``: FrankWolfe (``scope="row"``, linear step decay, momentum) over a grid of radius, step, momentum
  and batch size, with and without normalised inputs, 20 epochs, seeds 0 and 1. Tuning never sees the
  test part: the 8,000 training images are split again, every 5th one held out (6,400 / 1,600).
* ``adam``: Adam (lr 1e-3, 3e-3; raw and normalised inputs), 20 epochs, seeds 0-2, trained on the 8,000
  and scored on the 2,000 test images: the final accuracy and the best epoch's.

Prints one JSON line per setting; ``--out`` writes them as CSV.

    PYTHONPATH=python python bench/mnist_sweeps.py fw   [--data ../shared/data/mnist] [--out bench/mnist_sweep_fw.csv]
    PYTHONPATH=python python bench/mnist_sweeps.py adam [--data ...]
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fgfw.data import mnist_split
from fgfw.experiments import RunConfig, evaluate, train
from fgfw.models import paper_mlp

HERE = Path(__file__).resolve().parent
FW_GRID = {"radius": ("init:2", "init:2.5", "init:3", "init:4", "init:5", "init:10"),
           "step_size": ("linear:0.003", "linear:0.004", "linear:0.006"),
           "momentum": (0.9, 0.95), "batch_size": (64,)}
FW_EXTRA = [dict(radius=r, step_size=a, momentum=0.9, batch_size=32) for r in ("init:3", "init:5")
            for a in ("linear:0.004", "linear:0.008")]


def normalise(train_x, *others):
    mean, std = train_x.mean(), train_x.std()
    return [(x - mean) / std for x in (train_x, *others)]


def fw_sweep(data):
    (x, y), _ = mnist_split(data)
    held = torch.arange(len(y)) % 5 == 4
    rows = []
    settings = [dict(zip(FW_GRID, values)) for values in itertools.product(*FW_GRID.values())] + FW_EXTRA
    for normalised in (False, True):
        for setting in settings if not normalised else [s for s in settings if s["momentum"] == 0.9
                                                         and s["batch_size"] == 64 and s["radius"] in ("init:3", "init:5")]:
            xt, xv = (x[~held], x[held]) if not normalised else normalise(x[~held], x[held])
            accs = []
            for seed in (0, 1):
                torch.manual_seed(seed)
                history = train(RunConfig("fw", scope="row", seed=seed, **setting), paper_mlp(784),
                                (xt, y[~held]), (xv, y[held]))
                accs.append(history[-1]["test_accuracy"])
            row = dict(setting, normalised=normalised, val_accuracy_mean=sum(accs) / 2, seed0=accs[0], seed1=accs[1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def adam_ceiling(data):
    (x, y), (xt, yt) = mnist_split(data)
    rows = []
    for lr, normalised, seed in itertools.product((1e-3, 3e-3), (False, True), (0, 1, 2)):
        xs, xts = normalise(x, xt) if normalised else (x, xt)
        torch.manual_seed(seed)
        model = paper_mlp(784)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        order_gen = torch.Generator().manual_seed(seed)
        best = 0.0
        for _ in range(20):
            order = torch.randperm(len(y), generator=order_gen)
            for i in range(0, len(y), 64):
                idx = order[i:i + 64]
                opt.zero_grad()
                F.cross_entropy(model(xs[idx]), y[idx]).backward()
                opt.step()
            accuracy = evaluate(model, xts, yt)[1]
            best = max(best, accuracy)
        row = dict(lr=lr, normalised=normalised, seed=seed, test_accuracy=accuracy, best_epoch_accuracy=best)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", choices=("fw", "adam"))
    parser.add_argument("--data", default=str(HERE.parent.parent / "shared" / "data" / "mnist"))
    parser.add_argument("--out", default=None, help="CSV file for the rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = fw_sweep(args.data) if args.sweep == "fw" else adam_ceiling(args.data)
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
