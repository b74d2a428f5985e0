"""The step of an unconstrained param group in Triton: the Triton backend of reference.gradient_step_ with given
directions (what fgfw._ops.gradient_step_ calls for the "triton" backend; csrc/cpu/gradient_step.cpp on the CPU).

Per element, in the params' dtype (float32 or float64; momentum and directions share it), every operation rounded
on its own (enable_fp_fusion=False: no FMA contraction), in the reference's order:

    alpha, gamma = RN(schedule[1]), RN(schedule[2]);  keep = RN(1 - gamma)
    with momentum:  v <- RN(RN(keep v) + RN(gamma g)),  d = v;  else d = g
    theta <- RN(theta - RN(alpha d))

One launch over every tensor of the call, as l1_fw_step.py's step: an int64 table with one row of _STRIDE columns per
tensor (the param, momentum and direction addresses, its numel and its first block), and an int32 map from each
block of BLOCK elements to its tensor's row. The map and the numels are laid out once per list of sizes
(``_layout``), the addresses once per list of tensors (``_table``), both cached and uploaded with no host
synchronisation, so that a step on the same tensors uploads nothing and can be captured in a CUDA graph (warm up
first; a table a capture replays is held for good: l1_fw_step.hold_while_capturing).

A skipped step (a schedule of 4 elements whose skip, schedule[3], is not 0: reference.schedule_values) is read by
the kernel on the device (SKIPPABLE: the schedule has 4 elements): every program returns at once and no bit of
the params or the momentum changes.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Sequence

import torch
import triton
import triton.language as tl

from .l1_fw_step import _pointer, check_params_where_triton_runs, check_schedule, hold_while_capturing, skippable
from .tangent import TL_DTYPES, device_of

# The table: one row of _STRIDE int64 columns per tensor.
_STRIDE = tl.constexpr(8)
_PARAM, _MOMENTUM, _GRAD, _NUMEL, _FIRST_BLOCK = (tl.constexpr(c) for c in range(5))

# Elements per program: 8 a thread on 8 warps (two 16-byte accesses of float32), as the L1 step's blocks.
_BLOCK = 2048
_WARPS = 8
# The L1 step's register ceiling (l1_fw_step._MAX_REGISTERS); this kernel needs far fewer.
_MAX_REGISTERS = 128


@triton.jit
def _gradient_block(row, start, numel, schedule, DTYPE: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
                    ALIGNED: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """The step on elements start + [0, BLOCK) of the tensor with table row ``row`` (those < numel when MASKED)."""
    i = tl.arange(0, BLOCK)
    if MASKED:
        valid = i < (numel - start).to(tl.int32)
    else:
        valid = None
    theta_ptr = _pointer(tl.load(row + _PARAM), DTYPE, ALIGNED) + start + i
    g = tl.load(_pointer(tl.load(row + _GRAD), DTYPE, ALIGNED) + start + i, mask=valid)
    if HAS_MOMENTUM:
        v_ptr = _pointer(tl.load(row + _MOMENTUM), DTYPE, ALIGNED) + start + i
        gamma = tl.load(schedule + 2).to(DTYPE)
        keep = 1.0 - gamma  # in DTYPE: a Python float takes the tensor's type
        d = keep * tl.load(v_ptr, mask=valid) + gamma * g
        tl.store(v_ptr, d, mask=valid)
    else:
        d = g
    alpha = tl.load(schedule + 1).to(DTYPE)
    tl.store(theta_ptr, tl.load(theta_ptr, mask=valid) - alpha * d, mask=valid)


@triton.jit
def _gradient_step_kernel(block_tensor, meta, schedule, DTYPE: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
                          ALIGNED: tl.constexpr, SKIPPABLE: tl.constexpr, BLOCK: tl.constexpr):
    # ``block_tensor`` maps a program to its tensor's row of ``meta``; block b of a tensor holds its elements
    # [b BLOCK, (b + 1) BLOCK), the last one masked at the tensor's end.
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:  # a skipped step: nothing written
            return
    block = tl.program_id(0)
    row = meta + tl.load(block_tensor + block).to(tl.int64) * _STRIDE
    numel = tl.load(row + _NUMEL)
    start = (block - tl.load(row + _FIRST_BLOCK)) * BLOCK  # int64: a multiple of BLOCK the compiler sees
    # Full blocks run unmasked: with ALIGNED, their loads and stores vectorise.
    if start + BLOCK <= numel:
        _gradient_block(row, start, numel, schedule, DTYPE, HAS_MOMENTUM, ALIGNED, False, BLOCK)
    else:
        _gradient_block(row, start, numel, schedule, DTYPE, HAS_MOMENTUM, ALIGNED, True, BLOCK)


@dataclasses.dataclass(frozen=True, eq=False)
class _Layout:
    """A list of sizes laid out in blocks, on the device (see _layout)."""
    n_tensors: int
    blocks: int
    rows: torch.Tensor  # int64, (n_tensors, _STRIDE) but the addresses: numel and first block of each tensor
    block_tensor: torch.Tensor  # int32, block -> its tensor's row


@functools.lru_cache(maxsize=64)
def _layout(device: torch.device, numels: tuple) -> _Layout:
    """The blocks of tensors of these sizes (an empty tensor has none), uploaded; cached by content."""
    counts = [triton.cdiv(n, _BLOCK) for n in numels]
    rows = torch.zeros(len(numels), _STRIDE, dtype=torch.int64)
    rows[:, _NUMEL.value] = torch.tensor(numels, dtype=torch.int64)
    rows[:, _FIRST_BLOCK.value] = torch.tensor([0, *itertools.accumulate(counts)][:-1], dtype=torch.int64)
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32),
                                           torch.tensor(counts, dtype=torch.int64))
    return _Layout(n_tensors=len(numels), blocks=sum(counts), rows=rows.to(device, non_blocking=True),
                   block_tensor=block_tensor.to(device, non_blocking=True))


@functools.lru_cache(maxsize=64)
def _table(layout: _Layout, addresses: tuple) -> torch.Tensor:
    """The table of a list of tensors: the layout's rows with each tensor's (param, momentum, grad) addresses (0 for
    an absent momentum); cached by the addresses, so that a step on the same tensors uploads nothing."""
    host = torch.tensor(addresses, dtype=torch.int64).view(layout.n_tensors, 3)
    table = layout.rows.clone()
    table[:, :3] = host.to(table.device, non_blocking=True)
    return table.view(-1)


def _check_args(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                schedule: torch.Tensor) -> None:
    """As the C++ check_gradient_step_args (csrc/op_args.cpp), as ValueError: float32 or float64 params of one dtype
    and device, momentum empty or one per param, one direction per param, all of the params' dtype, device and
    numel, contiguous; the schedule (step, alpha, gamma[, skip]) on the params' device."""
    n = len(params)
    if momentum and len(momentum) != n:
        raise ValueError(f"momentum must be empty (no momentum) or hold one tensor per parameter ({n}), got "
                         f"{len(momentum)}")
    if len(grads) != n:
        raise ValueError(f"grads must hold one direction per parameter ({n}), got {len(grads)}")
    check_schedule(schedule, params[0].device if params else None)
    if not params:
        return
    device, dtype = params[0].device, params[0].dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"params must be float32 or float64 (the compute dtype: a half parameter steps its float32 "
                         f"master copy), got {dtype}")
    check_params_where_triton_runs(params)
    for t, p in enumerate(params):
        for name, tensors in (("momentum", momentum), ("grads", grads)):
            if not tensors:
                continue
            x = tensors[t]
            if x.dtype != dtype or x.device != device or x.numel() != p.numel() or not x.is_contiguous():
                raise ValueError(f"{name}[{t}] must be a contiguous {dtype} tensor of {p.numel()} elements on "
                                 f"{device} like params[{t}], got {x.dtype} with {x.numel()} elements on {x.device} "
                                 f"(contiguous={x.is_contiguous()})")


