"""The fused L1-ball Frank-Wolfe step in Triton: the Triton backend of reference.l1_fw_step_.

Design and the other backends: docs/fused_step.md ("Triton kernels").

A ball is a whole tensor, one row of a tensor (``row_numel``), or every tensor at once (the global
ball). Balls that fit a program ("short": a row, or a small tensor such as a bias, of at most
_MAX_ROW_SEG elements) are stepped and finished by that program; the others ("long": big tensors,
long rows, the global ball) are split into blocks whose partials a second kernel reduces. A step
launches, with no host synchronisation (schedule and coefficients are read by pointer):

1. ``_fw_rows_kernel``, once per size class SEG of the short balls present (a power of two >= the
   ball's length plus its lead, see below; classes keep a ball of 5 from being padded to 1024): each
   program holds BLOCK // SEG consecutive balls of one tensor as the rows of a [BALLS, SEG]
   tile, regenerates the K tangents (or reads the gradient), updates v, takes each row's argmax |d|
   (lowest index on ties, NaN counted largest, as torch.argmax) and each row's norm sums (of theta and of
   theta scaled by keep = RN(1 - alpha), in fixed-point units: feasibility._norm_units), writes the scaled
   theta with the winner set by feasibility._l1_vertex_value (reference.l1_vertex_value) in the same store, and
   writes each ball's share of the gap, sum(d * theta_old) + r |d_i*|, in float64.
2. ``_fw_blocks_kernel``, one program per block of BLOCK elements of a long ball's segment (a whole
   tensor or one long row): the same update without the vertex, writing the block's partials to its
   slot: the signed d of its largest |d|, that index, sum(d * theta_old) in float64 and the two norm sums.
3. ``_fw_finalize_kernel``, one program per long ball: reduces its slots the same way (the norm sums
   stopped at their cap, feasibility._saturating_add), sets the winning element (index read on the device)
   and writes the ball's share.
4. ``_gap_sum_kernel``, only when there are several balls: sums the shares into ``gap`` in ball
   order (fixed, so the gap is deterministic).

The 12 x 1024 MLP with row balls (12,300 balls of 1024) is two launches: rows, gap sum.

A skipped step (a schedule of 4 elements whose skip, schedule[3], is not 0: reference.schedule_values) is read
by every kernel on the device, first thing (SKIPPABLE, a constexpr: the schedule has 4 elements), never on the
host: the blocks kernel returns at once, writing nothing; the rows and finalize kernels write NaN into their
balls' shares of the gap (the gap itself when the step has one ball) and nothing else; the gap sum writes NaN
into the gap without reading the shares. No kernel reads a workspace that a skipped kernel did not write.

Why one launch over a table rather than one launch per tensor or per row: a model has tens to
hundreds of parameter tensors and thousands of rows, and every Triton launch costs microseconds of
Python, more than the whole update of a small tensor. Everything but the addresses is laid out on
the host from metadata only (sizes, row lengths, stream offsets, radii) once, uploaded and cached by
content (``_layout``); the addresses, a few numbers per tensor, are cached separately (``_meta``), so a
step does no per-row or per-ball work on the host beyond hashing the key. One int64 table of rows
of _META_STRIDE holds one address row per tensor (param, momentum, grad), then one row per segment
of the blocks path and one per group (a tensor's run of short balls) of the rows path; the kernels
find their segment or group through a block -> row or program -> row map. Slots are numbered in
(segment, block) order, so "lowest slot" is "lowest (tensor, index)", the global ball's tie rule.

Stream layout: element j of tensor t draws stream index offsets[t] + j, whatever its ball. A tile
row (a block, or a short ball) starts on a Philox call boundary: its elements sit LEAD (= stream
index % 4) positions in, the first LEAD positions masked off. When every address is 16-byte aligned
and every tile row starts on a call boundary (ALIGNED) the kernels state it (tl.multiple_of on the
table addresses, offsets built as multiples of 4), so loads and stores vectorise, and full tiles run
unmasked. The interpreter runs the same tables on CPU tensors, whose raw addresses are valid on the
host.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import reference
from .feasibility import _capped_sum, _l1_vertex_value, _norm_units, _saturating_add, units_factor
from .tangent import (BLOCK, INTERPRET, ROWS, TL_DTYPES, _box_muller, _philox4x32_10, _rademacher,
                      check_distribution, device_of, device_path, key_words, tangent_tile, to_storage)

# The one int64 table (see the module docstring), _META_STRIDE columns per row.
_META_STRIDE = tl.constexpr(8)
# An address row (one per tensor, rows [0, number of tensors)).
_PARAM, _MOMENTUM, _GRAD = (tl.constexpr(c) for c in range(3))
# A segment row (blocks path): a whole tensor, or one long row of a tensor, as a run of blocks.
# TENSOR is the address row; START the segment's first element in the tensor; STREAM_BASE the stream
# index of its first block (a multiple of 4), LEAD the offset of element START past it.
_TENSOR, _START, _NUMEL, _STREAM_BASE, _LEAD, _FIRST_SLOT = (tl.constexpr(c) for c in range(6))
# A group row (rows path): the short balls of one tensor, ROW_NUMEL elements each (the tensor's numel
# for a whole-tensor ball), BALLS of them; STREAM_BASE is the tensor's stream offset; FIRST_PROGRAM
# the group's first program in its launch; FIRST_BALL the index of its first ball in radii and ball_gap.
_ROW_NUMEL, _BALLS, _FIRST_PROGRAM, _FIRST_BALL = (tl.constexpr(c) for c in (1, 2, 4, 5))

# 8 warps: 8 elements per thread, about 64 registers for float32 (126 for float64) on sm_90, so
# several blocks fit on an SM; 4 warps doubled the registers per thread.
_BLOCK_WARPS = 8
# A register ceiling for the step kernels (set_step.py sets the same): without one, ptxas kept the kernels that
# call libdevice (the Gaussian tangent's log, sin and cos) to 64-80 registers and spilled around the calls (Triton
# 3.6 and 3.8 on sm_90, python -m fgfw.triton.aot); 128 still fits two 8-warp programs on an SM.
_MAX_REGISTERS = 128

# Short balls: a ball of n elements whose tile row needs SEG = next power of two >= n + lead (>= 4) is
# stepped by the rows kernel when SEG <= _MAX_ROW_SEG, BLOCK // SEG balls per program: BLOCK elements, 8
# per thread on _BLOCK_WARPS warps as the blocks kernel. Without ALIGNED (unvectorised loads, a lead per
# ball) 8 per thread spilled on sm_90, so those launches take twice the warps (4 elements per thread).
# A program of 4096 (16 or 32 warps) spilled in some variants with Triton 3.6: longer balls take the
# blocks path.
_MAX_ROW_SEG = BLOCK
_MIN_ROW_SEG = 4
_WIDE_ROW_SEG = 256  # see _rows_warps

# Slots reduced per iteration by the finalize and gap kernels.
_RBLOCK = 1024

_INF = tl.constexpr(float("inf"))
_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _nan_f64():
    """NaN as float64 bits. Not a global constexpr: compiled Triton (3.6) compares a kernel's globals with their
    values at compile time before it reuses the kernel, and NaN never equals itself, so every launch after the
    first raised "Global variable ... has changed" (seen on an H200; the interpreter does not check)."""
    return tl.full([], 0x7FF8000000000000, tl.int64).to(tl.float64, bitcast=True)


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
def _step_factors(schedule, COMPUTE_DTYPE: tl.constexpr):
    """reference.step_factors: (keep, alpha) = (RN(1 - alpha), RN(alpha)) in the compute dtype, from alpha in
    float64."""
    alpha = tl.load(schedule + 1)
    return (1.0 - alpha).to(COMPUTE_DTYPE), alpha.to(COMPUTE_DTYPE)


@triton.jit
def _argmax_abs_rows(d, valid, col):
    """_argmax_abs of each row of a [BALLS, SEG] tile: ([BALLS] column of the winner, [BALLS] its d)."""
    magnitude = tl.abs(d)
    is_nan = magnitude != magnitude
    key = tl.where(is_nan, _INF, magnitude)
    if valid is not None:
        is_nan = is_nan & valid
        key = tl.where(valid, key, -1.0)
    top = tl.max(key, axis=1)
    any_nan = tl.max(is_nan.to(tl.int32), axis=1) != 0
    hit = tl.where(any_nan[:, None], is_nan, key == top[:, None])
    best = tl.min(tl.where(hit, col, _NO_INDEX), axis=1)
    return best, tl.sum(tl.where(col == best[:, None], d, 0.0), axis=1)


@triton.jit
def _pick_rows(x, hit, COMPUTE_DTYPE: tl.constexpr):
    """x at the one hit of each row of a [BALLS, SEG] tile, bit for bit (a sum of floats would turn -0 into +0).

    An else, not an early return: Triton 3.6 compiles the statements after a return inside a constexpr if, so the
    float32 line failed on float64 tiles ("Cannot bitcast data-type of size 64 to data-type of size 32")."""
    if COMPUTE_DTYPE == tl.float64:
        return tl.sum(tl.where(hit, x.to(tl.int64, bitcast=True), 0), axis=1).to(tl.float64, bitcast=True)
    else:
        return tl.sum(tl.where(hit, x.to(tl.int32, bitcast=True), 0), axis=1).to(tl.float32, bitcast=True)


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
def _tangent_rows_tile(calls, key_lo, key_hi, step, tangent_id, GAUSSIAN: tl.constexpr, BALLS: tl.constexpr,
                       SEG: tl.constexpr):
    """float32 tangent as a [BALLS, SEG] tile from the [BALLS, SEG // 4] Philox call indices ``calls``
    (int64): position (b, 4 c + w) is word w of call calls[b, c], i.e. stream index 4 calls[b, c] + w.
    As tangent.tangent_tile, row by row."""
    w0, w1, w2, w3 = _philox4x32_10(calls.to(tl.uint32), (calls >> 32).to(tl.uint32), step, tangent_id, key_lo,
                                    key_hi)
    if GAUSSIAN:
        x0, x1 = _box_muller(w0, w1)
        x2, x3 = _box_muller(w2, w3)
    else:
        x0 = _rademacher(w0)
        x1 = _rademacher(w1)
        x2 = _rademacher(w2)
        x3 = _rademacher(w3)
    # [b, c, i, j] holds word 2 i + j (see tangent_tile): row-major, word w of call c lands at 4 c + w.
    return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [BALLS, SEG])


@triton.jit
def _forward_gradient_rows(calls, schedule, tangent_coeffs, key_lo, key_hi, n_tangents,
                           COMPUTE_DTYPE: tl.constexpr, GAUSSIAN: tl.constexpr, BALLS: tl.constexpr,
                           SEG: tl.constexpr):
    """_forward_gradient over a [BALLS, SEG] tile of short balls."""
    step = tl.load(schedule).to(tl.int64).to(tl.uint32)
    g = tl.zeros([BALLS, SEG], dtype=COMPUTE_DTYPE)
    for k in range(n_tangents):
        term = tl.load(tangent_coeffs + k).to(COMPUTE_DTYPE) * _tangent_rows_tile(
            calls, key_lo, key_hi, step, tl.cast(k, tl.uint32), GAUSSIAN, BALLS, SEG).to(COMPUTE_DTYPE)
        g = tl.where(k == 0, term, g + term)
    return g


@triton.jit
def _fw_block(tensor, first_element, slot, start, numel, g, schedule, factor, partial_d, partial_index, partial_dot,
              partial_units, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
              HAS_MOMENTUM: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr, ROWS: tl.constexpr):
    """The step on elements start + [0, 4 ROWS) of a segment whose first element is element
    first_element of the tensor with address row ``tensor``; g is None for the gradient path. ``factor``: the
    ball's units factor (feasibility._norm_units); partial_units holds two sums per slot (old, new)."""
    # Element start + i for i in [0, 4 ROWS): int32 positions on int64 base pointers.
    i = 4 * tl.arange(0, ROWS)[:, None] + tl.arange(0, 4)[None, :]
    if MASKED:
        valid = (i >= (-start).to(tl.int32)) & (i < tl.minimum(numel - start, 4 * ROWS).to(tl.int32))
    else:
        valid = None
    offset = first_element + start
    theta_ptr = _pointer(tl.load(tensor + _PARAM), PARAM_DTYPE, ALIGNED) + offset + i
    theta = tl.load(theta_ptr, mask=valid).to(COMPUTE_DTYPE)
    if g is None:
        g = tl.load(_pointer(tl.load(tensor + _GRAD), GRAD_DTYPE, ALIGNED) + offset + i,
                    mask=valid).to(COMPUTE_DTYPE)
    if HAS_MOMENTUM:
        v_ptr = _pointer(tl.load(tensor + _MOMENTUM), COMPUTE_DTYPE, ALIGNED) + offset + i
        gamma = tl.load(schedule + 2).to(COMPUTE_DTYPE)
        d = (1.0 - gamma) * tl.load(v_ptr, mask=valid) + gamma * g
        tl.store(v_ptr, d, mask=valid)
    else:
        d = g
    keep, _ = _step_factors(schedule, COMPUTE_DTYPE)
    scaled = to_storage(keep * theta, PARAM_DTYPE)
    tl.store(theta_ptr, scaled, mask=valid)
    dot = d.to(tl.float64) * theta.to(tl.float64)
    old_units = _norm_units(theta, factor)
    new_units = _norm_units(scaled, factor)
    if MASKED:
        dot = tl.where(valid, dot, 0.0)
        old_units = tl.where(valid, old_units, 0)
        new_units = tl.where(valid, new_units, 0)
    best, d_best = _argmax_abs(d, valid, i)
    tl.store(partial_d + slot, d_best.to(tl.float64))
    tl.store(partial_index + slot, offset + best)  # the element's index in its tensor
    tl.store(partial_dot + slot, tl.sum(dot))
    tl.store(partial_units + 2 * slot, _capped_sum(old_units, None))
    tl.store(partial_units + 2 * slot + 1, _capped_sum(new_units, None))


@triton.jit(do_not_specialize=["key_lo", "key_hi", "n_tangents"])
def _fw_blocks_kernel(block_tensor, meta, schedule, tangent_coeffs, block_factor, partial_d, partial_index,
                      partial_dot, partial_units, key_lo, key_hi, n_tangents, PARAM_DTYPE: tl.constexpr,
                      GRAD_DTYPE: tl.constexpr,
                      COMPUTE_DTYPE: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
                      GAUSSIAN: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr, SKIPPABLE: tl.constexpr):
    # ``block_tensor`` maps a slot to its segment's row of ``meta``. Block b of a segment covers stream
    # indices STREAM_BASE + [b * 4 ROWS, (b + 1) * 4 ROWS), whole Philox calls; its element j sits LEAD
    # (= stream index of its first element % 4) positions into the stream, so the first block of a
    # segment that does not start on a call boundary starts at j = -LEAD (masked off).
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:  # a skipped step (see the module docstring): nothing written
            return
    slot = tl.program_id(0)
    segment = meta + tl.load(block_tensor + slot).to(tl.int64) * _META_STRIDE
    tensor = meta + tl.load(segment + _TENSOR) * _META_STRIDE
    numel = tl.load(segment + _NUMEL)
    first_element = tl.load(segment + _START)
    first = (slot - tl.load(segment + _FIRST_SLOT)) * (4 * ROWS)
    start = first
    if ALIGNED:
        # A multiple of 4 (ALIGNED's promise), built so that the compiler sees it.
        first_element = (first_element >> 2) * 4
    else:
        start -= tl.load(segment + _LEAD)
    if HAS_GRAD:
        g = None
    else:
        # Generated once, outside the full/tail split below, so the Philox and Box-Muller code is
        # compiled once rather than in both branches.
        g = _forward_gradient(tl.load(segment + _STREAM_BASE) + first, schedule, tangent_coeffs,
                              key_lo.to(tl.uint32, bitcast=True), key_hi.to(tl.uint32, bitcast=True), n_tangents,
                              COMPUTE_DTYPE, GAUSSIAN, ROWS)
    factor = tl.load(block_factor + slot)
    # Full blocks run unmasked: with ALIGNED, their loads and stores vectorise.
    if (start >= 0) & (start + 4 * ROWS <= numel):
        _fw_block(tensor, first_element, slot, start, numel, g, schedule, factor, partial_d, partial_index,
                  partial_dot, partial_units, PARAM_DTYPE, GRAD_DTYPE, COMPUTE_DTYPE, HAS_MOMENTUM, ALIGNED, False,
                  ROWS)
    else:
        _fw_block(tensor, first_element, slot, start, numel, g, schedule, factor, partial_d, partial_index,
                  partial_dot, partial_units, PARAM_DTYPE, GRAD_DTYPE, COMPUTE_DTYPE, HAS_MOMENTUM, ALIGNED, True,
                  ROWS)


@triton.jit
def _fw_row_tile(tensor, first, ball_start, lead, n, live, ball, g, schedule, radii, factors, ball_gap,
                 PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                 HAS_MOMENTUM: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr, SEG: tl.constexpr):
    """The whole step on BALLS short balls, tile row b holding ball ball[b] (index into radii, factors and
    ball_gap): its n elements at tensor positions first + ball_start[b] + [0, n), at columns
    lead[b] + [0, n) (lead is None when ALIGNED: 0); g is None for the gradient path."""
    col = tl.arange(0, SEG)[None, :]
    if ALIGNED:
        position = ball_start[:, None] + col
    else:
        position = (ball_start - lead)[:, None] + col
    if MASKED:
        if ALIGNED:
            valid = live[:, None] & (col < n)
        else:
            # lead <= column < lead + n as one unsigned comparison
            valid = live[:, None] & ((col - lead[:, None]).to(tl.uint32, bitcast=True) < n.to(tl.uint32))
    else:
        valid = None
    theta_ptr = _pointer(tl.load(tensor + _PARAM), PARAM_DTYPE, ALIGNED) + first + position
    theta = tl.load(theta_ptr, mask=valid).to(COMPUTE_DTYPE)
    if g is None:
        g = tl.load(_pointer(tl.load(tensor + _GRAD), GRAD_DTYPE, ALIGNED) + first + position,
                    mask=valid).to(COMPUTE_DTYPE)
    if HAS_MOMENTUM:
        v_ptr = _pointer(tl.load(tensor + _MOMENTUM), COMPUTE_DTYPE, ALIGNED) + first + position
        gamma = tl.load(schedule + 2).to(COMPUTE_DTYPE)
        d = (1.0 - gamma) * tl.load(v_ptr, mask=valid) + gamma * g
        tl.store(v_ptr, d, mask=valid)
    else:
        d = g
    dot = d.to(tl.float64) * theta.to(tl.float64)
    if MASKED:
        dot = tl.where(valid, dot, 0.0)
    best, d_best = _argmax_abs_rows(d, valid, col)
    # theta scaled and rounded to its dtype, then the winner set from that value and the ball's norm sums
    # (reference.l1_vertex_value); held in registers, so theta is stored once.
    keep, _ = _step_factors(schedule, COMPUTE_DTYPE)
    scaled = to_storage(keep * theta, PARAM_DTYPE)
    radius = tl.load(radii + ball, mask=live, other=1.0)
    factor = tl.load(factors + ball, mask=live, other=1.0)
    old_units = _norm_units(theta, factor[:, None])
    new_units = _norm_units(scaled, factor[:, None])
    if MASKED:
        old_units = tl.where(valid, old_units, 0)
        new_units = tl.where(valid, new_units, 0)
    winner = col == best[:, None]
    x = _pick_rows(scaled.to(COMPUTE_DTYPE), winner, COMPUTE_DTYPE)
    moved = _l1_vertex_value(x, d_best, tl.load(schedule + 1), radius, 1.0 / factor, n.to(tl.int64),
                             _capped_sum(old_units, 1), _capped_sum(new_units, 1), COMPUTE_DTYPE)
    tl.store(theta_ptr, tl.where(winner, to_storage(moved, PARAM_DTYPE)[:, None], scaled), mask=valid)
    tl.store(ball_gap + ball, tl.sum(dot, axis=1) + tl.abs(d_best.to(tl.float64)) * radius, mask=live)


@triton.jit(do_not_specialize=["key_lo", "key_hi", "n_tangents"])
def _fw_rows_kernel(program_group, meta, schedule, tangent_coeffs, radii, factors, ball_gap, key_lo, key_hi,
                    n_tangents,
                    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                    HAS_GRAD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, GAUSSIAN: tl.constexpr,
                    ALIGNED: tl.constexpr, BALLS: tl.constexpr, SEG: tl.constexpr, SKIPPABLE: tl.constexpr):
    # ``program_group`` maps a program to its group's row of ``meta``. Program p of a group holds its
    # balls (p - FIRST_PROGRAM) * BALLS + [0, BALLS), those past the group's BALLS masked off. Ball b
    # (n elements from element b n) starts at stream index STREAM_BASE + b n, LEAD = that % 4
    # positions into its tile row, which begins on the Philox call boundary before it.
    # With ALIGNED, n and STREAM_BASE are multiples of 4 (LEAD = 0): offsets are built as multiples of 4
    # so that the compiler sees it and vectorises.
    program = tl.program_id(0)
    group = meta + tl.load(program_group + program).to(tl.int64) * _META_STRIDE
    tensor = meta + tl.load(group + _TENSOR) * _META_STRIDE
    n_balls = tl.load(group + _BALLS)
    first_row = (program - tl.load(group + _FIRST_PROGRAM)) * BALLS
    row = tl.arange(0, BALLS)
    live = first_row + row < n_balls
    ball = tl.load(group + _FIRST_BALL) + first_row + row
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:  # a skipped step: NaN shares of the gap (the gap itself for one ball)
            tl.store(ball_gap + ball, _nan_f64() + tl.zeros([BALLS], dtype=tl.float64), mask=live)
            return
    if ALIGNED:
        n4 = tl.load(group + _ROW_NUMEL) >> 2
        first = first_row * n4 * 4  # the program's first element in the tensor
        ball_start = row * n4.to(tl.int32) * 4  # each ball's first element past ``first``
        n = n4.to(tl.int32) * 4
        lead = None
    else:
        n64 = tl.load(group + _ROW_NUMEL)
        first = first_row * n64
        n = n64.to(tl.int32)
        ball_start = row * n
        lead = tl.zeros([BALLS], dtype=tl.int32)
    if HAS_GRAD:
        g = None
    else:
        stream = tl.load(group + _STREAM_BASE) + first
        if ALIGNED:
            tile_start = stream + ball_start
        else:
            lead = ((stream + ball_start) & 3).to(tl.int32)
            tile_start = stream + (ball_start - lead)
        # Each tile row's Philox calls, from the call that holds its ball's first element.
        calls = (tile_start >> 2)[:, None] + tl.arange(0, SEG // 4)[None, :]
        # Once, outside the full/partial split below, as in _fw_blocks_kernel.
        g = _forward_gradient_rows(calls, schedule, tangent_coeffs, key_lo.to(tl.uint32, bitcast=True),
                                   key_hi.to(tl.uint32, bitcast=True), n_tangents, COMPUTE_DTYPE, GAUSSIAN, BALLS,
                                   SEG)
    if ALIGNED:
        # Every ball filling its tile row: unmasked, vectorised loads and stores.
        if (n == SEG) & (first_row + BALLS <= n_balls):
            _fw_row_tile(tensor, first, ball_start, lead, n, live, ball, g, schedule, radii, factors, ball_gap,
                         PARAM_DTYPE, GRAD_DTYPE, COMPUTE_DTYPE, HAS_MOMENTUM, ALIGNED, False, SEG)
        else:
            _fw_row_tile(tensor, first, ball_start, lead, n, live, ball, g, schedule, radii, factors, ball_gap,
                         PARAM_DTYPE, GRAD_DTYPE, COMPUTE_DTYPE, HAS_MOMENTUM, ALIGNED, True, SEG)
    else:
        _fw_row_tile(tensor, first, ball_start, lead, n, live, ball, g, schedule, radii, factors, ball_gap,
                     PARAM_DTYPE, GRAD_DTYPE, COMPUTE_DTYPE, HAS_MOMENTUM, ALIGNED, True, SEG)


@triton.jit
def _fw_finalize_kernel(balls, ball_radii, factors, block_tensor, meta, schedule, partial_d, partial_index,
                        partial_dot, partial_units, ball_gap, PARAM_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                        RBLOCK: tl.constexpr, SKIPPABLE: tl.constexpr):
    # balls: per long ball (first slot, number of slots, ball index in ball_radii and ball_gap, elements).
    program = tl.program_id(0)
    ball = tl.load(balls + 4 * program + 2)
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:  # a skipped step: a NaN share, no partial read (none was written)
            tl.store(ball_gap + ball, _nan_f64())
            return
    first = tl.load(balls + 4 * program)
    end = first + tl.load(balls + 4 * program + 1)
    numel = tl.load(balls + 4 * program + 3)
    dot = tl.zeros([RBLOCK], dtype=tl.float64)
    old_units = tl.zeros([], dtype=tl.int64)
    new_units = tl.zeros([], dtype=tl.int64)
    # If every |d| is 0 the first slot wins, which is also what the first chunk's argmax returns.
    best = first
    best_d = tl.zeros([], dtype=tl.float64)
    for chunk in range(first, end, RBLOCK):
        i = tl.arange(0, RBLOCK)
        valid = i < end - chunk
        dot += tl.load(partial_dot + chunk + i, mask=valid, other=0.0)
        # the slots' norm sums, each at most the cap: added stopping at the cap (order-free)
        old_units = _saturating_add(old_units, tl.reduce(
            tl.load(partial_units + 2 * (chunk + i), mask=valid, other=0), 0, _saturating_add))
        new_units = _saturating_add(new_units, tl.reduce(
            tl.load(partial_units + 2 * (chunk + i) + 1, mask=valid, other=0), 0, _saturating_add))
        slot, d = _argmax_abs(tl.load(partial_d + chunk + i, mask=valid, other=0.0), valid, i)
        # Chunks come in slot order, so a later one wins only by being strictly larger (NaN largest).
        best_is_nan = best_d != best_d
        take = ((d != d) & ~best_is_nan) | (~best_is_nan & (tl.abs(d) > tl.abs(best_d)))
        best = tl.where(take, chunk + slot, best)
        best_d = tl.where(take, d, best_d)
    index = tl.load(partial_index + best)
    segment = meta + tl.load(block_tensor + best).to(tl.int64) * _META_STRIDE
    theta_ptr = tl.load(meta + tl.load(segment + _TENSOR) * _META_STRIDE + _PARAM).to(
        tl.pointer_type(PARAM_DTYPE), bitcast=True) + index
    radius = tl.load(ball_radii + ball)
    moved = _l1_vertex_value(tl.load(theta_ptr).to(COMPUTE_DTYPE), best_d.to(COMPUTE_DTYPE), tl.load(schedule + 1),
                             radius, 1.0 / tl.load(factors + ball), numel, old_units, new_units, COMPUTE_DTYPE)
    tl.store(theta_ptr, to_storage(moved, PARAM_DTYPE))
    tl.store(ball_gap + ball, tl.sum(dot) + tl.abs(best_d) * radius)


@triton.jit(do_not_specialize=["n_balls"])
def _gap_sum_kernel(ball_gap, gap, n_balls, schedule, RBLOCK: tl.constexpr, SKIPPABLE: tl.constexpr):
    """gap = the sum of the n_balls shares in ball_gap, in order; NaN on a skipped step (the shares unread)."""
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:
            tl.store(gap, _nan_f64())
            return
    total = tl.zeros([RBLOCK], dtype=tl.float64)
    for chunk in range(0, n_balls, RBLOCK):
        i = chunk + tl.arange(0, RBLOCK)
        total += tl.load(ball_gap + i, mask=i < n_balls, other=0.0)
    tl.store(gap, tl.sum(total))


@dataclasses.dataclass(frozen=True, eq=False)
class _RowLaunch:
    """One launch of _fw_rows_kernel: the short balls of one size class."""
    seg: int
    balls: int  # balls per program
    programs: int
    program_group: torch.Tensor  # int32, program -> group row of the table
    aligned: bool  # every ball starts on a Philox call boundary at a multiple of 4 elements


@dataclasses.dataclass(frozen=True, eq=False)
class _Layout:
    """Everything about a step that does not depend on addresses, on the device (see _layout)."""
    n_tensors: int
    n_balls: int  # balls with elements: one share of the gap each
    rows: torch.Tensor  # int64, the segment and group rows of the table (they follow the address rows)
    radii: torch.Tensor  # float64, one per ball with elements, in ball order
    factors: torch.Tensor  # float64, each such ball's units factor 2^(51 - E) (feasibility._norm_units)
    slots: int  # blocks of the blocks path
    block_tensor: torch.Tensor  # int32, slot -> segment row of the table
    block_factor: torch.Tensor  # float64, slot -> its ball's units factor
    blocks_aligned: bool  # every segment starts on a Philox call boundary at a multiple of 4 elements
    long_balls: torch.Tensor  # int64, per long ball (first slot, slots, ball index, elements)
    n_long_balls: int
    row_launches: tuple


def _rows_warps(seg: int, aligned: bool, compute_dtype) -> int:
    """Warps of a _fw_rows_kernel launch: 8 elements per thread (_BLOCK_WARPS), or 4 where 8 needed more than
    128 registers or spilled on sm_90 (python -m fgfw.triton.aot, Triton 3.6 and 3.8): unaligned tiles, float64,
    and tiles of fewer than 8 balls (SEG >= _WIDE_ROW_SEG)."""
    if not aligned or compute_dtype == tl.float64 or seg >= _WIDE_ROW_SEG:
        return 2 * _BLOCK_WARPS
    return _BLOCK_WARPS


def _row_seg(need: int) -> int:
    return max(_MIN_ROW_SEG, 1 << (need - 1).bit_length())


@dataclasses.dataclass(frozen=True, eq=False)
class _Radii:
    """A set of radii as a cache key that hashes by identity (see _radii_token)."""
    values: tuple


_RECENT_RADII = []  # [(list of radii, _Radii)], most recent first
_RECENT_RADII_MAX = 8


def _radii_token(radii: Sequence[float]) -> _Radii:
    """The one token for radii of this content among the recent ones. Hashing a tuple of 12,300 radii
    (the 12 x 1024 MLP) costs more host time than the step's kernels take on a GPU; comparing with the
    last list costs a few microseconds when the caller passes the same float objects again (the list
    comparison skips identical objects), and a plain comparison when not."""
    radii = radii if isinstance(radii, list) else list(radii)
    for i, (values, token) in enumerate(_RECENT_RADII):
        if values == radii:
            if i:
                _RECENT_RADII.insert(0, _RECENT_RADII.pop(i))
            return token
    token = _Radii(tuple(radii))
    _RECENT_RADII.insert(0, (list(radii), token))
    del _RECENT_RADII[_RECENT_RADII_MAX:]
    return token


# Device tables that a CUDA graph captured: the graph replays their addresses, so they must survive the
# caches' eviction (64 layouts); held for the life of the process, since a graph gives no sign when it is
# freed. Only captures add to it: eager steps never do.
_HELD_BY_GRAPHS: dict[int, object] = {}


def hold_while_capturing(*tables) -> None:
    """Keeps ``tables`` alive for good when the current stream is capturing a CUDA graph."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        for table in tables:
            _HELD_BY_GRAPHS[id(table)] = table


@functools.lru_cache(maxsize=64)
def _layout(device: torch.device, numels: tuple, row_numel: tuple, streams: tuple, radii_token: _Radii,
            global_ball: bool, has_grad: bool) -> _Layout:
    """Lays out the balls of a step and uploads the tables; cached by content, so this (the only
    per-row and per-ball host work) runs once per layout. ``streams``: the tensors' stream offsets (0s
    for the gradient path, which reads no stream); the arguments are already checked, but for the
    radii's values, checked here so that a step repeats no per-ball work."""
    radii = radii_token.values
    for r, radius in enumerate(radii):
        if not math.isfinite(radius) or radius <= 0:  # as the C++ kernels: every backend rejects the same inputs
            raise ValueError(f"radii[{r}] must be a finite radius > 0, got {radius}")
    n_tensors = len(numels)
    rows = []  # table rows past the address rows, _META_STRIDE values each
    block_runs = []  # (segment row, blocks)
    long_balls = []
    live_radii = []
    groups = {}  # seg -> [(group row, programs)]
    aligned_classes = {}  # seg -> aligned
    blocks_aligned = True
    slots = 0
    class_programs = {}  # seg -> programs so far

    block_factors = []  # (units factor, blocks)

    def add_segment(t: int, start: int, numel: int, radius: float) -> tuple[int, int]:
        """A run of blocks over elements [start, start + numel) of tensor t, in a ball of that radius; returns
        (first slot, blocks)."""
        nonlocal blocks_aligned, slots
        stream = 0 if has_grad else streams[t] + start
        lead = stream % 4
        blocks = triton.cdiv(numel + lead, BLOCK)
        first_slot = slots
        slots += blocks
        blocks_aligned = blocks_aligned and lead == 0 and start % 4 == 0
        block_runs.append((n_tensors + len(rows), blocks))
        block_factors.append((units_factor(radius), blocks))
        rows.append((t, start, numel, stream - lead, lead, first_slot, 0, 0))
        return first_slot, blocks

    radius_at = 0
    for t, numel in enumerate(numels):
        n = row_numel[t] or numel
        n_balls = numel // n if row_numel[t] else 1
        tensor_radii = radii[radius_at:radius_at + n_balls]
        radius_at += n_balls
        if global_ball:
            if numel:
                add_segment(t, 0, numel, radii[0])
            continue
        if numel == 0:
            continue  # an empty ball: no element, nothing moves, no share of the gap
        # The largest lead of a ball (stream index of its first element % 4), periodic in 4 balls.
        lead = 0 if has_grad else max((streams[t] + b * n) % 4 for b in range(min(n_balls, 4)))
        seg = _row_seg(n + lead)
        if seg > _MAX_ROW_SEG:
            for b in range(n_balls):
                first_slot, blocks = add_segment(t, b * n, n, tensor_radii[b])
                long_balls.append((first_slot, blocks, len(live_radii), n))
                live_radii.append(tensor_radii[b])
            continue
        programs = triton.cdiv(n_balls, BLOCK // seg)
        first_program = class_programs.get(seg, 0)
        class_programs[seg] = first_program + programs
        groups.setdefault(seg, []).append((n_tensors + len(rows), programs))
        rows.append((t, n, n_balls, 0 if has_grad else streams[t], first_program, len(live_radii), 0, 0))
        live_radii.extend(tensor_radii)
        aligned_classes[seg] = aligned_classes.get(seg, True) and n % 4 == 0 and (has_grad or streams[t] % 4 == 0)
    if global_ball and block_runs:
        long_balls.append((0, slots, 0, sum(numels)))
        live_radii.append(radii[0])

    def upload(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    def runs(pairs):
        """int32 map: each (row, count) as count copies of row."""
        pairs = [(r, c) for r, c in pairs if c]
        if not pairs:
            return torch.empty(0, dtype=torch.int32, device=device)
        values, counts = zip(*pairs)
        return torch.repeat_interleave(torch.tensor(values, dtype=torch.int32),
                                       torch.tensor(counts, dtype=torch.int64)).to(device, non_blocking=True)

    row_launches = []
    for seg in sorted(groups):
        program_group = runs(groups[seg])
        row_launches.append(_RowLaunch(seg=seg, balls=BLOCK // seg, programs=program_group.numel(),
                                       program_group=program_group, aligned=aligned_classes[seg]))
    block_factor = [factor for factor, blocks in block_factors for _ in range(blocks)]
    return _Layout(n_tensors=n_tensors, n_balls=len(live_radii), rows=upload(rows, torch.int64).view(-1),
                   radii=upload(live_radii, torch.float64), factors=upload([units_factor(r) for r in live_radii],
                                                                            torch.float64),
                   slots=slots, block_tensor=runs(block_runs), block_factor=upload(block_factor, torch.float64),
                   blocks_aligned=blocks_aligned,
                   long_balls=upload(long_balls, torch.int64).view(-1), n_long_balls=len(long_balls),
                   row_launches=tuple(row_launches))


@functools.lru_cache(maxsize=64)
def _meta(layout: _Layout, addresses: tuple) -> torch.Tensor:
    """The table: one address row per tensor (param, momentum, grad; 0 where absent), then the layout's
    rows; cached by the addresses, so a step on the same tensors uploads nothing."""
    host = torch.zeros(layout.n_tensors, _META_STRIDE, dtype=torch.int64)
    host[:, :3] = torch.tensor(addresses, dtype=torch.int64).view(-1, 3)
    return torch.cat((host.view(-1).to(layout.rows.device, non_blocking=True), layout.rows))


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
                gap, row_numel) -> None:
    """Checks everything but the radii's values (see _layout); ``row_numel`` has one entry per param."""
    check_distribution(distribution)
    if gap.dtype != torch.float64 or gap.numel() != 1:
        raise ValueError(f"gap must be a float64 tensor with one element, got {gap.dtype} of shape {tuple(gap.shape)}")
    # row_numel and the number of radii as the C++ checks (csrc/op_args.cpp) and reference.ball_layout
    balls = 0
    for t, (p, n) in enumerate(zip(params, row_numel)):
        if n < 0 or (n > 0 and p.numel() % n):
            raise ValueError(f"row_numel[{t}] must be 0 (one ball) or a row length that divides the {p.numel()} "
                             f"elements of params[{t}], got {n}")
        if global_ball and n:
            raise ValueError("row_numel must be all 0 for the global ball (one ball over every tensor)")
        balls += p.numel() // n if n else 1
    if global_ball and len(radii) != 1:
        raise ValueError(f"radii must hold one radius when global_ball is true, got {len(radii)}")
    if not global_ball and len(radii) != balls:
        raise ValueError(f"radii must hold one radius per ball ({balls}, "
                         f"{'one per row of each tensor with a row_numel' if any(row_numel) else 'one per parameter'})"
                         f", got {len(radii)}")
    check_schedule(schedule, params[0].device if params else None)
    if not params:
        return
    device, dtype = params[0].device, params[0].dtype
    if dtype not in TL_DTYPES:
        raise TypeError(f"params must be float32, float64, bfloat16 or float16, got {dtype}")
    check_params_where_triton_runs(params)
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
    if gap.device != device:
        raise ValueError(f"gap must be on {device}, got {gap.device}")
    if not grads and (len(offsets) != len(params) or min(offsets) < 0):
        # as the reference: tensors sharing an offset would share tangent values, a biased estimate
        raise ValueError(f"offsets must give each of the {len(params)} params its non-negative stream offset for "
                         f"the forward gradient, got {list(offsets)}")


def check_params_where_triton_runs(params: Sequence[torch.Tensor]) -> None:
    """Non-empty ``params`` on a device the Triton kernels run on (CUDA, or the CPU in the interpreter), all
    contiguous and of params[0]'s dtype and device (one call per device and dtype group), as ValueError."""
    device, dtype = params[0].device, params[0].dtype
    if not device_path(params[0]) and not INTERPRET:
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


def check_schedule(schedule: torch.Tensor, device: torch.device | None) -> None:
    """A step's schedule: a contiguous float64 tensor (step, alpha, gamma) or (step, alpha, gamma, skip)
    (reference.schedule_values), on ``device`` (any device when None: a step without params)."""
    if (schedule.dtype != torch.float64 or schedule.numel() not in (3, 4) or not schedule.is_contiguous()
            or (device is not None and schedule.device != device)):
        raise ValueError(f"schedule must be a contiguous float64 tensor (step, alpha, gamma) or (step, alpha, gamma, "
                         f"skip){'' if device is None else f' on {device}'}, got {schedule.dtype} with "
                         f"{schedule.numel()} elements on {schedule.device} (contiguous={schedule.is_contiguous()})")


def skippable(schedule: torch.Tensor) -> bool:
    """Whether a step's kernels read a skip (schedule[3]) on the device: the schedule has 4 elements."""
    return schedule.numel() == 4


def empty_gap_(gap: torch.Tensor, schedule: torch.Tensor) -> None:
    """The gap of a step with no element: 0, or NaN when the schedule's skip is not 0 (reference.schedule_values),
    decided on the device (torch ops, no host read)."""
    if skippable(schedule):
        skip = schedule[3]
        gap.copy_(torch.where(skip != 0, torch.full_like(skip, math.nan), torch.zeros_like(skip)))
    else:
        gap.zero_()


def _checked_row_numel(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, distribution,
                       gap, row_numel) -> tuple:
    """Every argument check of a step (_check_args), and row_numel as a tuple of one row length per tensor."""
    if row_numel and len(row_numel) != len(params):
        raise ValueError(f"row_numel must be empty or hold one row length per parameter ({len(params)}), "
                         f"got {len(row_numel)}")
    row_numel = tuple(int(n) for n in row_numel) if row_numel else (0,) * len(params)
    _check_args(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, distribution, gap,
                row_numel)
    return row_numel


def l1_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: Sequence[float], global_ball: bool,
                offsets: Sequence[int], seed: int, distribution: int, gap: torch.Tensor,
                row_numel: Sequence[int] = ()) -> None:
    """One Frank-Wolfe step over the L1 ball(s), in place; same contract as reference.l1_fw_step_.

    All params share one device and dtype (the optimizer calls once per group) and are contiguous;
    momentum has the compute dtype (float64 for float64 params, else float32); grads share one dtype.
    ``schedule``: (step, alpha, gamma), or (step, alpha, gamma, skip), whose skip the kernels read on the device:
    not 0, the step writes nothing but NaN into ``gap``.
    The first call for a set of tensors and balls uploads their tables (host-to-device copies, so warm
    up before capturing a CUDA graph); later calls only launch kernels.
    """
    row_numel = _checked_row_numel(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                                   distribution, gap, row_numel)
    if not params:
        empty_gap_(gap, schedule)
        return
    has_grad, has_momentum = bool(grads), bool(momentum)
    device = params[0].device
    # The gradient path reads no stream (offsets are ignored): its tiles start at their first element.
    layout = _layout(device, tuple(p.numel() for p in params), row_numel,
                     (0,) * len(params) if has_grad else tuple(int(o) for o in offsets), _radii_token(radii),
                     bool(global_ball), has_grad)
    if layout.n_balls == 0:
        empty_gap_(gap, schedule)
        return
    addresses = tuple(a for t, p in enumerate(params) for a in (
        p.data_ptr(), momentum[t].data_ptr() if has_momentum else 0, grads[t].data_ptr() if has_grad else 0))
    meta = _meta(layout, addresses)
    hold_while_capturing(layout, meta)
    aligned = all(a % 16 == 0 for a in addresses)
    # One ball writes its share straight into gap; several write shares that the last kernel sums.
    ball_gap = gap if layout.n_balls == 1 else torch.empty(layout.n_balls, dtype=torch.float64, device=device)
    key_lo, key_hi = key_words(seed)
    param_dtype = TL_DTYPES[params[0].dtype]
    compute_dtype = TL_DTYPES[reference.compute_dtype(params[0].dtype)]
    kernel_args = dict(
        PARAM_DTYPE=param_dtype, GRAD_DTYPE=TL_DTYPES[grads[0].dtype] if has_grad else param_dtype,
        COMPUTE_DTYPE=compute_dtype, HAS_GRAD=has_grad, HAS_MOMENTUM=has_momentum,
        GAUSSIAN=distribution == reference.GAUSSIAN, SKIPPABLE=skippable(schedule),
        # enable_fp_fusion=False: no FMA contraction, so every product and sum rounds as in the reference
        # (it matters for ties in argmax |d| and costs nothing in a memory-bound kernel).
        enable_fp_fusion=False, maxnreg=_MAX_REGISTERS)
    # With grads, tangent_coeffs is never read and may be an empty tensor on any device: pass a tensor
    # known to be on the params' device in its place.
    coeffs, n_tangents = (schedule, 0) if has_grad else (tangent_coeffs, tangent_coeffs.numel())
    with device_of(params[0]):
        for launch in layout.row_launches:
            rows_aligned = aligned and launch.aligned
            _fw_rows_kernel[(launch.programs,)](
                launch.program_group, meta, schedule, coeffs, layout.radii, layout.factors, ball_gap, key_lo, key_hi,
                n_tangents,
                ALIGNED=rows_aligned, BALLS=launch.balls, SEG=launch.seg,
                num_warps=_rows_warps(launch.seg, rows_aligned, compute_dtype), **kernel_args)
        if layout.slots:
            partial_d = torch.empty(layout.slots, dtype=torch.float64, device=device)
            partial_index = torch.empty(layout.slots, dtype=torch.int64, device=device)
            partial_dot = torch.empty(layout.slots, dtype=torch.float64, device=device)
            partial_units = torch.empty(2 * layout.slots, dtype=torch.int64, device=device)
            # float64 on 8 warps spilled at the register ceiling with Triton 3.6 (python -m fgfw.triton.aot)
            _fw_blocks_kernel[(layout.slots,)](
                layout.block_tensor, meta, schedule, coeffs, layout.block_factor, partial_d, partial_index,
                partial_dot, partial_units, key_lo, key_hi, n_tangents, ALIGNED=aligned and layout.blocks_aligned,
                ROWS=ROWS, num_warps=2 * _BLOCK_WARPS if compute_dtype == tl.float64 else _BLOCK_WARPS,
                **kernel_args)
            # 8 warps: on 4 (8 slots a thread) Triton 3.6 spilled at the register ceiling
            _fw_finalize_kernel[(layout.n_long_balls,)](
                layout.long_balls, layout.radii, layout.factors, layout.block_tensor, meta, schedule, partial_d,
                partial_index, partial_dot, partial_units, ball_gap, PARAM_DTYPE=param_dtype,
                COMPUTE_DTYPE=compute_dtype, RBLOCK=_RBLOCK, SKIPPABLE=skippable(schedule), num_warps=8,
                enable_fp_fusion=False, maxnreg=_MAX_REGISTERS)
        if layout.n_balls > 1:
            _gap_sum_kernel[(1,)](ball_gap, gap, layout.n_balls, schedule, RBLOCK=_RBLOCK,
                                  SKIPPABLE=skippable(schedule), num_warps=4)
