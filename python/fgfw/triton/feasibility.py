"""What keeps the rounded iterates of the Triton steps in their sets (docs/feasibility.md): the Triton forms of
reference.norm_units, norm_sums, l1_vertex_value, dense_update and next_norm_scale, operation by operation (the
kernels launch with enable_fp_fusion=False), as csrc/feasibility.h is for the C++ kernels.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import reference

_UNITS_CAP = tl.constexpr(2.0 ** reference.NORM_GRID_BITS)
_MAGIC = tl.constexpr(2.0 ** 52)  # v + 2^52 rounds v in [0, 2^51] to an integer: the float64 spacing there is 1
_MAGIC_BITS = tl.constexpr(0x4330000000000000)  # the bits of 2^52
_SUM_CAP = tl.constexpr(reference.NORM_SUM_CAP)
_INF = tl.constexpr(float("inf"))
_BAND_F32 = tl.constexpr(reference.NORM_SCALE_BAND * 2.0 ** -24)
_BAND_F64 = tl.constexpr(reference.NORM_SCALE_BAND * 2.0 ** -53)


def units_factor(radius: float) -> float:
    """2^(51 - E) of a ball of this radius (reference.norm_grid_exponent), computed on the host."""
    return math.ldexp(1.0, reference.NORM_GRID_BITS - reference.norm_grid_exponent(radius))


@triton.jit
def _norm_units(x, factor):
    """reference.norm_units: |x| times the ball's units factor (a power of two), rounded to an integer (ties to
    even), at most 2^51 (NaN too), as int64."""
    v = tl.abs(x.to(tl.float64)) * factor
    v = tl.where(v < _UNITS_CAP, v, _UNITS_CAP)
    return (v + _MAGIC).to(tl.int64, bitcast=True) - _MAGIC_BITS


@triton.jit
def _saturating_add(a, b):
    """a + b stopped at the cap, for a, b <= 2^61: order-free (reference.norm_sums)."""
    return tl.minimum(a + b, _SUM_CAP)


@triton.jit
def _capped_sum(units, axis: tl.constexpr):
    """reference.norm_sums of a tile along ``axis``: each tile holds at most 2048 terms of at most 2^51, so the plain
    sum is below 2^62, then stopped at the cap."""
    return tl.minimum(tl.sum(units, axis=axis), _SUM_CAP)


@triton.jit
def _toward_zero(y, COMPUTE_DTYPE: tl.constexpr):
    """The COMPUTE_DTYPE value next to y toward 0, as C's nextafter(y, 0) (+0 for +-0)."""
    if COMPUTE_DTYPE == tl.float64:
        down = (y.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True)
    else:
        down = (y.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    return tl.where(y == 0, 0.0, down).to(COMPUTE_DTYPE)


@triton.jit
def _l1_vertex_value(x, d, alpha, radius, unit, numel, old_units, new_units, COMPUTE_DTYPE: tl.constexpr):
    """reference.l1_vertex_value, elementwise: x (the scaled value stored at i*) and d in the compute dtype; alpha,
    radius and unit (2^(E - 51)) float64; numel and the units sums int64."""
    sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0)).to(tl.float64)  # torch.sign: 0 for NaN
    s = -radius * sign
    x64 = x.to(tl.float64)
    w = x64 + alpha * s
    excess = (1.0 - alpha) * (old_units.to(tl.float64) * unit) - new_units.to(tl.float64) * unit
    target = tl.abs(w) + excess
    room = (radius - (new_units + numel + 2).to(tl.float64) * unit) + tl.abs(x64)
    magnitude = tl.where(target > room, room, target)
    magnitude = tl.where(magnitude < 0.0, 0.0, magnitude)
    y = tl.where(w.to(tl.int64, bitcast=True) < 0, -magnitude, magnitude).to(COMPUTE_DTYPE)  # copysign(mag, w)
    y = tl.where(tl.abs(y.to(tl.float64)) > room, _toward_zero(y, COMPUTE_DTYPE), y)
    outside = (old_units - numel).to(tl.float64) * unit > radius  # a start outside the ball: the plain step
    return tl.where(outside, w.to(COMPUTE_DTYPE), y)


@triton.jit
def _dense_update(theta, s, alpha, alpha_c, scale, bound_c, radius, CLAMP: tl.constexpr,
                  COMPUTE_DTYPE: tl.constexpr):
    """reference.dense_update, elementwise: (theta_new in the compute dtype, the exact step in float64). theta in
    the compute dtype; s, alpha, scale and radius float64; alpha_c and bound_c (R) in the compute dtype."""
    scaled_exact = scale * theta.to(tl.float64)
    scaled = scaled_exact.to(COMPUTE_DTYPE)
    vertex = s.to(COMPUTE_DTYPE)
    exact = scaled_exact + alpha * (s - scaled_exact)
    if CLAMP:
        vertex = tl.where(vertex > bound_c, bound_c, tl.where(vertex < -bound_c, -bound_c, vertex))
    new = scaled + alpha_c * (vertex - scaled)
    if CLAMP:
        new = tl.where(new > bound_c, bound_c, tl.where(new < -bound_c, -bound_c, new))
        exact = tl.where(exact > radius, radius, tl.where(exact < -radius, -radius, exact))
    return new, exact


@triton.jit
def _next_norm_scale(stored, exact, bound, p, COMPUTE_DTYPE: tl.constexpr):
    """reference.next_norm_scale, elementwise (float64): stored and exact are the ball's units sums as float64
    (infinite where capped) for p = 1, or its sums of (|x| / r)^p."""
    finite = (tl.abs(stored) < _INF) & (tl.abs(exact) < _INF)  # and not NaN
    usable = finite & (stored > 0.0)
    ratio = tl.where(bound < exact, bound, exact) / tl.where(usable, stored, 1.0)
    if p == 1.0:
        scale = ratio
    else:
        # ratio^(1/p) as exp(log(ratio) / p): the interpreter has no libdevice pow (the Lp steps agree within a
        # tolerance). tl.full: float constants in float64 itself (a float constexpr would be rounded to float32).
        scale = tl.exp(tl.log(tl.where(usable, ratio, 1.0)) * tl.full([], 1.0 / p, tl.float64))
    if COMPUTE_DTYPE == tl.float64:
        low = tl.full([], 1.0 - _BAND_F64, tl.float64)
        high = tl.full([], 1.0 + _BAND_F64, tl.float64)
    else:
        low = tl.full([], 1.0 - _BAND_F32, tl.float64)
        high = tl.full([], 1.0 + _BAND_F32, tl.float64)
    scale = tl.where(scale < low, low, scale)
    scale = tl.where(high < scale, high, scale)
    return tl.where(usable, scale, 1.0)
