"""The fused L1-ball Frank-Wolfe step in Triton: the Triton backend of reference.l1_fw_step_.

Three launches and no host synchronisation (schedule and coefficients are read by pointer):

1. ``_fw_blocks_kernel``, one program per block of BLOCK elements of any tensor: regenerates the K
   tangents (or reads the gradient), updates v, scales theta by (1 - alpha) and writes the block's
   partials to its slot: the signed d of its largest |d| (lowest index on ties, NaN counted largest,
   as torch.argmax), that index, and sum(d * theta_old) in float64.
2. ``_fw_finalize_kernel``, one program per ball: reduces its slots the same way, applies the vertex
   update -alpha r sign(d_i*) to the winning element (index read on the device) and writes the ball's
   share of the gap, sum(d * theta_old) + r |d_i*|.
3. ``_gap_sum_kernel``, only when there are several balls: sums the shares into ``gap``.

Why one launch over a pointer table rather than one launch per tensor: a model has tens to hundreds
of parameter tensors and every Triton launch costs microseconds of Python, more than the whole
update of a small tensor. The table (per tensor: addresses, size, stream offset, first slot) and the
block -> tensor map are built on the host from metadata only, uploaded once and cached by content, so
a step costs three launches whatever the tensor count. Slots are numbered in (tensor, block) order,
so "lowest slot" is "lowest (tensor, index)", the global ball's tie rule, with no extra bookkeeping.
Addresses read from a table carry no alignment the compiler can see; when every address is 16-byte
aligned and every tensor starts on a Philox call boundary (ALIGNED) the kernel states it with
tl.multiple_of, and full blocks run unmasked, so loads and stores vectorise. The interpreter runs the
same table on CPU tensors, whose raw addresses are valid on the host.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import reference
from .tangent import (BLOCK, INTERPRET, ROWS, TL_DTYPES, check_distribution, device_of, key_words, tangent_tile,
                      to_storage)

# Columns of the per-tensor table (int64), in the order the launcher writes them.
_PARAM, _MOMENTUM, _GRAD, _NUMEL, _STREAM_BASE, _LEAD, _FIRST_SLOT = (tl.constexpr(c) for c in range(7))
_META_STRIDE = tl.constexpr(7)

# 8 warps: 8 elements per thread, about 64 registers for float32 (126 for float64) on sm_90, so
# several blocks fit on an SM; 4 warps doubled the registers per thread.
_BLOCK_WARPS = 8

# Slots reduced per iteration by the finalize and gap kernels.
_RBLOCK = 1024

_INF = tl.constexpr(float("inf"))
_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _pointer(address, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    pointer = address.to(tl.pointer_type(DTYPE), bitcast=True)
    if ALIGNED:
        # On the pointer, not the integer: a hint on the loaded integer does not reach the loads.
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _argmax_abs(d, valid, index):
    """(index, d) at the largest |d| over the valid lanes: lowest index on ties, NaN above everything.

    ``index`` is an int32 position within the block (int64 per element would cost registers).

    Built from plain max/min/sum reductions (no custom combine): they behave the same compiled and
    interpreted, and NaN is handled explicitly because tl.max's NaN handling differs between the two.
    """
    magnitude = tl.abs(d)
    is_nan = magnitude != magnitude
    key = tl.where(is_nan, _INF, magnitude)
    if valid is not None:
        is_nan = is_nan & valid
        key = tl.where(valid, key, -1.0)
    top = tl.max(key)
    hit = tl.where(tl.max(is_nan.to(tl.int32)) != 0, is_nan, key == top)
    best = tl.min(tl.where(hit, index, _NO_INDEX))
    return best, tl.sum(tl.where(index == best, d, 0.0))


@triton.jit
def _forward_gradient(stream_start, schedule, tangent_coeffs, key_lo, key_hi, n_tangents,
                      COMPUTE_DTYPE: tl.constexpr, GAUSSIAN: tl.constexpr, ROWS: tl.constexpr):
    """g = sum_k c_k u_k over a block, summed in the reference's order."""
    step = tl.load(schedule).to(tl.int64).to(tl.uint32)
    g = tl.zeros([ROWS, 4], dtype=COMPUTE_DTYPE)
    for k in range(n_tangents):
        # tl.cast: the loop index is a Python int when interpreted.
        term = tl.load(tangent_coeffs + k).to(COMPUTE_DTYPE) * tangent_tile(
            stream_start, key_lo, key_hi, step, tl.cast(k, tl.uint32), GAUSSIAN, ROWS).to(COMPUTE_DTYPE)
        # The reference starts from the first term, not from 0 + term (which turns -0 into +0).
        g = tl.where(k == 0, term, g + term)
    return g


