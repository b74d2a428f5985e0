"""Data-parallel forward-gradient steps over ``torch.distributed``: K numbers per step instead of a gradient.

Every rank draws the same tangents (same seed, step, tangent id and parameter order: the Philox stream
is a pure function of them), so the directional derivative of the loss over the union of the ranks'
batches is the batch-weighted mean of the ranks' local derivatives ``c``. A step all-reduces those K
numbers (float64, with the rank's batch weight: 8 (K + 1) bytes) and every rank applies the identical
fused update, so the replicas stay bit-identical without a parameter ever being sent after the start.

At construction the parameters are broadcast from the group's first rank (as DistributedDataParallel
does) and the seed is agreed. The activity estimator's estimate is dense: it is all-reduced like a
gradient, one flat buffer per (device, dtype).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

AUTO = "auto"


def resolve_group(process_group: object) -> object | None:
    """The process group the optimizer works over, or None for a single process.

    ``"auto"``: the default group when torch.distributed is initialised with more than one process, else
    None; ``None``: a single process even when it is initialised; a ``ProcessGroup``: that group (None
    when it has one rank).
    """
    initialised = dist.is_available() and dist.is_initialized()
    if process_group is None:
        return None
    if isinstance(process_group, str):
        if process_group != AUTO:
            raise ValueError(f"process_group must be 'auto', None or a torch.distributed ProcessGroup, got "
                             f"{process_group!r}")
        if not initialised:
            return None
        process_group = dist.group.WORLD
    elif not initialised:
        raise ValueError("process_group was given but torch.distributed is not initialised (call "
                         "torch.distributed.init_process_group first, or pass process_group=None)")
    return process_group if dist.get_world_size(process_group) > 1 else None


class Replicas:
    """The collectives of a data-parallel optimizer over ``group`` (more than one rank)."""

    def __init__(self, group, param_device: torch.device):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.first = dist.get_global_rank(group, 0)
        # NCCL moves CUDA tensors only; gloo (and the others) CPU tensors
        self.device = param_device if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Every tensor replaced by the first rank's (the starting parameters, before radii are set)."""
        for t in tensors:
            buffer = t.detach().to(self.device)
            dist.broadcast(buffer, src=self.first, group=self.group)
            with torch.no_grad():
                t.copy_(buffer)

    def agree_seed(self, seed: int, explicit: bool) -> int:
        """The seed every rank uses: the first rank's; a rank given another one explicitly raises on every rank
        (each rank learns every rank's seed, so all raise alike)."""
        mine = torch.tensor([seed & ((1 << 63) - 1), seed >> 63 & 1, int(explicit)], dtype=torch.int64,
                            device=self.device)
        seeds = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(seeds, mine, group=self.group)
        values = [(int(s[0]) | int(s[1]) << 63, bool(s[2])) for s in seeds]
        chosen = values[0][0]
        differ = [(r, v) for r, (v, given) in enumerate(values) if given and v != chosen]
        if differ:
            others = ", ".join(f"rank {r} has {v}" for r, v in differ)
            raise ValueError(f"seed differs across the ranks of the process group: rank 0 has {chosen}, {others}; "
                             f"every rank must draw the same tangents: give every rank the same seed, or none "
                             f"(rank 0's is then used)")
        return chosen

    def mean_coefficients(self, coeffs: torch.Tensor, weight: float) -> torch.Tensor:
        """The batch-weighted mean over ranks of the local directional derivatives (float64 [K]); one
        all-reduce of K + 1 numbers. A non-finite value on any rank makes the mean non-finite on every rank."""
        local = torch.cat([coeffs.reshape(-1).to(torch.float64) * weight,
                           torch.tensor([weight], dtype=torch.float64, device=coeffs.device)]).to(self.device)
        dist.all_reduce(local, group=self.group)
        return (local[:-1] / local[-1]).to(coeffs.device)

    def mean_dense_(self, tensors: list[torch.Tensor], weight: float) -> None:
        """Each tensor replaced in place by its batch-weighted mean over ranks: one all-reduce of a flat
        buffer per (device, dtype), the rank's weight appended as its last element."""
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            buckets.setdefault((t.device, t.dtype), []).append(t)
        for (device, dtype), members in buckets.items():
            flat = torch.cat([t.reshape(-1) * weight for t in members]
                             + [torch.tensor([weight], dtype=dtype, device=device)]).to(self.device)
            dist.all_reduce(flat, group=self.group)
            flat = (flat[:-1] / flat[-1]).to(device)
            at = 0
            for t in members:
                t.copy_(flat[at:at + t.numel()].view_as(t))
                at += t.numel()

    def check_identical(self, tensors: list[torch.Tensor], step: int) -> None:
        """Raises ``RuntimeError`` on every rank when the ranks' tensors differ in any bit (a checksum of their
        bits, gathered from every rank)."""
        total = torch.zeros((), dtype=torch.int64, device=self.device)
        for t in tensors:
            bits = t.detach().contiguous().view(-1)
            bits = bits.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()])
            # position-weighted, so that swapped values change it; int64 sums wrap alike on every rank
            positions = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
            total += (bits.to(torch.int64) * positions).sum().to(self.device)
        sums = [torch.empty_like(total) for _ in range(self.size)]
        dist.all_gather(sums, total, group=self.group)
        values = [int(s) for s in sums]
        if len(set(values)) > 1:
            raise RuntimeError(f"the parameters differ across ranks after step {step} (checksums by rank: {values}): "
                               f"the replicas diverged (a rank ran another model, batch shape or fgfw version, or "
                               f"its parameters were changed outside the optimizer)")
