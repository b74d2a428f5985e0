"""Data-parallel training: bytes communicated per step, and the step time of 1, 2 and 4 gloo processes.

Bytes (computed from the models, float32 parameters): DistributedDataParallel all-reduces every gradient,
4 bytes per parameter per step; fgfw's weight estimator all-reduces its K directional derivatives and the
rank's batch weight, 8 (K + 1) bytes whatever the model; the activity estimator all-reduces its dense
estimate like a gradient, 4 (d + 1) bytes. Models: those of bench/train_step.py.

Time (measured): a step of AFGFW (weight estimator, K tangents) and of FrankWolfe on a
DistributedDataParallel model (backprop), batch 64 per rank, on 1, 2 and 4 processes of this machine
(torchrun, gloo, one thread each), median over the timed steps on rank 0. On a 2-core machine 4
processes share 2 cores: the time shows the oversubscription, the point is the bytes.

    PYTHONPATH=python python bench/distributed.py --out bench/results/distributed.csv
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def bytes_table(tangents: list[int]) -> list[dict]:
    from train_step import MODELS
    rows = []
    for name, (make, *_rest) in MODELS.items():
        torch.manual_seed(0)
        numel = sum(p.numel() for p in make().parameters())
        row = dict(table="bytes", model=name, params=numel, ddp_bytes=4 * numel, activity_bytes=4 * (numel + 1))
        for k in tangents:
            row[f"fgfw_K{k}_bytes"] = 8 * (k + 1)
        rows.append(row)
    return rows


def worker(args) -> None:
    """One rank (under torchrun): times AFGFW and DDP FrankWolfe steps, rank 0 prints a JSON line."""
    import torch.distributed as dist
    import fgfw
    from fgfw.models import paper_mlp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.rand(args.batch, 784, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen)
    times = {}

    torch.manual_seed(0)
    model = paper_mlp()
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball.relative_to_init(5.0, scope="row"), step_size=0.002,
                     averaging_weight=0.02, num_tangents=args.tangents, seed=0)
    times["AFGFW (weight, K=%d)" % args.tangents] = _timed(lambda: opt.step(lambda: F.cross_entropy(model(x), y)),
                                                           args.steps, dist)
    torch.manual_seed(0)
    model = paper_mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    fw = fgfw.FrankWolfe(ddp.parameters(), constraint=fgfw.L1Ball.relative_to_init(5.0, scope="row"),
                         step_size=0.002, momentum=0.9)

    def backprop():
        fw.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        fw.step()
    times["FrankWolfe + DDP (backprop)"] = _timed(backprop, args.steps, dist)
    if rank == 0:
        print("RESULT " + json.dumps({"world": world, "times_ms": times}), flush=True)
    dist.destroy_process_group()


def _timed(step, steps: int, dist) -> float:
    for _ in range(5):
        step()
    seconds = []
    for _ in range(steps):
        dist.barrier()  # the ranks start each step together
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tangents", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per case")
    parser.add_argument("--out", type=Path, default=None, help="CSV path")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = bytes_table([1, args.tangents, 16])
    print("| model | params | DDP (4 B/param) | fgfw weight, K=1 | K=%d | K=16 | fgfw activity |" % args.tangents)
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['params']:,} | {r['ddp_bytes']:,} | {r['fgfw_K1_bytes']} | "
              f"{r[f'fgfw_K{args.tangents}_bytes']} | {r['fgfw_K16_bytes']} | {r['activity_bytes']:,} |")
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"), OMP_NUM_THREADS="1")
    timing = []
    for world in args.worlds:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={world}", __file__, "--worker", "--tangents", str(args.tangents),
                               "--batch", str(args.batch), "--steps", str(args.steps)],
                              env=env, capture_output=True, text=True, timeout=1800)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            sys.exit(f"{world} processes failed:\n{(done.stdout + done.stderr)[-3000:]}")
        result = json.loads(line[len("RESULT "):])
        for case, ms in result["times_ms"].items():
            timing.append(dict(table="time", model="paper_mlp", processes=world, case=case, batch_per_rank=args.batch,
                               median_ms=ms))
    print()
    print(f"| processes (gloo, this machine) | case | median step (ms), batch {args.batch} per rank |")
    print("|---:|---|---:|")
    for r in timing:
        print(f"| {r['processes']} | {r['case']} | {r['median_ms']:.3f} |")
    if args.out:
        from fgfw.experiments import write_csv
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_csv(args.out, rows + timing)


if __name__ == "__main__":
    main()
