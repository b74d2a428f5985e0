"""Settings beyond bench/lm.py's fixed grids, run after it found a method's best at a grid edge (issue 24): the same
data, model, budget and seed 0 as the grid runs, scored on the validation split only (the test split stays unread); --seeds repeats a setting, --target prints
the first evaluated step at or below a validation loss.

    python bench/lm_extra_grid.py --threads 1 fw_scion '{"step_size": 0.003, "scale": 2.0}' muon '{"lr": 0.001}'
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from char_gpt import CharData, stdlib_text  # noqa: E402
from lm import PRESETS, steps_to_reach, train  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--target", type=float, default=None,
                        help="also print the first evaluated step whose validation loss is <= this")
    parser.add_argument("pairs", nargs="+", help="method, then its setting as JSON; repeated")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if len(args.pairs) % 2:
        parser.error("give a method and a JSON setting for each run")
    size = PRESETS[args.preset]
    data = CharData(stdlib_text(size["chars"]))
    val = data.windows("val", size["context"], 256)
    for method, setting in zip(args.pairs[::2], args.pairs[1::2]):
        for seed in args.seeds:
            run = train(method, json.loads(setting), seed, data, size, torch.device("cpu"), args.eval_every, val)
            reach = "" if args.target is None else \
                f", reaches {args.target} at step {steps_to_reach(run['curve'], args.target)}"
            print(f"extra {method:>8} {setting} seed {seed}: val {run['val']:.4f} "
                  f"({1e3 * run['seconds_per_step']:.1f} ms/step{reach})", flush=True)


if __name__ == "__main__":
    main()
