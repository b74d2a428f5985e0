"""What the Triton steps over L-infinity balls, Lp balls and k-sparse polytopes share (linf_fw_step.py, lp_fw_step.py,
ksparse_fw_step.py: the Triton backend of reference.linf_fw_step_, reference.lp_fw_step_ and
reference.ksparse_fw_step_): the tiles and their plan, the reduction, update and norm feedback passes of every set,
and the step that launches them, each op giving what it computes between the passes (the Lp norms, the k-sparse
selection).

Design: docs/set_steps.md ("Triton kernels"). The steps share the L1 step's arguments, directions,
momentum, balls, radii and update (l1_fw_step.py, reference.fw_step_); they differ in the vertex s of a ball:

* L-infinity: s = -r sign(d), elementwise. One pass: ``_set_update_kernel``.
* Lp, 1 < p < inf: s_i = -r sign(d_i) (x_i / ||x||_q)^(q-1) with x = |d| / max|d| (reference.lp_vertex).
  A reduction pass (``_set_reduce_kernel``) writes each tile row's max|d| m and sum (|d| / m)^q;
  ``_lp_finalize_kernel`` (lp_fw_step.py) combines a ball's rows as M = max m and S = sum S_row (m / M)^q (no x^q can
  overflow: every ratio is <= 1) and writes M and ||x||_q = S^(1/q); the update pass reads them.
* k-sparse: s = -r sign(d) on the k largest |d| of a ball (ties: lowest index; NaN largest), 0 elsewhere.
  The reduction pass writes every element's key, the bits of |d| in the compute dtype (the order of |d|,
  every NaN above +inf, as reference.magnitude_order). Torch ops on that workspace find each ball's k-th
  largest key T and the position of the last tie with T that is taken (``_select``, ksparse_fw_step.py); the update pass
  takes an element when its key is above T, or equal to T at a position up to that one.

Tiles. Each pass launches once per tensor (simpler than l1_fw_step.py's one launch over a table of all
tensors, at the price of a launch per tensor). A tensor is n_balls balls of n elements (its rows, the
whole tensor, or its part of the global ball); a [BALLS, SEG] tile holds chunk c of BALLS consecutive
balls, one per tile row (SEG = a power of two >= n + lead when that fits BLOCK, so short rows share a
program; otherwise SEG = BLOCK, one ball per tile and several chunks). A tile row starts on a Philox call
boundary: ball element e sits at column e + lead - c SEG, lead = the stream index of the ball's first
element % 4 (0 with gradients), so the forward gradient is l1_fw_step.py's [BALLS, SEG] tile of whole calls.
Each (ball, chunk) owns one partial slot: the Lp partials and the share of the gap, summed at the end
in slot order (tensor, ball, chunk), so every result is deterministic.

Everything about the tiles is laid out on the host from metadata only (sizes, row lengths, stream
offsets, radii) and cached (``_plan``); a step allocates its workspaces, launches, and never reads
device data on the host.

A skipped step (a schedule of 4 elements whose skip, schedule[3], is not 0: reference.schedule_values) is read
by every kernel on the device, first thing (SKIPPABLE: the schedule has 4 elements), as in l1_fw_step.py: the
reduction, Lp finalize, update and feedback passes return at once, writing nothing (no momentum, parameter,
workspace or scale), and the gap sum writes NaN into the gap without reading the shares. The k-sparse selection
between the passes (torch ops) still runs, on a key workspace the skipped reduction did not write; what it
writes only the skipped update pass would read.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from .. import reference
from .feasibility import (_INF, _SUM_CAP, _capped_sum, _dense_update, _next_norm_scale, _norm_units, _saturating_add,
                          _toward_zero, units_factor)
from .l1_fw_step import (_checked_row_numel, _forward_gradient_rows, _gap_sum_kernel, _nan_f64, _Radii,
                         _radii_token, _step_factors, empty_gap_, hold_while_capturing, skippable)
from .tangent import BLOCK, TL_DTYPES, device_of, key_words, to_storage

# The step's set (KIND): plain ints on the host, constexprs in the kernels.
LINF, LP, KSPARSE = 0, 1, 2
_LINF, _LP = tl.constexpr(LINF), tl.constexpr(LP)


_MIN_SEG = 4
# Elements per thread: 8 as the L1 step's (a tile of BLOCK on 8 warps), but 4 for the Lp kernels, whose
# float64 divisions (the reference's x = |d| / max|d|, then x / ||x||_q; exact, since q - 1 amplifies an
# ulp of the ratio) each carry a slow path that ptxas calls as a subroutine.
_ELEMENTS_PER_THREAD = {LINF: 8, LP: 4, KSPARSE: 8}
# A register ceiling for every launch: without one, ptxas kept kernels with such calls (these, and sqrt_rn's
# in the Gaussian tangent) to 48-80 registers on sm_90 and spilled around the calls; with it they use at
# most 93 and spill nothing (tests/test_triton_sets.py, Triton 3.6 and 3.8).
_MAX_REGISTERS = 128
# Partial slots reduced per step by the gap sum and the feedback (the Lp finalize's: lp_fw_step._FINALIZE_BLOCK).
_RBLOCK = 1024


@triton.jit
def _pow(x, EXPONENT: tl.constexpr):
    """x^EXPONENT for float64 x >= 0 (EXPONENT > 0): correctly rounded for 1, 2 and 1/2 (p = 2), else
    exp(EXPONENT log x).

    Triton's interpreter has no libdevice pow. exp(y log x) is off by about y |log x| ulps: for x in [0, 1]
    that is large only where x^y is tiny (the absolute error is below x^y y |log x| eps <= eps / e), and
    for the norm S^(1/q), S in [1, n], it is log(n) / q ulps at most.
    """
    if EXPONENT == 1.0:
        return x
    elif EXPONENT == 2.0:
        return x * x
    elif EXPONENT == 0.5:
        return tl.sqrt(x)  # float64: correctly rounded (sqrt.rn.f64; only float32 has an approximate sqrt)
    else:
        # tl.full: the constant in float64 itself (a float constexpr would be rounded to float32)
        y = tl.full([], EXPONENT, tl.float64)
        return tl.where(x == 0, 0.0, tl.exp(y * tl.log(tl.where(x == 0, 1.0, x))))


@triton.jit
def _magnitude_key(d, COMPUTE_DTYPE: tl.constexpr):
    """The bits of |d| as an integer (reference.magnitude_order): the order of |d|, with every NaN above +inf."""
    if COMPUTE_DTYPE == tl.float64:
        return d.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
    else:
        return d.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _ball_tile(n_balls, n, stream_base, chunks, NO_LEAD: tl.constexpr, BALLS: tl.constexpr, SEG: tl.constexpr):
    """This program's tile: (ball [BALLS], live [BALLS], chunk, e [BALLS, SEG] the element within the ball,
    valid [BALLS, SEG], position [BALLS, SEG] the element within the tensor, calls [BALLS, SEG // 4] the
    Philox calls of each tile row)."""
    program = tl.program_id(0)
    chunk = program % chunks
    ball = (program // chunks) * BALLS + tl.arange(0, BALLS)
    live = ball < n_balls
    first = ball.to(tl.int64) * n  # each ball's first element in the tensor
    column = chunk * SEG + tl.arange(0, SEG)[None, :]
    if NO_LEAD:
        lead = tl.zeros([BALLS], dtype=tl.int32)
    else:
        lead = ((stream_base + first) & 3).to(tl.int32)
    e = column - lead[:, None]
    valid = live[:, None] & (e >= 0) & (e < n)
    position = first[:, None] + e
    tile_start = stream_base + first - lead + chunk * SEG  # a multiple of 4
    calls = (tile_start >> 2)[:, None] + tl.arange(0, SEG // 4)[None, :]
    return ball, live, chunk, e, valid, position, calls


@triton.jit
def _direction(momentum, grad, position, valid, calls, schedule, tangent_coeffs, key_lo, key_hi, n_tangents,
               COMPUTE_DTYPE: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
               UPDATE_MOMENTUM: tl.constexpr, GAUSSIAN: tl.constexpr, BALLS: tl.constexpr, SEG: tl.constexpr):
    """d over the tile: the gradient or the forward gradient g, or with momentum v = (1 - gamma) v + gamma g
    (stored when UPDATE_MOMENTUM; otherwise v was updated by an earlier pass of this step and is read)."""
    if HAS_MOMENTUM and not UPDATE_MOMENTUM:
        d = tl.load(momentum + position, mask=valid)
    else:
        if HAS_GRAD:
            g = tl.load(grad + position, mask=valid).to(COMPUTE_DTYPE)
        else:
            g = _forward_gradient_rows(calls, schedule, tangent_coeffs, key_lo.to(tl.uint32, bitcast=True),
                                       key_hi.to(tl.uint32, bitcast=True), n_tangents, COMPUTE_DTYPE, GAUSSIAN, BALLS,
                                       SEG)
        if HAS_MOMENTUM:
            gamma = tl.load(schedule + 2).to(COMPUTE_DTYPE)
            d = (1.0 - gamma) * tl.load(momentum + position, mask=valid) + gamma * g
            tl.store(momentum + position, d, mask=valid)
        else:
            d = g
    return d


# Every integer but the row length n is bookkeeping (counts, bases into the workspaces, stream positions): not
# specialised on (Triton compiles a variant per value of 1 and per divisibility by 16 otherwise, so a model's
# tensors compiled dozens of variants of each pass). n keeps it: a multiple of 16 lets the row loads vectorise.
_BOOKKEEPING = ["n_balls", "stream_base", "chunks"]


@triton.jit(do_not_specialize=_BOOKKEEPING + ["slot_base", "key_base", "key_lo", "key_hi", "n_tangents"])
def _set_reduce_kernel(momentum, grad, schedule, tangent_coeffs, part_max, part_sum, keys, n_balls, n, stream_base,
                       chunks, slot_base, key_base, key_lo, key_hi, n_tangents, KIND: tl.constexpr,
                       COMPUTE_DTYPE: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
                       GAUSSIAN: tl.constexpr, NO_LEAD: tl.constexpr, BALLS: tl.constexpr, SEG: tl.constexpr,
                       Q: tl.constexpr, SKIPPABLE: tl.constexpr):
    """The reduction pass of the Lp and k-sparse steps: updates the momentum, then writes each tile row's
    (max|d|, sum (|d| / max|d|)^q) (Lp) or every element's magnitude key (k-sparse). Nothing on a skipped step."""
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:
            return
    ball, live, chunk, e, valid, position, calls = _ball_tile(n_balls, n, stream_base, chunks, NO_LEAD, BALLS, SEG)
    d = _direction(momentum, grad, position, valid, calls, schedule, tangent_coeffs, key_lo, key_hi, n_tangents,
                   COMPUTE_DTYPE, HAS_GRAD, HAS_MOMENTUM, True, GAUSSIAN, BALLS, SEG)
    if KIND == _LP:
        magnitude = tl.abs(d).to(tl.float64)
        is_nan = (magnitude != magnitude) & valid
        magnitude = tl.where(valid, magnitude, 0.0)
        # max with NaN propagated by hand: tl.max treats NaN differently compiled and interpreted
        row_max = tl.max(tl.where(is_nan, 0.0, magnitude), axis=1)
        row_max = tl.where(tl.max(is_nan.to(tl.int32), axis=1) != 0, _nan_f64(), row_max)
        scale = tl.where(row_max > 0, row_max, 1.0)  # an all-zero row sums to 0
        row_sum = tl.sum(tl.where(valid, _pow(magnitude / scale[:, None], Q), 0.0), axis=1)
        slot = slot_base + ball * chunks + chunk
        tl.store(part_max + slot, row_max, mask=live)
        tl.store(part_sum + slot, row_sum, mask=live)
    else:
        tl.store(keys + key_base + position, _magnitude_key(d, COMPUTE_DTYPE), mask=valid)


