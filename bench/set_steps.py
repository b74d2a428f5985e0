"""The fused steps of the sets other than L1 (L-infinity, L2, Lp, k-sparse) against the same step in torch ops.

For each set and scope, one FrankWolfe update (momentum 0.9, backprop gradients given, constant step) and one
AFGFW update (the part of ``step()`` after the forward passes: the direction regenerated from one Gaussian
tangent) on the 8 x 512 MLP of bench/step_overhead.py (2.1 M parameters), on the CPU:

* ``fused`` - backend 'cpu': the set's fused op (``linf_fw_step_``, ``lp_fw_step_``, ``ksparse_fw_step_``);
* ``torch`` - backend 'torch': ``reference.fw_step_`` with the set's dense (batched per row) vertex;
* ``copy``  - a copy of the bytes the update must move at least (the last column is its time over the fused
              update's): 20 B per float32 parameter for FrankWolfe
              (read theta, g, v; write theta, v), 16 for AFGFW (theta, v).

The L1 ball (fused in every backend) is the yardstick. Timed interleaved (one call of each case in turn),
medians, one thread:

    PYTHONPATH=python python bench/set_steps.py --out bench/results/set_steps.csv
"""
from __future__ import annotations

import argparse
import statistics
import sys
import warnings

import torch

import fgfw
from fgfw.experiments import write_csv
from kernel_bench import time_cpu  # bench/ is the script's folder: on sys.path
from step_overhead import ALPHA, GAMMA, RHO, _model, copy_step, forward_gradient_update

MODEL = "8x512 MLP"
BYTES_PER_PARAM = {"FrankWolfe": 20, "AFGFW": 16}


def sets(scope: str) -> dict[str, fgfw.Constraint]:
    return {"L1": fgfw.L1Ball.relative_to_init(2.0, scope=scope),
            "L-inf": fgfw.LInfBall.relative_to_init(10.0, scope=scope),
            "L2": fgfw.L2Ball.relative_to_init(2.0, scope=scope),
            "Lp, p=3": fgfw.LpBall.relative_to_init(2.0, p=3.0, scope=scope),
            "k-sparse, k=5": fgfw.KSparsePolytope.relative_to_init(2.0, k=5, scope=scope),
            "k-sparse, k=1%": fgfw.KSparsePolytope.relative_to_init(2.0, k=2_600 if scope == "tensor" else 5,
                                                                    scope=scope)}


def update(algorithm: str, constraint: fgfw.Constraint, backend: str, momentum: float | None = RHO):
    model = _model(MODEL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if algorithm == "FrankWolfe":
            return fgfw.FrankWolfe(model.parameters(), constraint=constraint, step_size=ALPHA, momentum=momentum,
                                   check_finite=False, backend=backend).step
        opt = fgfw.AFGFW(model, constraint=constraint, step_size=ALPHA, averaging_weight=GAMMA, seed=1,
                         check_finite=False, backend=backend)
    return forward_gradient_update(opt)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds of timing per case")
    parser.add_argument("--scopes", default="row,tensor")
    parser.add_argument("--algorithms", default="FrankWolfe,AFGFW")
    parser.add_argument("--only", action="append", default=[], metavar="PREFIX",
                        help="time only the sets whose name starts with PREFIX (repeatable), e.g. k-sparse")
    parser.add_argument("--no-momentum", action="store_true",
                        help="FrankWolfe without momentum (d = g; the copy still counts 20 B per parameter)")
    parser.add_argument("--out", default="bench/results/set_steps.csv")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    numel = sum(p.numel() for p in _model(MODEL).parameters())
    rows = []
    print(f"{MODEL}, {numel:,} parameters, {args.threads} thread(s); ms per update (median), fused / torch ops")
    print("| algorithm | scope | set | fused ms | torch ops ms | speed-up | copy ms / fused ms |")
    print("|---|---|---|---:|---:|---:|---:|")
    for algorithm in args.algorithms.split(","):
        for scope in args.scopes.split(","):
            for name, constraint in sets(scope).items():
                if args.only and not any(name.startswith(prefix) for prefix in args.only):
                    continue
                momentum = None if args.no_momentum else RHO
                cases = {"fused": update(algorithm, constraint, "cpu", momentum),
                         "copy": copy_step(numel, BYTES_PER_PARAM[algorithm])}
                if name != "L1":  # the L1 ball has no torch-op step in the optimizers
                    cases["torch"] = update(algorithm, constraint, "torch", momentum)
                times = {case: statistics.median(t) * 1e3 for case, t in time_cpu(cases, args.min_time, 2).items()}
                torch_ms = times.get("torch", float("nan"))
                row = dict(model=MODEL, algorithm=algorithm, scope=scope, set=name, fused_ms=times["fused"],
                           torch_ms=torch_ms, copy_ms=times["copy"], speedup=torch_ms / times["fused"],
                           fraction_of_copy=times["copy"] / times["fused"], threads=args.threads)
                rows.append(row)
                print(f"| {algorithm} | {scope} | {name} | {times['fused']:.2f} | {torch_ms:.2f} | "
                      f"{row['speedup']:.1f}x | {100 * row['fraction_of_copy']:.0f} % |", flush=True)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