@triton.jit
def _fw_block(row, slot, start, numel, g, schedule, partial_d, partial_index, partial_dot,
              PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
              HAS_MOMENTUM: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr, ROWS: tl.constexpr):
    """The step on elements start + [0, 4 ROWS) of one tensor; g is None for the gradient path."""
    # Element start + i for i in [0, 4 ROWS): int32 positions on int64 base pointers.
    i = 4 * tl.arange(0, ROWS)[:, None] + tl.arange(0, 4)[None, :]
    if MASKED:
        valid = (i >= (-start).to(tl.int32)) & (i < tl.minimum(numel - start, 4 * ROWS).to(tl.int32))
    else:
        valid = None
    theta_ptr = _pointer(tl.load(row + _PARAM), PARAM_DTYPE, ALIGNED) + start + i
    theta = tl.load(theta_ptr, mask=valid).to(COMPUTE_DTYPE)
    if g is None:
        g = tl.load(_pointer(tl.load(row + _GRAD), GRAD_DTYPE, ALIGNED) + start + i, mask=valid).to(COMPUTE_DTYPE)
    if HAS_MOMENTUM:
        v_ptr = _pointer(tl.load(row + _MOMENTUM), COMPUTE_DTYPE, ALIGNED) + start + i
        gamma = tl.load(schedule + 2).to(COMPUTE_DTYPE)
        d = (1.0 - gamma) * tl.load(v_ptr, mask=valid) + gamma * g
        tl.store(v_ptr, d, mask=valid)
    else:
        d = g
    alpha = tl.load(schedule + 1).to(COMPUTE_DTYPE)
    tl.store(theta_ptr, to_storage((1.0 - alpha) * theta, PARAM_DTYPE), mask=valid)
    dot = d.to(tl.float64) * theta.to(tl.float64)
    if MASKED:
        dot = tl.where(valid, dot, 0.0)
    best, d_best = _argmax_abs(d, valid, i)
    tl.store(partial_d + slot, d_best.to(tl.float64))
    tl.store(partial_index + slot, start + best)
    tl.store(partial_dot + slot, tl.sum(dot))


@triton.jit(do_not_specialize=["key_lo", "key_hi", "n_tangents"])
def _fw_blocks_kernel(block_tensor, meta, schedule, tangent_coeffs, partial_d, partial_index, partial_dot,
                      key_lo, key_hi, n_tangents, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
                      COMPUTE_DTYPE: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
                      GAUSSIAN: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr):
    # Block b of a tensor covers stream indices stream_base + [b * 4 ROWS, (b + 1) * 4 ROWS), whole
    # Philox calls; its element j sits LEAD (= offset % 4) positions into the stream, so the first
    # block of a tensor whose offset is not a multiple of 4 starts at j = -LEAD (masked off).
    slot = tl.program_id(0)
    row = meta + tl.load(block_tensor + slot).to(tl.int64) * _META_STRIDE
    numel = tl.load(row + _NUMEL)
    first = (slot - tl.load(row + _FIRST_SLOT)) * (4 * ROWS)
    start = first
    if not ALIGNED:
        start -= tl.load(row + _LEAD)
    if HAS_GRAD:
        g = None
    else:
        # Generated once, outside the full/tail split below, so the Philox and Box-Muller code is
        # compiled once rather than in both branches.
        g = _forward_gradient(tl.load(row + _STREAM_BASE) + first, schedule, tangent_coeffs,
                              key_lo.to(tl.uint32, bitcast=True), key_hi.to(tl.uint32, bitcast=True), n_tangents,
                              COMPUTE_DTYPE, GAUSSIAN, ROWS)
    # Full blocks run unmasked: with ALIGNED, their loads and stores vectorise.
    if (start >= 0) & (start + 4 * ROWS <= numel):
        _fw_block(row, slot, start, numel, g, schedule, partial_d, partial_index, partial_dot, PARAM_DTYPE,
                  GRAD_DTYPE, COMPUTE_DTYPE, HAS_MOMENTUM, ALIGNED, False, ROWS)
    else:
        _fw_block(row, slot, start, numel, g, schedule, partial_d, partial_index, partial_dot, PARAM_DTYPE,
                  GRAD_DTYPE, COMPUTE_DTYPE, HAS_MOMENTUM, ALIGNED, True, ROWS)