@triton.jit(do_not_specialize=_BOOKKEEPING + ["slot_base", "ball_base", "stat_base", "pos_base", "key_lo", "key_hi",
                                                "n_tangents"])
def _set_update_kernel(param, momentum, grad, schedule, tangent_coeffs, radii, factors, scales, gap_part, fb_stored,
                       fb_exact, stat_a, stat_b, n_balls, n, stream_base, chunks, slot_base, ball_base, stat_base,
                       pos_base, key_lo, key_hi, n_tangents, KIND: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                       HAS_GRAD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, GAUSSIAN: tl.constexpr,
                       NO_LEAD: tl.constexpr, BALLS: tl.constexpr, SEG: tl.constexpr, Q_MINUS_1: tl.constexpr,
                       P: tl.constexpr, FEEDBACK: tl.constexpr, SKIPPABLE: tl.constexpr):
    """The update pass: theta <- scale theta + alpha (s - scale theta) (reference.dense_update: s in float64,
    rounded; held within +-R for the L-infinity and k-sparse sets; scale the ball's norm feedback, 1 without),
    and each tile row's share of the gap <d, theta_old - s> (s in float64, as the reference) and, with FEEDBACK,
    its norm sums of the values stored and of the exact step (k-sparse: units of the grid of k r, whose factor
    is ``factors``; Lp: (|x| / r)^p). The L-infinity step updates the momentum here (its only pass). stat_a,
    stat_b: (max|d|, ||x||_q) per Lp ball, (threshold key, last position taken at the threshold) per k-sparse
    ball, both at stat_base + ball. Nothing on a skipped step."""
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:
            return
    ball, live, chunk, e, valid, position, calls = _ball_tile(n_balls, n, stream_base, chunks, NO_LEAD, BALLS, SEG)
    d = _direction(momentum, grad, position, valid, calls, schedule, tangent_coeffs, key_lo, key_hi, n_tangents,
                   COMPUTE_DTYPE, HAS_GRAD, HAS_MOMENTUM, KIND == _LINF, GAUSSIAN, BALLS, SEG)
    theta = tl.load(param + position, mask=valid).to(COMPUTE_DTYPE)
    radius = tl.load(radii + ball_base + ball, mask=live, other=1.0)
    d64 = d.to(tl.float64)
    sign = tl.where(d64 > 0, 1.0, tl.where(d64 < 0, -1.0, 0.0))  # torch.sign: 0 for 0 and for NaN
    vertex = -radius[:, None] * sign  # -r sign(d) in float64
    if KIND == _LP:
        norm = tl.load(stat_b + stat_base + ball, mask=live, other=1.0)
        zero = norm == 0  # d = 0 over the ball: so is the vertex
        top = tl.where(zero, 1.0, tl.load(stat_a + stat_base + ball, mask=live, other=1.0))
        # the reference's roundings: x = d / max|d|, then |x| / ||x||_q
        ratio = tl.abs(d64) / top[:, None] / tl.where(zero, 1.0, norm)[:, None]
        vertex = tl.where(zero[:, None], 0.0, vertex * _pow(ratio, Q_MINUS_1))
    elif KIND != _LINF:  # k-sparse
        threshold = tl.load(stat_a + stat_base + ball, mask=live, other=0)
        last_tie = tl.load(stat_b + stat_base + ball, mask=live, other=0)
        key = _magnitude_key(d, COMPUTE_DTYPE)
        chosen = (key > threshold[:, None]) | ((key == threshold[:, None]) & (pos_base + e <= last_tie[:, None]))
        vertex = tl.where(chosen, vertex, 0.0)
    _, alpha_c = _step_factors(schedule, COMPUTE_DTYPE)
    if FEEDBACK:
        scale = tl.load(scales + ball, mask=live, other=1.0)
    else:
        scale = tl.full([BALLS], 1.0, tl.float64)
    # R: the radius rounded down to the compute dtype (reference.radius_down)
    bound = radius.to(COMPUTE_DTYPE)
    bound = tl.where(bound.to(tl.float64) > radius, _toward_zero(bound, COMPUTE_DTYPE), bound)
    new, exact = _dense_update(theta, vertex, tl.load(schedule + 1), alpha_c, scale[:, None], bound[:, None],
                               radius[:, None], KIND != _LP, COMPUTE_DTYPE)
    stored = to_storage(new, param.dtype.element_ty)
    tl.store(param + position, stored, mask=valid)
    slot = slot_base + ball * chunks + chunk
    share = tl.sum(tl.where(valid, d64 * (theta.to(tl.float64) - vertex), 0.0), axis=1)
    tl.store(gap_part + slot, share, mask=live)
    if FEEDBACK:
        if KIND == _LP:
            stored_terms = _pow(tl.abs(stored.to(tl.float64)) / radius[:, None], P)
            exact_terms = _pow(tl.abs(exact) / radius[:, None], P)
            tl.store(fb_stored + slot, tl.sum(tl.where(valid, stored_terms, 0.0), axis=1), mask=live)
            tl.store(fb_exact + slot, tl.sum(tl.where(valid, exact_terms, 0.0), axis=1), mask=live)
        else:
            factor = tl.load(factors + ball_base + ball, mask=live, other=1.0)[:, None]
            tl.store(fb_stored + slot, _capped_sum(tl.where(valid, _norm_units(stored, factor), 0), 1), mask=live)
            tl.store(fb_exact + slot, _capped_sum(tl.where(valid, _norm_units(exact, factor), 0), 1), mask=live)


