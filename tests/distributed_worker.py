"""One rank of a data-parallel scenario, started by tests/test_distributed.py as its own process:

    python tests/distributed_worker.py SCENARIO RANK WORLD_SIZE INIT_FILE OUT_FILE

It joins a gloo group through INIT_FILE, runs SCENARIO (a function below) and torch.saves what it
observed into OUT_FILE for the test to compare across ranks and with a single-process run.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fgfw

STEPS = 6
FEATURES, CLASSES = 12, 4


def model(seed: int, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)).to(dtype)


def union_batches(dtype=torch.float64, sizes=(4, 4, 4, 4)):
    """STEPS batches of sum(sizes) examples each, and how they split into the ranks' shards."""
    gen = torch.Generator().manual_seed(123)
    total = sum(sizes)
    batches = [(torch.randn(total, FEATURES, generator=gen, dtype=dtype), torch.randint(0, CLASSES, (total,),
                                                                                         generator=gen))
               for _ in range(STEPS)]
    return batches


def shard(batch, rank: int, sizes) -> tuple[torch.Tensor, torch.Tensor]:
    start = sum(sizes[:rank])
    x, y = batch
    return x[start:start + sizes[rank]], y[start:start + sizes[rank]]


def sizes_for(world: int, unequal: bool) -> tuple[int, ...]:
    return tuple(3 + 2 * r for r in range(world)) if unequal else (4,) * world


def make_optimizer(kind: str, m: nn.Module, **kw):
    ball = fgfw.L1Ball.relative_to_init(1.5)
    if kind == "afgfw":
        return fgfw.AFGFW(m, constraint=ball, step_size=0.05, averaging_weight=0.3, num_tangents=2, **kw)
    if kind == "activity":
        return fgfw.AFGFW(m, constraint=ball, step_size=0.05, averaging_weight=0.3, num_tangents=2,
                          estimator="activity", **kw)
    if kind == "guided":
        return fgfw.AFGFW(m, constraint=ball, step_size=0.05, averaging_weight=0.3, num_tangents=2, guided=True, **kw)
    raise ValueError(kind)


def closure_for(kind: str, m: nn.Module, x, y):
    if kind == "activity":
        return lambda: F.cross_entropy(m(x), y, reduction="none")
    return lambda: F.cross_entropy(m(x), y)


def counting_all_reduce():
    """Wraps dist.all_reduce to count the bytes each call sends (the step's communication)."""
    counted = []
    original = dist.all_reduce

    def wrapped(tensor, *args, **kwargs):
        counted.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)
    dist.all_reduce = wrapped
    return counted


def train(rank: int, world: int, kind: str = "afgfw", unequal: bool = False, same_batch: bool = False) -> dict:
    """``same_batch``: every rank gets the whole batch (the mean of equal estimates is that estimate)."""
    sizes = sizes_for(world, unequal)
    batches = union_batches(sizes=sizes)
    if same_batch:
        rank, sizes = 0, (sum(sizes),)
    m = model(seed=100 + rank)  # every rank starts elsewhere: the optimizer broadcasts rank 0's
    opt = make_optimizer(kind, m, seed=7, check_replicas_every=2)
    start = [p.detach().clone() for p in m.parameters()]
    counted = counting_all_reduce()
    per_step = []
    for batch in batches:
        x, y = shard(batch, rank, sizes)
        before = len(counted)
        opt.step(closure_for(kind, m, x, y), batch_size=len(y) if unequal else None)
        per_step.append(sum(counted[before:]))
    return {"params": [p.detach().clone() for p in m.parameters()], "start": start, "bytes_per_step": per_step}


def train_unequal(rank: int, world: int) -> dict:
    return train(rank, world, unequal=True)


def train_guided(rank: int, world: int) -> dict:
    return train(rank, world, kind="guided")


def train_activity(rank: int, world: int) -> dict:
    # the activity estimator draws a tangent per example and position in the batch: the ranks' shards draw
    # other tangents than the union would, so the comparison with one process gives each rank the union
    return train(rank, world, kind="activity", same_batch=True)


def mean_dense(rank: int, world: int) -> dict:
    """Replicas.mean_dense_ on known values: rank r holds r + 1 (float64) and (r + 1) / 2 (float32), weight
    2 (r + 1)."""
    replicas = fgfw.distributed.Replicas(dist.group.WORLD, torch.device("cpu"))
    tensors = [torch.full((3, 2), rank + 1.0, dtype=torch.float64), torch.full((5,), (rank + 1) / 2)]
    counted = counting_all_reduce()
    replicas.mean_dense_(tensors, weight=2.0 * (rank + 1))
    return {"tensors": tensors, "bytes": counted}