@triton.jit
def _fw_finalize_kernel(balls, ball_radii, block_tensor, meta, schedule, partial_d, partial_index, partial_dot,
                        ball_gap, PARAM_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, RBLOCK: tl.constexpr):
    ball = tl.program_id(0)
    first = tl.load(balls + 2 * ball)
    end = first + tl.load(balls + 2 * ball + 1)
    dot = tl.zeros([RBLOCK], dtype=tl.float64)
    # If every |d| is 0 the first slot wins, which is also what the first chunk's argmax returns.
    best = first
    best_d = tl.zeros([], dtype=tl.float64)
    for chunk in range(first, end, RBLOCK):
        i = tl.arange(0, RBLOCK)
        valid = i < end - chunk
        dot += tl.load(partial_dot + chunk + i, mask=valid, other=0.0)
        slot, d = _argmax_abs(tl.load(partial_d + chunk + i, mask=valid, other=0.0), valid, i)
        # Chunks come in slot order, so a later one wins only by being strictly larger (NaN largest).
        best_is_nan = best_d != best_d
        take = ((d != d) & ~best_is_nan) | (~best_is_nan & (tl.abs(d) > tl.abs(best_d)))
        best = tl.where(take, chunk + slot, best)
        best_d = tl.where(take, d, best_d)
    index = tl.load(partial_index + best)
    theta_ptr = tl.load(meta + tl.load(block_tensor + best).to(tl.int64) * _META_STRIDE + _PARAM).to(
        tl.pointer_type(PARAM_DTYPE), bitcast=True) + index
    radius = tl.load(ball_radii + ball)
    d = best_d.to(COMPUTE_DTYPE)
    sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))  # torch.sign: 0 for 0 and for NaN
    vertex = -radius.to(COMPUTE_DTYPE) * sign
    alpha = tl.load(schedule + 1).to(COMPUTE_DTYPE)
    tl.store(theta_ptr, to_storage(tl.load(theta_ptr).to(COMPUTE_DTYPE) + alpha * vertex, PARAM_DTYPE))
    tl.store(ball_gap + ball, tl.sum(dot) + tl.abs(best_d) * radius)


@triton.jit
def _gap_sum_kernel(ball_gap, gap, n_balls, RBLOCK: tl.constexpr):
    total = tl.zeros([RBLOCK], dtype=tl.float64)
    for chunk in range(0, n_balls, RBLOCK):
        i = chunk + tl.arange(0, RBLOCK)
        total += tl.load(ball_gap + i, mask=i < n_balls, other=0.0)
    tl.store(gap, tl.sum(total))


@functools.lru_cache(maxsize=64)
def _tables(device: torch.device, rows: tuple, block_counts: tuple, balls: tuple, radii: tuple):
    """Uploads the per-tensor table, the block -> tensor map and the balls; cached by content, so the
    copy happens once per set of tensors (a new content, e.g. a moved tensor, is a new entry)."""
    block_tensor = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32),
                                           torch.tensor(block_counts, dtype=torch.int64))
    host = (torch.tensor(rows, dtype=torch.int64), block_tensor, torch.tensor(balls, dtype=torch.int64),
            torch.tensor(radii, dtype=torch.float64))
    return tuple(x.to(device, non_blocking=True) for x in host)