@triton.jit(do_not_specialize=["n_balls", "chunks", "slot_base", "ball_base"])
def _feedback_kernel(fb_stored, fb_exact, radii, factors, scales, schedule, bound_times, n_balls, chunks, slot_base,
                     ball_base, P: tl.constexpr, INTEGER: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, RB: tl.constexpr,
                     CB: tl.constexpr, SKIPPABLE: tl.constexpr):
    """Per ball (chunks slots from slot_base + ball chunks): its norm sums, and the next step's scale
    (reference.next_norm_scale) into scales[ball]. INTEGER: the k-sparse units sums, added stopping at their cap
    (order-free), a capped one counting as infinite, and the bound bound_times r in units; else the Lp sums of
    (|x| / r)^p, bound 1. Nothing on a skipped step: the scales keep their bits."""
    if SKIPPABLE:
        if tl.load(schedule + 3) != 0:
            return
    ball = tl.program_id(0) * RB + tl.arange(0, RB)
    live = ball < n_balls
    first = slot_base + ball.to(tl.int64) * chunks
    if INTEGER:
        stored_units = tl.zeros([RB], dtype=tl.int64)
        exact_units = tl.zeros([RB], dtype=tl.int64)
    else:
        # summed across the chunks' tiles after the loop (a reduction inside it, whose result has two uses,
        # failed Triton 3.8's thread-locality pass for sm_90)
        stored_tile = tl.zeros([RB, CB], dtype=tl.float64)
        exact_tile = tl.zeros([RB, CB], dtype=tl.float64)
    for c in range(0, chunks, CB):
        j = c + tl.arange(0, CB)
        mask = live[:, None] & (j < chunks)[None, :]
        if INTEGER:
            stored_units = _saturating_add(stored_units, tl.reduce(
                tl.load(fb_stored + first[:, None] + j[None, :], mask=mask, other=0), 1, _saturating_add))
            exact_units = _saturating_add(exact_units, tl.reduce(
                tl.load(fb_exact + first[:, None] + j[None, :], mask=mask, other=0), 1, _saturating_add))
        else:
            stored_tile += tl.load(fb_stored + first[:, None] + j[None, :], mask=mask, other=0.0)
            exact_tile += tl.load(fb_exact + first[:, None] + j[None, :], mask=mask, other=0.0)
    if INTEGER:
        stored = tl.where(stored_units < _SUM_CAP, stored_units.to(tl.float64), _INF)
        exact = tl.where(exact_units < _SUM_CAP, exact_units.to(tl.float64), _INF)
        radius = tl.load(radii + ball_base + ball, mask=live, other=1.0)
        bound = bound_times * radius * tl.load(factors + ball_base + ball, mask=live, other=1.0)
    else:
        stored = tl.sum(stored_tile, axis=1)
        exact = tl.sum(exact_tile, axis=1)
        bound = tl.full([RB], 1.0, tl.float64)
    tl.store(scales + ball, _next_norm_scale(stored, exact, bound, P, COMPUTE_DTYPE), mask=live)


