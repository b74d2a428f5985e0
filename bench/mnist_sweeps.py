"""How far the paper's network gets on the shared MNIST split: FW settings on a validation split, and
unconstrained Adam for the network's ceiling.

* ``fw``: FrankWolfe (``scope="row"``, linear step decay, momentum) over a grid of radius, step, momentum
  and batch size, with and without normalised inputs, 20 epochs, seeds 0 and 1. Tuning never sees the
  test part: the 8,000 training images are split again, every 5th one held out (6,400 / 1,600).
* ``adam``: Adam (lr 1e-3, 3e-3; raw and normalised inputs), 20 epochs, seeds 0-2, trained on the 8,000
  and scored on the 2,000 test images: the final accuracy and the best epoch's.
* ``adam-long``: AdamW for 60 epochs with weight decay 0 / 0.01 / 0.05 (raw inputs, seeds 0-1): does
  longer, regularised training get past the 20-epoch ceiling?

Prints one JSON line per setting; ``--out`` writes them as CSV.

    PYTHONPATH=python python bench/mnist_sweeps.py fw   [--data ../shared/data/mnist] [--out bench/mnist_sweep_fw.csv]
    PYTHONPATH=python python bench/mnist_sweeps.py adam [--data ...]
    PYTHONPATH=python python bench/mnist_sweeps.py adam-long [--data ...]
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fgfw.data import mnist_split
from fgfw.experiments import RunConfig, evaluate, train, write_csv
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


ADAM = [dict(lr=lr, weight_decay=0.0, normalised=n, seed=s, epochs=20)
        for lr, n, s in itertools.product((1e-3, 3e-3), (False, True), (0, 1, 2))]
ADAM_LONG = [dict(lr=lr, weight_decay=wd, normalised=False, seed=s, epochs=60)
             for lr, wd in ((3e-3, 0.0), (3e-3, 0.01), (3e-3, 0.05), (1e-3, 0.01)) for s in (0, 1)]


def adam_ceiling(data, settings):
    (x, y), (xt, yt) = mnist_split(data)
    rows = []
    for setting in settings:
        lr, normalised, seed = setting["lr"], setting["normalised"], setting["seed"]
        xs, xts = normalise(x, xt) if normalised else (x, xt)
        torch.manual_seed(seed)
        model = paper_mlp(784)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=setting["weight_decay"])
        order_gen = torch.Generator().manual_seed(seed)
        best = 0.0
        for _ in range(setting["epochs"]):
            order = torch.randperm(len(y), generator=order_gen)
            for i in range(0, len(y), 64):
                idx = order[i:i + 64]
                opt.zero_grad()
                F.cross_entropy(model(xs[idx]), y[idx]).backward()
                opt.step()
            accuracy = evaluate(model, xts, yt)[1]
            best = max(best, accuracy)
        row = dict(setting, test_accuracy=accuracy, best_epoch_accuracy=best,
                   train_accuracy=evaluate(model, xs, y)[1])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", choices=("fw", "adam", "adam-long"))
    parser.add_argument("--data", default=str(HERE.parent.parent / "shared" / "data" / "mnist"))
    parser.add_argument("--out", default=None, help="CSV file for the rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.sweep == "fw":
        rows = fw_sweep(args.data)
    else:
        rows = adam_ceiling(args.data, ADAM if args.sweep == "adam" else ADAM_LONG)
    if args.out:
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