def _check_tensor_list(name: str, tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                       dtype: torch.dtype | None) -> None:
    if len(tensors) != len(params):
        raise ValueError(f"{name} must be empty or hold one tensor per parameter ({len(params)}), got {len(tensors)}")
    for t, (x, p) in enumerate(zip(tensors, params)):
        if x.shape != p.shape or x.device != p.device or not x.is_contiguous():
            raise ValueError(f"{name}[{t}] must be contiguous with shape {tuple(p.shape)} on {p.device}, got "
                             f"shape {tuple(x.shape)} on {x.device} (contiguous={x.is_contiguous()})")
        if dtype is not None and x.dtype != dtype:
            raise TypeError(f"{name}[{t}] must be {dtype}, got {x.dtype}")


def _check_args(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, distribution,
                gap) -> None:
    check_distribution(distribution)
    if gap.dtype != torch.float64 or gap.numel() != 1:
        raise ValueError(f"gap must be a float64 tensor with one element, got {gap.dtype} of shape {tuple(gap.shape)}")
    if not params:
        return
    device, dtype = params[0].device, params[0].dtype
    if dtype not in TL_DTYPES:
        raise TypeError(f"params must be float32, float64, bfloat16 or float16, got {dtype}")
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"the Triton backend runs on CUDA tensors (or on CPU tensors with TRITON_INTERPRET=1 set "
                         f"before importing fgfw.triton), got params on {device}")
    if device.type != "cpu" and INTERPRET:
        raise ValueError(f"with TRITON_INTERPRET=1 the Triton step reads tensor addresses on the host and needs "
                         f"CPU tensors, got params on {device}")
    for t, p in enumerate(params):
        if p.dtype != dtype or p.device != device or not p.is_contiguous():
            raise ValueError(f"params[{t}] must be a contiguous {dtype} tensor on {device} like params[0] (one "
                             f"call per device and dtype group), got {p.dtype} on {p.device} "
                             f"(contiguous={p.is_contiguous()})")
    if momentum:
        _check_tensor_list("momentum", momentum, params, reference.compute_dtype(dtype))
    if grads:
        _check_tensor_list("grads", grads, params, None)
        if len({g.dtype for g in grads}) != 1 or grads[0].dtype not in TL_DTYPES:
            raise TypeError(f"grads must share one floating dtype, got {sorted({str(g.dtype) for g in grads})}")
    elif (tangent_coeffs.dtype != torch.float64 or tangent_coeffs.device != device or tangent_coeffs.numel() == 0
          or not tangent_coeffs.is_contiguous()):
        raise ValueError(f"tangent_coeffs must be a non-empty contiguous float64 tensor on {device} when grads is "
                         f"empty, got {tangent_coeffs.dtype} with {tangent_coeffs.numel()} elements on "
                         f"{tangent_coeffs.device} (contiguous={tangent_coeffs.is_contiguous()})")
    if (schedule.dtype != torch.float64 or schedule.numel() != 3 or schedule.device != device
            or not schedule.is_contiguous()):
        raise ValueError(f"schedule must be a contiguous float64 tensor (step, alpha, gamma) on {device}, got "
                         f"{schedule.dtype} with {schedule.numel()} elements on {schedule.device} "
                         f"(contiguous={schedule.is_contiguous()})")
    if gap.device != device:
        raise ValueError(f"gap must be on {device}, got {gap.device}")
    if not grads and (len(offsets) != len(params) or min(offsets) < 0):
        # as the reference: tensors sharing an offset would share tangent values, a biased estimate
        raise ValueError(f"offsets must give each of the {len(params)} params its non-negative stream offset for "
                         f"the forward gradient, got {list(offsets)}")
    wanted = 1 if global_ball else len(params)
    if len(radii) < wanted:
        raise ValueError(f"radii must hold {'one radius (global ball)' if global_ball else 'one radius per parameter'}"
                         f" ({wanted}), got {len(radii)}")
    for t, r in enumerate(radii):
        if not math.isfinite(r) or r <= 0:  # as the C++ kernels: every backend rejects the same inputs
            raise ValueError(f"radii[{t}] must be a finite radius > 0, got {r}")