@dataclasses.dataclass(frozen=True)
class _TensorPlan:
    """One tensor's launches: n_balls balls of n elements as [balls, seg] tiles, chunks per ball."""
    t: int
    n: int
    n_balls: int
    stream_base: int
    no_lead: bool  # every ball starts on a Philox call boundary (or reads a gradient)
    seg: int
    balls: int
    chunks: int
    programs: int
    slot_base: int  # the first (ball, chunk) slot: Lp partials and the gap's shares
    ball_base: int  # the first ball's radius (0 in the global ball)
    stat_base: int  # the first ball's statistics (Lp norm, k-sparse threshold)
    key_base: int  # the tensor's first key in the k-sparse workspace
    pos_base: int  # the position of the tensor's element 0 in its ball (the global ball: elements before it)


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    tensors: tuple  # _TensorPlan per tensor with elements
    slots: int
    radii: torch.Tensor  # float64 on the device, in ball order (one for the global ball)
    n_stats: int  # balls with elements
    n_keys: int  # elements
    finalize: tuple  # Lp: (slot_base, balls, chunks, stat_base) per launch of _lp_finalize_kernel
    classes: tuple  # k-sparse: (first key, balls, n, first stat) per run of equal-length balls in the workspace


def _tile(n: int, max_lead: int, n_balls: int) -> tuple[int, int, int]:
    """(seg, balls, chunks) of a tensor's tiles: short balls share a tile, long ones span several."""
    need = n + max_lead
    if need <= BLOCK:
        seg = max(_MIN_SEG, 1 << (need - 1).bit_length())
        return seg, min(BLOCK // seg, 1 << (n_balls - 1).bit_length()), 1
    return BLOCK, 1, triton.cdiv(need, BLOCK)


@functools.lru_cache(maxsize=64)
def _plan(device: torch.device, numels: tuple, row_numel: tuple, streams: tuple, radii_token: _Radii,
          global_ball: bool, has_grad: bool) -> _Plan:
    """Lays out a step's tiles, slots, statistics and key workspace, and uploads the radii; cached by content
    (the arguments are checked already, but for the radii's values, checked here once)."""
    radii = radii_token.values
    for r, radius in enumerate(radii):
        if not math.isfinite(radius) or radius <= 0:
            raise ValueError(f"radii[{r}] must be a finite radius > 0, got {radius}")
    live = []  # (t, n, n_balls, first radius) per tensor with elements
    radius_at = 0
    for t, numel in enumerate(numels):
        n = row_numel[t] or numel
        n_balls = numel // n if row_numel[t] else 1
        if numel:
            live.append((t, n, n_balls, 0 if global_ball else radius_at))
        if not global_ball:
            radius_at += n_balls
    # Statistics and keys: balls of one length sit together, so that one selection covers them (k-sparse);
    # the global ball is every tensor's elements in order.
    bases = {}  # t -> (key base, stat base, position base)
    classes = []
    if global_ball:
        at = 0
        for t, n, _, _ in live:
            bases[t] = (at, 0, at)
            at += n
        if live:
            classes.append((0, 1, at, 0))
    else:
        key_at = stat_at = 0
        for length in dict.fromkeys(n for _, n, _, _ in live):
            members = [(t, n_balls) for t, n, n_balls, _ in live if n == length]
            classes.append((key_at, sum(b for _, b in members), length, stat_at))
            for t, n_balls in members:
                bases[t] = (key_at, stat_at, 0)
                key_at += n_balls * length
                stat_at += n_balls
    tensors = []
    slots = 0
    for t, n, n_balls, ball_base in live:
        stream = 0 if has_grad else streams[t]
        # the largest lead of a ball (stream index of its first element % 4), periodic in 4 balls; a gradient
        # is read, not drawn, so its tile rows start at the balls' first elements
        max_lead = 0 if has_grad else max((stream + b * n) % 4 for b in range(min(n_balls, 4)))
        seg, balls, chunks = _tile(n, max_lead, n_balls)
        key_base, stat_base, pos_base = bases[t]
        tensors.append(_TensorPlan(
            t=t, n=n, n_balls=n_balls, stream_base=stream, no_lead=max_lead == 0, seg=seg, balls=balls,
            chunks=chunks, programs=triton.cdiv(n_balls, balls) * chunks, slot_base=slots,
            ball_base=ball_base, stat_base=stat_base, key_base=key_base, pos_base=pos_base))
        slots += n_balls * chunks
    if global_ball:
        finalize = ((0, 1, slots, 0),) if slots else ()
    else:
        finalize = tuple((tp.slot_base, tp.n_balls, tp.chunks, tp.stat_base) for tp in tensors)
    return _Plan(tensors=tuple(tensors), slots=slots,
                 radii=torch.tensor(radii, dtype=torch.float64).to(device, non_blocking=True),
                 n_stats=1 if global_ball and live else sum(b for _, _, b, _ in live),
                 n_keys=sum(n * b for _, n, b, _ in live), finalize=finalize, classes=tuple(classes))

@functools.lru_cache(maxsize=64)
def _units_factors(device: torch.device, radii_token: _Radii, bound_times: float) -> torch.Tensor:
    """Each ball's units factor of the grid of bound_times r (the k-sparse step's L1 bound k r), on the device."""
    return torch.tensor([units_factor(bound_times * r) for r in radii_token.values], dtype=torch.float64).to(
        device, non_blocking=True)


def _check_scales(params, scales, global_ball: bool, row_numel: tuple) -> None:
    """As the C++ check_scales (csrc/op_args.cpp): empty, or float64 tensors on the params' device, contiguous, one
    per parameter with one element per ball of it (one tensor of one element for the global ball)."""
    if not scales:
        return
    want = 1 if global_ball else len(params)
    if len(scales) != want:
        raise ValueError(f"scales must be empty (no norm feedback) or hold "
                         f"{'one tensor for the global ball' if global_ball else 'one tensor per parameter'} ({want}), "
                         f"got {len(scales)}")
    for t, x in enumerate(scales):
        balls = 1 if global_ball else (params[t].numel() // row_numel[t] if row_numel[t] else 1)
        if x.dtype != torch.float64 or x.numel() != balls or not x.is_contiguous():
            raise ValueError(f"scales[{t}] must be a contiguous float64 tensor of {balls} element(s) (one per ball), "
                             f"got {x.dtype} of shape {tuple(x.shape)}")
        if params and x.device != params[0].device:
            raise ValueError(f"scales[{t}] must be on {params[0].device} like the params, got {x.device}")


def _set_step(kind: int, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel, p: float = 2.0, k: int = 1, scales=(), statistics=None) -> None:
    """The step of the set ``kind`` (LINF, LP, KSPARSE). The Lp and k-sparse steps pass ``statistics(plan, part_max,
    part_sum, keys, schedule, skip) -> (stat_a, stat_b)``, run on the device between the reduction and the update
    passes: each ball's (max|d|, ||x||_q) (lp_fw_step.py), or (threshold key, last position taken at it)
    (ksparse_fw_step.py)."""
    row_numel = _checked_row_numel(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                                   distribution, gap, row_numel)
    _check_scales(params, scales, bool(global_ball), row_numel)
    if not params:
        empty_gap_(gap, schedule)
        return
    has_grad, has_momentum = bool(grads), bool(momentum)
    device = params[0].device
    plan = _plan(device, tuple(x.numel() for x in params), row_numel,
                 (0,) * len(params) if has_grad else tuple(int(o) for o in offsets), _radii_token(radii),
                 bool(global_ball), has_grad)
    hold_while_capturing(plan)
    if plan.slots == 0:
        empty_gap_(gap, schedule)
        return
    compute_dtype = reference.compute_dtype(params[0].dtype)
    key_lo, key_hi = key_words(seed)
    # With grads, tangent_coeffs is never read and may be on any device: pass one that is on the params'.
    coeffs, n_tangents = (schedule, 0) if has_grad else (tangent_coeffs, tangent_coeffs.numel())
    skip = skippable(schedule)  # every kernel reads the skip on the device
    flags = dict(COMPUTE_DTYPE=TL_DTYPES[compute_dtype], HAS_GRAD=has_grad, HAS_MOMENTUM=has_momentum,
                 GAUSSIAN=distribution == reference.GAUSSIAN, SKIPPABLE=skip,
                 # no FMA contraction: every product and sum rounds as in the reference
                 enable_fp_fusion=False, maxnreg=_MAX_REGISTERS)
    q = p / (p - 1)  # as reference.lp_vertex

    def warps(tp: _TensorPlan) -> int:
        return max(1, tp.balls * tp.seg // (32 * _ELEMENTS_PER_THREAD[kind]))

    gap_part = torch.empty(plan.slots, dtype=torch.float64, device=device)
    stat_a = stat_b = gap_part  # unused by the L-infinity step

    def tensors_of(tp: _TensorPlan) -> tuple:
        """(momentum, grad) of a tensor: the param where absent (never read then)."""
        x = params[tp.t]
        return momentum[tp.t] if has_momentum else x, grads[tp.t] if has_grad else x

    with device_of(params[0]):
        if kind != LINF:
            part_max = torch.empty(plan.slots if kind == LP else 0, dtype=torch.float64, device=device)
            part_sum = torch.empty_like(part_max)
            keys = torch.empty(plan.n_keys if kind == KSPARSE else 0,
                               dtype=torch.int64 if compute_dtype == torch.float64 else torch.int32, device=device)
            for tp in plan.tensors:
                _set_reduce_kernel[(tp.programs,)](
                    *tensors_of(tp), schedule, coeffs, part_max, part_sum, keys, tp.n_balls, tp.n, tp.stream_base,
                    tp.chunks, tp.slot_base, tp.key_base, key_lo, key_hi, n_tangents, KIND=kind, NO_LEAD=tp.no_lead,
                    BALLS=tp.balls, SEG=tp.seg, Q=q, num_warps=warps(tp), **flags)
            stat_a, stat_b = statistics(plan, part_max, part_sum, keys, schedule, skip)
        feedback = kind != LINF and bool(scales)
        integer = kind == KSPARSE
        factors = _units_factors(device, _radii_token(radii), float(k)) if feedback and integer else plan.radii
        fb_stored = torch.empty(plan.slots if feedback else 0, dtype=torch.int64 if integer else torch.float64,
                                device=device)
        fb_exact = torch.empty_like(fb_stored)

        def scales_of(tp: _TensorPlan) -> torch.Tensor:
            """The scales of a tensor's balls (the global ball's one scale for every tensor); gap_part unused."""
            return (scales[0] if global_ball else scales[tp.t]) if feedback else gap_part

        for tp in plan.tensors:
            _set_update_kernel[(tp.programs,)](
                params[tp.t], *tensors_of(tp), schedule, coeffs, plan.radii, factors, scales_of(tp), gap_part,
                fb_stored, fb_exact, stat_a, stat_b, tp.n_balls, tp.n, tp.stream_base, tp.chunks, tp.slot_base,
                tp.ball_base, tp.stat_base, tp.pos_base, key_lo, key_hi, n_tangents, KIND=kind, NO_LEAD=tp.no_lead,
                BALLS=tp.balls, SEG=tp.seg, Q_MINUS_1=q - 1, P=float(p) if kind == LP else 1.0, FEEDBACK=feedback,
                num_warps=warps(tp), **flags)
        if feedback:
            # each ball's next scale, from its slots; the global ball's from every slot
            launches = ((0, 1, plan.slots, 0, scales[0]),) if global_ball else tuple(
                (tp.slot_base, tp.n_balls, tp.chunks, tp.ball_base, scales[tp.t]) for tp in plan.tensors)
            for slot_base, balls, chunks, ball_base, out in launches:
                cb = min(_RBLOCK, triton.next_power_of_2(chunks))
                rb = max(1, min(_RBLOCK // cb, triton.next_power_of_2(balls)))
                _feedback_kernel[(triton.cdiv(balls, rb),)](
                    fb_stored, fb_exact, plan.radii, factors, out, schedule, float(k), balls, chunks, slot_base,
                    ball_base, P=float(p) if kind == LP else 1.0, INTEGER=integer,
                    COMPUTE_DTYPE=TL_DTYPES[compute_dtype], RB=rb, CB=cb, SKIPPABLE=skip, num_warps=4,
                    maxnreg=_MAX_REGISTERS, enable_fp_fusion=False)
        _gap_sum_kernel[(1,)](gap_part, gap, plan.slots, schedule, RBLOCK=_RBLOCK, SKIPPABLE=skip, num_warps=4)