def nonfinite(rank: int, world: int) -> dict:
    """Rank 1's loss turns NaN at step 3: every rank must refuse the step alike."""
    sizes = sizes_for(world, False)
    m = model(seed=100)
    opt = make_optimizer("afgfw", m, seed=7)
    outcome = []
    for k, batch in enumerate(union_batches(sizes=sizes)[:4], start=1):
        x, y = shard(batch, rank, sizes)
        if rank == 1 and k == 3:
            x = x * float("nan")
        before = [p.detach().clone() for p in m.parameters()]
        try:
            opt.step(closure_for("afgfw", m, x, y))
            outcome.append("stepped")
        except ValueError as err:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
            outcome.append(f"raised ({'unchanged' if unchanged else 'CHANGED'}): {err}")
    return {"outcome": outcome, "params": [p.detach().clone() for p in m.parameters()]}


def seed_mismatch(rank: int, world: int) -> dict:
    try:
        make_optimizer("afgfw", model(seed=100), seed=7 + rank)
        return {"error": None}
    except ValueError as err:
        return {"error": str(err)}


def seed_agreed(rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # no seed given: each rank draws another one; rank 0's is used
    opt = make_optimizer("afgfw", model(seed=100))
    return {"seed": opt.seed}


def diverge(rank: int, world: int) -> dict:
    """Rank 1 changes a parameter outside the optimizer after step 1: the check at step 2 must see it."""
    sizes = sizes_for(world, False)
    m = model(seed=100)
    opt = make_optimizer("afgfw", m, seed=7, check_replicas_every=2)
    for k, batch in enumerate(union_batches(sizes=sizes)[:3], start=1):
        x, y = shard(batch, rank, sizes)
        try:
            opt.step(closure_for("afgfw", m, x, y))
        except RuntimeError as err:
            return {"error": str(err), "step": k}
        if k == 1 and rank == 1:
            with torch.no_grad():
                next(m.parameters()).view(-1)[0] += 1e-3
    return {"error": None}


def resume(rank: int, world: int, out_dir: str) -> dict:
    """3 steps, rank 0 checkpoints, every rank loads it into a new model and optimizer, 3 more steps: the
    same parameters as 6 steps straight."""
    sizes = sizes_for(world, False)
    batches = union_batches(sizes=sizes)
    m = model(seed=100)
    opt = make_optimizer("afgfw", m)  # seed agreed from rank 0's draw
    for batch in batches[:3]:
        x, y = shard(batch, rank, sizes)
        opt.step(closure_for("afgfw", m, x, y))
    path = os.path.join(out_dir, "checkpoint.pt")
    if rank == 0:
        torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, path)
    dist.barrier()
    resumed = model(seed=200 + rank)
    opt_resumed = make_optimizer("afgfw", resumed)
    saved = torch.load(path)
    resumed.load_state_dict(saved["model"])
    opt_resumed.load_state_dict(saved["opt"])
    for module, optimizer in ((m, opt), (resumed, opt_resumed)):
        for batch in batches[3:]:
            x, y = shard(batch, rank, sizes)
            optimizer.step(closure_for("afgfw", module, x, y))
    return {"straight": [p.detach().clone() for p in m.parameters()],
            "resumed": [p.detach().clone() for p in resumed.parameters()]}


def ddp_frank_wolfe(rank: int, world: int) -> dict:
    """Backprop FrankWolfe on a DistributedDataParallel model, unchanged: DDP averages the gradients."""
    sizes = sizes_for(world, False)
    m = model(seed=100 + rank)
    ddp = nn.parallel.DistributedDataParallel(m)  # broadcasts rank 0's parameters
    opt = fgfw.FrankWolfe(ddp.parameters(), constraint=fgfw.L1Ball.relative_to_init(1.5), step_size=0.05,
                          momentum=0.5)
    for batch in union_batches(sizes=sizes):
        x, y = shard(batch, rank, sizes)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {"params": [p.detach().clone() for p in m.parameters()]}


def main() -> None:
    scenario, rank, world, init_file, out_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if scenario == "resume":
            result = resume(rank, world, os.path.dirname(out_file))
        else:
            result = globals()[scenario](rank, world)
        torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