def gradient_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   schedule: torch.Tensor) -> None:
    """An unconstrained group's step, in place, every tensor in one launch: reference.gradient_step_ with the
    directions ``grads`` (momentum: v = (1 - gamma) v + gamma g, d = v; theta = theta - alpha d), bit for bit.

    ``schedule``: (step, alpha, gamma), or (step, alpha, gamma, skip), whose skip the kernel reads on the device:
    not 0, nothing is written. The first call for a list of tensors uploads its table (host-to-device copies, so
    warm up before capturing a CUDA graph); later calls only launch the kernel.
    """
    _check_args(params, momentum, grads, schedule)
    if not params:
        return
    device = params[0].device
    layout = _layout(device, tuple(p.numel() for p in params))
    if layout.blocks == 0:
        return
    has_momentum = bool(momentum)
    addresses = tuple(a for t, p in enumerate(params) for a in (
        p.data_ptr(), momentum[t].data_ptr() if has_momentum else 0, grads[t].data_ptr()))
    table = _table(layout, addresses)
    hold_while_capturing(layout, table)
    with device_of(params[0]):
        _gradient_step_kernel[(layout.blocks,)](
            layout.block_tensor, table, schedule, DTYPE=TL_DTYPES[params[0].dtype], HAS_MOMENTUM=has_momentum,
            ALIGNED=all(a % 16 == 0 for a in addresses), SKIPPABLE=skippable(schedule), BLOCK=_BLOCK,
            num_warps=_WARPS,
            # no FMA contraction: every product and sum rounds as in the reference
            enable_fp_fusion=False, maxnreg=_MAX_REGISTERS)
