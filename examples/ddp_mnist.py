"""Data-parallel AFGFW on MNIST over torch.distributed: each rank reads its own shard of the training
set, and a step sends K + 1 numbers instead of a gradient.

    torchrun --nproc_per_node=2 examples/ddp_mnist.py --data ../shared/data/mnist --steps 50
    torchrun --nproc_per_node=4 examples/ddp_mnist.py --data ../shared/data/mnist --steps 50
    torchrun --nproc_per_node=2 examples/ddp_mnist.py --data digits --steps 50   # scikit-learn's digits

gloo on CPUs, NCCL with --device cuda (one GPU per rank). Every rank draws the same tangents (fgfw's
counter-based stream, one seed agreed at start), computes the K directional derivatives of the loss
on its own batch, and the optimizer all-reduces them (with the rank's batch size) before the identical
fused update on every rank: the replicas stay bit-identical. Each rank ends its output with

    rank R params_sha256 HEX allreduce_bytes_per_step N

(equal hashes: identical parameters; N = 8 (K + 1) for the weight estimator).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fgfw
from fgfw.data import load
from fgfw.experiments import LinearDecay
from fgfw.models import paper_mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="digits", help="MNIST IDX folder, or 'digits' (default)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="examples per rank and step")
    parser.add_argument("--num-tangents", type=int, default=4, help="K: tangents (numbers all-reduced) per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")  # rank and world size from torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share the machine's cores
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")

    (x_train, y_train), (x_test, y_test) = load(args.data)
    x_shard, y_shard = x_train[rank::world].to(device), y_train[rank::world].to(device)  # this rank's examples
    torch.manual_seed(args.seed)  # the same model everywhere (the optimizer also broadcasts rank 0's)
    model = paper_mlp(in_features=x_train.shape[1]).to(device)
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball.relative_to_init(5.0, scope="row"),
                     step_size=LinearDecay(0.002, args.steps), averaging_weight=0.02,
                     num_tangents=args.num_tangents, seed=args.seed, check_replicas_every=10)

    sent = []  # bytes of every all-reduce during the steps
    all_reduce = dist.all_reduce

    def counted_all_reduce(tensor, *a, **kw):
        sent.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *a, **kw)
    dist.all_reduce = counted_all_reduce

    batches = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        i = torch.randint(len(y_shard), (args.batch,), generator=batches).to(device)
        x, y = x_shard[i], y_shard[i]
        loss = opt.step(lambda: F.cross_entropy(model(x), y), batch_size=args.batch)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step}/{args.steps}  loss (rank 0's batch) {float(loss):.4f}  "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    dist.all_reduce = all_reduce

    with torch.no_grad():
        accuracy = (model(x_test.to(device)).argmax(1) == y_test.to(device)).float().mean()
    if rank == 0:
        print(f"test accuracy {float(accuracy):.4f} after {args.steps} steps on {world} ranks", flush=True)
    digest = hashlib.sha256(b"".join(p.detach().cpu().contiguous().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    dist.barrier()
    print(f"rank {rank} params_sha256 {digest} allreduce_bytes_per_step {sum(sent) // args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