def l1_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: Sequence[float], global_ball: bool,
                offsets: Sequence[int], seed: int, distribution: int, gap: torch.Tensor,
                row_numel: Sequence[int] = ()) -> None:
    """One Frank-Wolfe step over the L1 ball(s), in place; same contract as reference.l1_fw_step_.

    All params share one device and dtype (the optimizer calls once per group) and are contiguous;
    momentum has the compute dtype (float64 for float64 params, else float32); grads share one dtype.
    The first call for a set of tensors uploads their table (a host-to-device copy, so warm up before
    capturing a CUDA graph); later calls only launch kernels.
    """
    _check_args(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, distribution, gap)
    if any(row_numel):
        raise NotImplementedError("row balls (row_numel) are not implemented in the Triton step yet")
    has_grad, has_momentum = bool(grads), bool(momentum)
    rows, block_counts, first_slots = [], [], []
    aligned = True
    slot = 0
    for t, p in enumerate(params):
        # The gradient path reads no stream (offsets are ignored), so its blocks start at element 0.
        offset = 0 if has_grad else offsets[t]
        lead = offset % 4
        addresses = (p.data_ptr(), momentum[t].data_ptr() if has_momentum else 0,
                     grads[t].data_ptr() if has_grad else 0)
        aligned = aligned and lead == 0 and all(a % 16 == 0 for a in addresses)
        rows.append((*addresses, p.numel(), offset - lead, lead, slot))
        block_counts.append(triton.cdiv(p.numel() + lead, BLOCK) if p.numel() else 0)
        first_slots.append(slot)
        slot += block_counts[-1]
    if slot == 0:
        gap.zero_()
        return
    if global_ball:
        balls, ball_radii = ((0, slot),), (float(radii[0]),)
    else:
        live = [t for t, n in enumerate(block_counts) if n]
        balls = tuple((first_slots[t], block_counts[t]) for t in live)
        ball_radii = tuple(float(radii[t]) for t in live)
    device = params[0].device
    meta, block_tensor, balls_t, radii_t = _tables(device, tuple(rows), tuple(block_counts), balls, ball_radii)
    partial_d = torch.empty(slot, dtype=torch.float64, device=device)
    partial_index = torch.empty(slot, dtype=torch.int64, device=device)
    partial_dot = torch.empty(slot, dtype=torch.float64, device=device)
    # One ball writes its share straight into gap; several write shares that the last kernel sums.
    ball_gap = gap if len(balls) == 1 else torch.empty(len(balls), dtype=torch.float64, device=device)
    key_lo, key_hi = key_words(seed)
    param_dtype = TL_DTYPES[params[0].dtype]
    compute_dtype = TL_DTYPES[reference.compute_dtype(params[0].dtype)]
    # enable_fp_fusion=False: no FMA contraction, so every product and sum rounds as in the reference
    # (it matters for ties in argmax |d| and costs nothing in a memory-bound kernel).
    with device_of(params[0]):
        # With grads, tangent_coeffs is never read and may be an empty tensor on any device: pass a
        # tensor known to be on the params' device in its place.
        _fw_blocks_kernel[(slot,)](
            block_tensor, meta, schedule, schedule if has_grad else tangent_coeffs, partial_d, partial_index,
            partial_dot, key_lo, key_hi, 0 if has_grad else tangent_coeffs.numel(), PARAM_DTYPE=param_dtype,
            GRAD_DTYPE=TL_DTYPES[grads[0].dtype] if has_grad else param_dtype, COMPUTE_DTYPE=compute_dtype,
            HAS_GRAD=has_grad, HAS_MOMENTUM=has_momentum, GAUSSIAN=distribution == reference.GAUSSIAN,
            ALIGNED=aligned, ROWS=ROWS, num_warps=_BLOCK_WARPS, enable_fp_fusion=False)
        _fw_finalize_kernel[(len(balls),)](
            balls_t, radii_t, block_tensor, meta, schedule, partial_d, partial_index, partial_dot, ball_gap,
            PARAM_DTYPE=param_dtype, COMPUTE_DTYPE=compute_dtype, RBLOCK=_RBLOCK, num_warps=4,
            enable_fp_fusion=False)
        if len(balls) > 1:
            _gap_sum_kernel[(1,)](ball_gap, gap, len(balls), RBLOCK=_RBLOCK, num_warps=4)
