"""Pure-torch reference of every fgfw op: the spec that every backend is tested against.

Short, obvious and slow on purpose. The C++, CUDA and Triton kernels mirror these function names
and must agree with them on the same inputs (bit-exact for Rademacher tangents and for the
integer Philox stream, within a tight tolerance for Gaussian tangents and floating arithmetic).

The tangent stream (never change it without bumping TANGENT_STREAM_VERSION: saved runs depend on it)
----------------------------------------------------------------------------------------------------
The full spec, with the backends' agreement and versioning, is docs/tangent_stream.md; in short:

Philox4x32-10, key = the 64-bit seed as (lo, hi). Element i of the optimizer's flat parameter index
space (parameter order, then flat index; each tensor starts at its ``offset``, which the optimizers
round up to a multiple of 4 so that every tensor begins with a whole Philox call) uses the call at
counter = (q lo, q hi, step, tangent_id) with q = i // 4 and takes word i % 4.

* Rademacher: +1 if the word's top bit is 0, else -1 (bit-exact everywhere).
* Gaussian: words (0, 1) and (2, 3) of a call are Box-Muller pairs. Uniforms are
  ``(float32(w >> 8) + 0.5f) * 2^-24`` in float32 (never 0). The first word gives the radius
  ``sqrt(-2 ln u1)``, the second the angle ``2 pi u2``; ``r cos`` goes to the even element, ``r sin``
  to the odd one. All in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

TANGENT_STREAM_VERSION = 1

GAUSSIAN = 0
RADEMACHER = 1
DISTRIBUTIONS = {"gaussian": GAUSSIAN, "rademacher": RADEMACHER}

_MASK32 = 0xFFFFFFFF
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_TWO_PI_F32 = 6.2831853071795864769  # rounded to float32 where it is used, as the kernels do


def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * m for int64 tensors holding uint32 values, without overflow."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    lo_part = a_lo * m  # < 2^48
    hi_part = a_hi * m  # < 2^48
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _MASK32
    hi = (hi_part + (lo_part >> 16)) >> 16
    return hi & _MASK32, lo


def philox4x32_10(counter: Sequence[torch.Tensor | int], key: Sequence[int]) -> list[torch.Tensor]:
    """Philox4x32-10 (Salmon et al., Random123) on int64 tensors that hold uint32 values.

    ``counter`` is four tensors (or ints) broadcast together; ``key`` two ints. Returns four tensors.
    """
    # Ints become tensors on the device of the tensor words: broadcast, a CPU scalar turns into a CPU
    # tensor that cannot meet a CUDA one.
    device = next((x.device for x in counter if isinstance(x, torch.Tensor)), None)
    c = [torch.as_tensor(x, dtype=torch.int64, device=device) for x in counter]
    c = list(torch.broadcast_tensors(*c))
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for rnd in range(10):
        if rnd:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(c[0], _PHILOX_M0)
        hi1, lo1 = _mulhilo32(c[2], _PHILOX_M1)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def seed_to_key(seed: int) -> tuple[int, int]:
    """The Philox key of a seed: its 64 bits as (lo, hi); negative seeds use two's complement."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return s & _MASK32, s >> 32


def uniform_from_word(w: torch.Tensor) -> torch.Tensor:
    """float32 uniform in (0, 1] from a 32-bit word, exactly as every kernel computes it."""
    return ((w >> 8).to(torch.float32) + 0.5) * (2.0**-24)


def _philox_words(numel: int, seed: int, step: int, tangent_id: int, offset: int, device) -> torch.Tensor:
    """The raw words for elements [offset, offset + numel), as a (calls, 4) int64 tensor, and the slice."""
    q_first, q_last = offset // 4, (offset + numel - 1) // 4
    q = torch.arange(q_first, q_last + 1, dtype=torch.int64, device=device)
    words = philox4x32_10((q & _MASK32, q >> 32, step & _MASK32, tangent_id & _MASK32), seed_to_key(seed))
    return torch.stack(words, dim=1), offset - 4 * q_first


def tangent(numel: int, seed: int, step: int, tangent_id: int, offset: int = 0,
            distribution: int = GAUSSIAN, device="cpu") -> torch.Tensor:
    """The float32 tangent u for elements [offset, offset + numel) of the stream."""
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=device)
    words, start = _philox_words(numel, seed, step, tangent_id, offset, device)
    if distribution == RADEMACHER:
        values = (1 - 2 * (words >> 31)).to(torch.float32)
    elif distribution == GAUSSIAN:
        u = uniform_from_word(words)
        radius = torch.sqrt(-2.0 * torch.log(u[:, 0::2]))
        angle = torch.tensor(_TWO_PI_F32, dtype=torch.float32) * u[:, 1::2]
        # even element: r cos, odd element: r sin, for each of the two pairs of a call
        values = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=2).reshape(-1, 4)
    else:
        raise ValueError(f"distribution must be {GAUSSIAN} (gaussian) or {RADEMACHER} (rademacher), got {distribution}")
    return values.reshape(-1)[start:start + numel]


def fill_tangent_(out: torch.Tensor, seed: int, step: int, tangent_id: int, offset: int, distribution: int) -> None:
    """Writes the tangent of ``out``'s elements (flat order, stream index offset + j) into ``out``."""
    u = tangent(out.numel(), seed, step, tangent_id, offset, distribution, device=out.device)
    out.copy_(u.view(out.shape))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic and momentum dtype for a parameter dtype: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def feasibility_shrink(cdt: torch.dtype) -> float:
    """kappa = 1 - 4u (u the unit roundoff of the compute dtype cdt, float32 or float64): the factor with which
    :func:`fw_step_` steps a set that has no fused step, no :class:`Feasibility` and no cheap gauge
    (``shrink=True`` without ``gauge_parts``: the nuclear- and spectral-norm balls).

    Such a step scales theta by RN(RN(1 - alpha) kappa) and moves it by RN(RN(alpha kappa) s_i): with at most four
    roundings of (1 + u) on any element, (1 + u)^4 (1 - 4u) < 1, so the rounded iterate stays in the set. The price
    is a relative shrink of 4u at every step, which biases the iterate inward by (1 - kappa) / alpha: 2u (k + 2)
    with alpha = 2 / (k + 2), growing with the step count. The fused sets do without it (docs/feasibility.md).
    """
    return 1.0 - 4.0 * torch.finfo(cdt).eps / 2


def step_factors(alpha: float, cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, alpha) of a step in the compute dtype: keep = RN(1 - alpha), from alpha in float64, and alpha
    rounded. The L1 step scales every element by keep (the vertex element is then set by l1_vertex_value); the
    dense steps use alpha (dense_update)."""
    return torch.tensor(1.0 - alpha, dtype=torch.float64).to(cdt), torch.tensor(alpha, dtype=torch.float64).to(cdt)


# -- What keeps the rounded iterates in their sets (docs/feasibility.md) ----------------------------------------------
# A step's norm sums count in units of 2^(E - NORM_GRID_BITS), 2^E the smallest power of two >= the radius: a value
# |x| <= r is at most 2^51 units, a float32 value of at least 2^-28 r is a whole number of units, and integer sums
# are exact in any order, so that every backend, however it splits a ball, gets the same sums and the same bits.
# An element counts at most 2^51 units (|x| >= 2^E >= r: outside its ball; inf and NaN too), and a ball's sums stop
# at 2^61 (a norm of 2^10 2^E or more): so that no partial sum overflows int64 in any backend, and sums that stop at
# a cap are order-free too. Either cap is reached only by a ball already outside, which then steps plainly.
NORM_GRID_BITS = 51
_UNITS_CAP = 2.0 ** 51
NORM_SUM_CAP = 2 ** 61


def norm_grid_exponent(radius: float) -> int:
    """E: 2^E is the smallest power of two >= radius, and at least 2^-970 (so that 2^(51 - E) is a float64)."""
    mantissa, exponent = math.frexp(radius)
    return max(exponent - 1 if mantissa == 0.5 else exponent, -970)


def norm_units(x: torch.Tensor, exponent: int | torch.Tensor) -> torch.Tensor:
    """|x| in units of 2^(E - 51), rounded to the nearest integer (ties to even), as int64: |x| 2^(51 - E) in
    float64 (a product by a power of two: exact), at most 2^51 (NaN counts 2^51). ``exponent``: one E, or one
    per element (an int64 tensor)."""
    if isinstance(exponent, torch.Tensor):
        factors = {e: math.ldexp(1.0, NORM_GRID_BITS - e) for e in exponent.unique().tolist()}
        factor = torch.zeros(exponent.shape, dtype=torch.float64, device=x.device)
        for e, f in factors.items():
            factor[exponent == e] = f
    else:
        factor = math.ldexp(1.0, NORM_GRID_BITS - exponent)
    v = x.double().abs() * factor
    v = torch.where(v < _UNITS_CAP, v, torch.full_like(v, _UNITS_CAP))
    return torch.round(v).to(torch.int64)


def norm_sums(units: torch.Tensor) -> torch.Tensor:
    """The sums of norm_units along the last dimension (int64), each stopped at NORM_SUM_CAP: pairwise, every
    partial stopped at the cap, so that none overflows (terms and partials are at most 2^61), and since the terms are
    >= 0 the result is min(the exact sum, the cap) whatever the order."""
    x = units
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = torch.cat([x, torch.zeros_like(x[..., :1])], dim=-1)
        x = (x[..., 0::2] + x[..., 1::2]).clamp(max=NORM_SUM_CAP)
    return x[..., 0] if x.shape[-1] else torch.zeros(x.shape[:-1], dtype=torch.int64, device=x.device)


def _round_to(value: float, cdt: torch.dtype) -> float:
    """value (float64) rounded to nearest in cdt, as a Python float."""
    return float(torch.tensor(value, dtype=torch.float64).to(cdt))


def _toward_zero(value: float, cdt: torch.dtype) -> float:
    """The cdt value next to ``value`` (a cdt value) toward 0."""
    return float(torch.nextafter(torch.tensor(value, dtype=cdt), torch.zeros((), dtype=cdt)))


def _sign(x: float) -> float:
    """torch.sign of a float: 0 for 0 and for NaN."""
    return float((x > 0) - (x < 0))


def l1_vertex_value(x: float, d: float, alpha: float, radius: float, numel: int, old_units: int, new_units: int,
                    cdt: torch.dtype) -> float:
    """The new value of an L1 ball's vertex element i*, in cdt, once every element of the ball has been scaled:
    theta_i <- RN(keep theta_i) (step_factors). ``x`` is the scaled value stored at i*, ``d`` = d_i*, ``numel``
    the ball's elements, ``old_units`` and ``new_units`` the ball's norm_sums of theta before the step and of the
    values stored by the scaling, on the grid of ``radius`` (norm_grid_exponent).

    * The exact step moves i* to w = x + alpha s (s = -r sign(d)), in float64.
    * Rounding the scaling of every element moved the ball's norm by ``excess`` from the exact
      (1 - alpha) ||theta_old||: the vertex element takes it back, |theta_i*| = |w| + excess, so that the ball's
      norm follows the exact iteration to within one rounding of theta_i*.
    * It never takes more than ``room``: the others' stored norm is bounded from above (each units sum is within
      numel / 2 units of the exact one; 2 units cover the rounding of room itself), so the ball's stored norm
      stays at most r - exactly inside, step after step.
    Then rounded to cdt, and one cdt value toward 0 if that rounding went past ``room``. A ball whose old norm
    provably exceeds r (a start outside the ball, which the optimizers never step) takes w rounded: the plain step.
    """
    unit = math.ldexp(1.0, norm_grid_exponent(radius) - NORM_GRID_BITS)
    s = -radius * _sign(d)
    w = x + alpha * s
    if (old_units - numel) * unit > radius:
        return _round_to(w, cdt)
    excess = (1.0 - alpha) * (old_units * unit) - new_units * unit
    target = abs(w) + excess
    room = radius - (new_units + numel + 2) * unit + abs(x)
    magnitude = room if target > room else target
    if magnitude < 0:
        magnitude = 0.0
    y = _round_to(math.copysign(magnitude, w), cdt)
    return _toward_zero(y, cdt) if abs(y) > room else y


def direction(param: torch.Tensor, grad: torch.Tensor | None, tangent_coeffs: torch.Tensor, seed: int,
              step: int, offset: int, distribution: int) -> torch.Tensor:
    """The gradient estimate g: ``grad``, or sum_k coeff_k u_k for the forward gradient."""
    cdt = compute_dtype(param.dtype)
    if grad is not None:
        return grad.reshape(-1).to(cdt)
    coeffs = tangent_coeffs.to(cdt)
    g = None
    for k in range(coeffs.numel()):
        term = coeffs[k] * tangent(param.numel(), seed, step, k, offset, distribution, param.device).to(cdt)
        g = term if g is None else g + term
    return g


def schedule_values(schedule: torch.Tensor) -> tuple[int, float, float, bool]:
    """A step's schedule: a float64 tensor (step k, alpha_k, gamma_k) or (step k, alpha_k, gamma_k, skip), read
    on the host. ``skip`` != 0 makes the step write nothing (parameters, momentum and scales keep their bits) but
    NaN into the gap: the optimizers set it on the device when a direction is not finite, so that no step has
    to wait for the host to decide (found_inf in torch's fused optimizers)."""
    values = schedule.tolist()
    if len(values) not in (3, 4):
        raise ValueError(f"schedule must hold (step, alpha, gamma) or (step, alpha, gamma, skip), got {len(values)} "
                         f"values")
    step, alpha, gamma = values[:3]
    return int(step), float(alpha), float(gamma), len(values) == 4 and values[3] != 0


def _directions(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, distribution,
                row_numel) -> tuple[float, list[tuple[int, int, int]], list[torch.Tensor]]:
    """What every step does before its LMO: checks the balls and radii, and returns (alpha, the balls, each
    tensor's direction d, flat in the compute dtype), with the momentum updated in place (d = v then). On a
    skipped step (``skip_step``) the directions are None and nothing was written."""
    step, alpha, gamma, skip = schedule_values(schedule)
    if not grads and len(offsets) != len(params):
        # tensors sharing offset 0 would share tangent values: a biased estimate, never what is meant
        raise ValueError(f"offsets must give each of the {len(params)} params its stream offset for the forward "
                         f"gradient, got {len(offsets)}")
    balls = ball_layout([p.numel() for p in params], global_ball, row_numel)
    if len(radii) != (1 if global_ball else len(balls)):
        raise ValueError(f"radii must hold one radius per ball ({1 if global_ball else len(balls)}), got {len(radii)}")
    if skip:
        return alpha, balls, None
    directions = []
    for t, p in enumerate(params):
        cdt = compute_dtype(p.dtype)
        g = direction(p, grads[t] if grads else None, tangent_coeffs, seed, step, offsets[t] if not grads else 0,
                      distribution)
        if momentum:
            v = momentum[t].view(-1)
            gamma_c = torch.tensor(gamma, dtype=cdt)
            v.copy_((1 - gamma_c) * v + gamma_c * g)
            g = v.clone()
        directions.append(g)
    return alpha, balls, directions


def l1_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: Sequence[float],
                global_ball: bool, offsets: Sequence[int], seed: int, distribution: int,
                gap: torch.Tensor, row_numel: Sequence[int] = ()) -> None:
    """One Frank-Wolfe step over the L1 ball(s), in place. The spec of the fused kernels (docs/fused_step.md).

    * ``schedule`` = float64 tensor (step k, alpha_k, gamma_k) or (step k, alpha_k, gamma_k, skip): a step with
      skip != 0 writes nothing but NaN into ``gap`` (schedule_values).
    * direction g: ``grads[t]`` if grads are given (backprop FW), else the forward gradient
      sum_k tangent_coeffs[k] * u_k regenerated from (seed, step, k, offsets[t] + j).
    * momentum given: v = (1 - gamma) v + gamma g, d = v (AFGFW / FW with momentum); else d = g (FGFW).
    * balls: one per tensor, or one over all tensors (``global_ball``), or, where ``row_numel[t]`` = n > 0,
      one per run of n consecutive elements of tensor t (its rows: n must divide its numel; scope
      "row"). ``radii`` holds one radius per ball in order (tensors in order, rows in order within a
      tensor); one for the global ball. ``row_numel`` empty means 0 for every tensor.
    * LMO per ball of radius r: i* = argmax |d_i| over the ball (lowest index wins ties),
      s = -r sign(d_i*) e_i*.
    * theta <- (1 - alpha) theta + alpha s: every element scaled, theta_i <- RN(keep theta_i) (step_factors), then
      the vertex element set by l1_vertex_value, which takes back what the scaling's roundings moved the ball's
      norm and keeps the stored iterate inside the ball (docs/feasibility.md).
    * ``gap`` <- the Frank-Wolfe gap <d, theta - s> at the old theta, summed over balls.
    """
    alpha, balls, directions = _directions(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball,
                                           offsets, seed, distribution, row_numel)
    if directions is None:  # a skipped step
        gap.fill_(math.nan)
        return
    total_gap = 0.0
    olds, news = [], []
    for t, p in enumerate(params):
        cdt = compute_dtype(p.dtype)
        old = p.reshape(-1).to(cdt, copy=True)  # the values before the step (p changes below)
        total_gap += float((directions[t].double() * old.double()).sum())
        keep, _ = step_factors(alpha, cdt)
        p.copy_((keep * p.to(cdt)).to(p.dtype))
        olds.append(old)
        news.append(p.reshape(-1))

    def units(values: list[torch.Tensor], pieces: list[tuple[int, int, int]], radius: float) -> int:
        exponent = norm_grid_exponent(radius)
        return int(norm_sums(torch.cat([norm_units(values[t][start:start + length], exponent)
                                        for t, start, length in pieces])))

    def vertex_update(t: int, i: int, r: float, pieces: list[tuple[int, int, int]]) -> float:
        """theta_i* of element i of tensor t (its ball made of ``pieces``); returns r |d_i*|, its share of the gap."""
        d_i = directions[t][i]
        p_flat = params[t].view(-1)
        cdt = compute_dtype(p_flat.dtype)
        numel = sum(length for _, _, length in pieces)
        p_flat[i] = l1_vertex_value(float(p_flat[i]), float(d_i), alpha, r, numel, units(olds, pieces, r),
                                    units(news, pieces, r), cdt)
        return float(d_i.abs()) * r

    live = [t for t, d in enumerate(directions) if d.numel() > 0]
    if global_ball:
        if live:
            maxima = torch.stack([directions[t].abs().max().double() for t in live])
            best = int(torch.argmax(maxima))  # first tensor holding the max: lowest global index
            t = live[best]
            total_gap += vertex_update(t, int(torch.argmax(directions[t].abs())), radii[0], balls)
    else:
        for (t, start, length), r in zip(balls, radii):
            if length:
                d_ball = directions[t][start:start + length]
                total_gap += vertex_update(t, start + int(torch.argmax(d_ball.abs())), r, [(t, start, length)])
    gap.fill_(total_gap)


@dataclass(frozen=True)
class Feasibility:
    """How a dense step keeps its rounded iterate in its set without shrinking it (docs/feasibility.md). The update
    is theta + alpha (s - theta), which leaves an element equal to its vertex value where it is; then

    * ``clamp``: every |theta_i| is held at most R, the radius rounded down to the compute dtype (and the vertex
      values -r sign(d) are +-R): the L-infinity ball and the k-sparse polytope, exactly;
    * ``p`` (or None): norm feedback on ||theta||_p <= ``bound`` r. The step sums the norm of what it stores and of
      the step in exact arithmetic (float64), and the next step scales the ball's theta by their ratio (capped by
      the bound; ``scales``, one per ball) before it updates it: the stored norm follows the exact iteration
      instead of drifting with the roundings, and exceeds the bound by at most one step's rounding.
    """
    clamp: bool = False
    p: float | None = None
    bound: float = 1.0


def set_feasibility(kind: str, param: float | int | None = None) -> Feasibility:
    """The Feasibility of a set by its step's kind: 'l1' (an L1 ball stepped densely, as with rescale=), 'linf',
    'lp' (param p) or 'ksparse' (param k: |theta_i| <= r and ||theta||_1 <= k r)."""
    if kind == "l1":
        return Feasibility(p=1.0)
    if kind == "linf":
        return Feasibility(clamp=True)
    if kind == "lp":
        return Feasibility(p=float(param))
    if kind == "ksparse":
        return Feasibility(clamp=True, p=1.0, bound=float(param))
    raise ValueError(f"kind must be 'l1', 'linf', 'lp' or 'ksparse', got {kind!r}")


# The next step's scale stays within 1 +- NORM_SCALE_BAND u: one step's rounding moves a norm by less than 8u
# (docs/feasibility.md); a ratio beyond that comes from underflowed powers or from values changed between steps.
NORM_SCALE_BAND = 16


def next_norm_scale(stored: float, exact: float, bound: float, p: float, cdt: torch.dtype) -> float:
    """The scale the next step applies to a ball's theta: (min(exact, bound) / stored)^(1/p), within
    1 +- NORM_SCALE_BAND u (u of cdt); 1 when ``stored`` is 0 or either sum is not finite. ``stored`` and ``exact``
    are the ball's sums of |theta_i| in norm_units (p = 1; ``bound`` in units) or of (|theta_i| / r)^p in float64
    (p > 1; ``bound`` = 1): of the values the step stored and of its exact (float64) values."""
    if not (math.isfinite(stored) and math.isfinite(exact) and stored > 0):
        return 1.0
    ratio = min(exact, bound) / stored
    scale = ratio if p == 1.0 else math.pow(ratio, 1.0 / p)
    band = NORM_SCALE_BAND * torch.finfo(cdt).eps / 2
    return min(max(scale, 1.0 - band), 1.0 + band)


def _at_most(x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """x with every element held within [-bound, bound] (NaN stays NaN)."""
    return torch.where(x > bound, bound, torch.where(x < -bound, -bound, x))


def radius_down(radius: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """The radius (float64) rounded down to cdt: the largest value of cdt that is <= r."""
    rounded = radius.to(cdt)
    return torch.where(rounded.double() > radius, torch.nextafter(rounded, torch.zeros_like(rounded)), rounded)


def dense_update(theta: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor,
                 radius: torch.Tensor, clamp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One dense step of elements: (theta_new in theta's dtype, the compute dtype; the exact step in float64).
    ``theta`` as stored, ``s`` the vertex, ``alpha`` (the step), ``scale`` (the norm feedback's, 1 without) and
    ``radius`` per element in float64 (see Feasibility):

        t = RN(scale theta);  s' = RN(s) (held within +-R);  theta_new = RN(t + RN(RN(alpha) RN(s' - t)))
        (held within +-R),    exact = scale theta + alpha (s - scale theta) (held within +-r)
    """
    cdt = theta.dtype
    scaled_exact = scale * theta.double()
    scaled = scaled_exact.to(cdt)
    vertex = s.to(cdt)
    exact = scaled_exact + alpha * (s - scaled_exact)
    if clamp:
        bound = radius_down(radius, cdt)
        vertex = _at_most(vertex, bound)
    new = scaled + alpha.to(cdt) * (vertex - scaled)
    if clamp:
        new = _at_most(new, bound)
        exact = _at_most(exact, radius)
    return new, exact


def fw_step_(vertex: Callable[[torch.Tensor, float, tuple[int, ...]], torch.Tensor], params: Sequence[torch.Tensor],
             momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], schedule: torch.Tensor,
             tangent_coeffs: torch.Tensor, radii: Sequence[float], global_ball: bool, offsets: Sequence[int], seed: int,
             distribution: int, gap: torch.Tensor, row_numel: Sequence[int] = (), shrink: bool = True,
             rescale: str | None = None,
             l2_diameter: Callable[[tuple[int, ...], float], float] | None = None,
             row_vertices: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             feasibility: Feasibility | None = None, scales: Sequence[torch.Tensor] = (),
             gauge_parts: Callable | None = None,
             row_gauges: Callable[[torch.Tensor], torch.Tensor] | None = None,
             batch_vertices: Callable | None = None) -> None:
    """One Frank-Wolfe step over the balls of any set, in place: :func:`l1_fw_step_` with the L1 LMO replaced
    by ``vertex(d_ball, r, shape)``, which returns the dense vertex ``argmin_{s in C_r} <d_ball, s>`` of one
    ball (``d_ball`` flat in the compute dtype, ``shape`` the ball's shape: the tensor's for scope
    "tensor", ``(n,)`` for a row or the global ball). Directions, momentum, balls, radii and the gap
    <d, theta - s> are the L1 step's.

    The vertex is computed from the direction in float64 (a float32 direction is exact in float64); the gap uses
    that vertex, the update its rounding to the compute dtype. The update:

    * ``feasibility`` given (the L-infinity, Lp and k-sparse sets, and the L1 ball stepped densely): dense_update,
      with ``scales`` the norm feedback's state when ``feasibility.p`` is set: empty (no feedback: each step
      scales by 1), or one float64 tensor per parameter holding one scale per ball of it (one tensor of one
      element for the global ball), read before the update and written after it (next_norm_scale).
    * else ``gauge_parts`` given (``shrink=True``; the non-negative L1, group-L1 and column-norm balls, whose gauges
      are cheap, positively homogeneous and non-decreasing in every |theta_i|): theta + alpha (s - theta), then
      every ball whose stored gauge (``gauge_parts(x, shape)``, Constraint.gauge_parts; ``row_gauges(rows)`` for
      all rows of a tensor at once) exceeds r is scaled back inside (correct_by_gauge_): a correction of a few ulps where rounding
      crossed the boundary, not a shrink at every step, so no error floor.
    * else ``shrink=True``: keep theta + alpha_vertex s with both factors carrying kappa (feasibility_shrink), for
      the sets without a cheap gauge (nuclear- and spectral-norm balls).
    * ``shrink=False`` (the simplex, ``Constraint.SHRINK_STEP``: its sum theta = r is an equality that kappa
      would pull the iterate off): theta + alpha (s - theta), without kappa: it keeps sum theta = r up to
      rounding for any alpha.

    ``row_vertices(d_rows, radii)`` (optional, a set's batched vertex): the row balls of each tensor are
    computed at once, (rows, n) in one call, instead of one ``vertex`` call per row.

    ``batch_vertices(directions, radii, shapes)`` (optional, tensor and row scopes without ``row_vertices``): the
    vertices of all balls in one call, a list in ball order, each what ``vertex`` would give to the stated accuracy
    (SpectralNormBall: one batched Newton-Schulz per matrix shape instead of one per matrix).

    ``rescale`` gives each ball its own step, computed in float64 from alpha = alpha_k (RESCALES):
    ``"diameter"``: ``min(alpha / D, 1)`` with D = ``l2_diameter(shape, r)`` the ball's L2 diameter (a
    step then moves theta by at most alpha in L2, whatever the set's size); ``"gradient"``:
    ``min(alpha ||d|| / ||theta - s||, 1)`` over the ball (the step's length is alpha ||d||, as SGD's with
    learning rate alpha, until it reaches the vertex). A degenerate ball (D = 0, or theta = s) keeps alpha.
    """
    alpha, balls, directions = _directions(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball,
                                           offsets, seed, distribution, row_numel)
    if directions is None:  # a skipped step
        gap.fill_(math.nan)
        return
    # the vertex of every ball, at the old theta, in float64 (before, a float32 ball's vertex was rounded to
    # float32 before the gap used it: the gap missed the L1 step's, r |d_i*| with r exact, by ~1e-8 relative;
    # the global ball was computed in float64 already)
    vertices = [torch.zeros(d.numel(), dtype=torch.float64, device=d.device) for d in directions]
    if global_ball:
        live = [t for t, d in enumerate(directions) if d.numel()]
        if live:
            d_all = torch.cat([directions[t].double() for t in live])
            s_all = vertex(d_all, radii[0], (d_all.numel(),))
            at = 0
            for t in live:
                n = directions[t].numel()
                vertices[t] = s_all[at:at + n]
                at += n
    elif row_vertices is not None and row_numel and any(row_numel):
        # the row balls of a tensor at once (row_vertices: one batched computation instead of one per row)
        at = 0
        counts = balls_per_tensor(balls, len(params))
        for t, p in enumerate(params):
            count = counts[t]
            n = row_numel[t]
            if n and p.numel():
                rows = directions[t].double().reshape(-1, n)
                r_rows = torch.tensor(list(radii[at:at + count]), dtype=torch.float64, device=rows.device)
                vertices[t] = row_vertices(rows, r_rows).reshape(-1)
            elif p.numel():
                vertices[t] = vertex(directions[t].double(), radii[at], tuple(p.shape))
            at += count
    else:
        todo = []  # (t, start, length, r, shape) of every non-empty ball
        for (t, start, length), r in zip(balls, radii):
            if length:
                shape = (length,) if length != params[t].numel() or (row_numel and row_numel[t]) \
                    else tuple(params[t].shape)
                todo.append((t, start, length, r, shape))
        if batch_vertices is not None and todo:
            # every ball in one call: the set batches what it can (the spectral ball: one Newton-Schulz per shape)
            found = batch_vertices([directions[t][start:start + length].double() for t, start, length, _, _ in todo],
                                   [r for *_, r, _ in todo], [shape for *_, shape in todo])
            for (t, start, length, _, _), s_ball in zip(todo, found):
                vertices[t][start:start + length] = s_ball
        else:
            for t, start, length, r, shape in todo:
                vertices[t][start:start + length] = vertex(directions[t][start:start + length].double(), r, shape)
    steps = None if rescale is None else _rescaled_steps(rescale, alpha, params, directions, vertices, balls, radii,
                                                         global_ball, row_numel, l2_diameter)
    feedback = feasibility is not None and feasibility.p is not None and len(scales) > 0
    if feasibility is not None:
        ball_of, ball_scale = _ball_elements(params, balls, global_ball, scales if feedback else ())
        ball_radius = [float(r) for r in radii]
        # the norm feedback's terms of each tensor: p = 1, units on the grid of the bound (bound r); p > 1,
        # (|x| / r)^p; of the values stored and of the exact step
        stored_terms, exact_terms = [None] * len(params), [None] * len(params)
        if feedback and feasibility.p == 1.0:
            exponents = [norm_grid_exponent(feasibility.bound * r) for r in ball_radius]
    total_gap = 0.0
    for t, p in enumerate(params):
        cdt = compute_dtype(p.dtype)
        d, s64 = directions[t], vertices[t]
        theta = p.reshape(-1).to(cdt)
        total_gap += float((d.double() * (theta.double() - s64)).sum())
        if feasibility is not None:
            balls_t = ball_of[t]
            radius = torch.tensor(ball_radius, dtype=torch.float64, device=p.device)[balls_t]
            alpha_t = torch.full_like(s64, alpha) if steps is None else steps[t]
            scale = ball_scale.to(p.device)[balls_t]
            new, exact = dense_update(theta, s64, alpha_t, scale, radius, feasibility.clamp)
            p.copy_(new.reshape(p.shape).to(p.dtype))
            if feedback:
                stored = p.reshape(-1).double()
                if feasibility.p == 1.0:
                    element_exponent = torch.tensor(exponents, dtype=torch.int64, device=p.device)[balls_t]
                    stored_terms[t], exact_terms[t] = (norm_units(x, element_exponent) for x in (stored, exact))
                else:
                    stored_terms[t], exact_terms[t] = ((x.abs() / radius) ** feasibility.p for x in (stored, exact))
            continue
        s_t = s64.to(cdt)
        a = torch.tensor(alpha, dtype=cdt) if steps is None else steps[t].to(cdt)  # a step per element
        if shrink and gauge_parts is None:
            kappa = torch.tensor(feasibility_shrink(cdt), dtype=cdt)
            new = (1 - a) * kappa * theta + a * kappa * s_t  # per element where rescaled
        elif shrink:
            # (1 - a) theta + a s, not theta + a (s - theta): near the optimum s_i - theta_i is small, and a move
            # a (s_i - theta_i) below half an ulp of theta_i is lost every step (a stall that grows with 1 / a:
            # float32 FW on a column-norm ball stalled 1.6e-5 relative above float64 after 2,000 steps; on the
            # fused L2 step the other form measured no better, so dense_update keeps it: docs/feasibility.md)
            new = (1 - a) * theta + a * s_t
        else:
            new = theta + a * (s_t - theta)
        p.copy_(new.reshape(p.shape).to(p.dtype))
    if feasibility is None and shrink and gauge_parts is not None:
        correct_by_gauge_(params, balls, radii, global_ball, row_numel, gauge_parts, row_gauges)
    if feedback:
        cdt = compute_dtype(params[0].dtype)
        integer = feasibility.p == 1.0
        sums = [_ball_sums(terms, balls, global_ball, integer) for terms in (stored_terms, exact_terms)]
        for b, r in enumerate(ball_radius):
            if integer:
                # a capped units sum counts as infinite: next_norm_scale leaves the ball's scale at 1
                stored, exact = (float(x[b]) if x[b] < NORM_SUM_CAP else math.inf for x in sums)
                bound = feasibility.bound * r * math.ldexp(1.0, NORM_GRID_BITS - exponents[b])
            else:
                stored, exact = sums[0][b], sums[1][b]
                bound = feasibility.bound ** feasibility.p
            ball_scale[b] = next_norm_scale(stored, exact, bound, feasibility.p, cdt)
        _write_scales(scales, ball_scale, params, balls, global_ball)
    gap.fill_(total_gap)


# correct_by_gauge_ scales a ball at most this many times (each pass brings the gauge within ~2u of r from below;
# a second pass is needed only when the float64 evaluation of the gauge itself was off by more than that)
GAUGE_CORRECTION_PASSES = 4


def correct_by_gauge_(params: Sequence[torch.Tensor], balls, radii: Sequence[float], global_ball: bool,
                      row_numel: Sequence[int], gauge_parts: Callable,
                      row_gauges: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Scale every ball whose stored gauge g exceeds its radius r by c = (r / g)(1 - 3u), rounded toward 0 to the
    compute dtype (u its unit roundoff), in place, until the gauge as evaluated in float64 is <= r. A product of
    balls (``gauge_parts`` gives one gauge per factor: the column-norm ball's columns) scales each factor alone.

    For a gauge that is positively homogeneous and non-decreasing in every |x_i| (the sets that use this), each
    stored RN(c x_i) is at most (1 + u) c |x_i|, so the new gauge is at most (1 + u)(1 - 3u) r < r: one pass
    suffices up to the float64 evaluation of g, which further passes (at most GAUGE_CORRECTION_PASSES) absorb.
    A ball inside its set is left alone, so an iterate on the boundary moves by ~3u where rounding pushes it out
    and by nothing otherwise: the deficit is reset, not accumulated, and there is no error floor growing with the
    step count, unlike the shrink by kappa (scaling a whole product of balls by its largest factor would bring
    that floor back: every other factor would lose 3u at every correction)."""
    def factor(g: torch.Tensor, r: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
        u = torch.finfo(cdt).eps / 2
        return radius_down(torch.where(g > r, r / g * (1 - 3 * u), torch.ones_like(g)), cdt)

    # the units corrected together: (segments, radii per part, parts(x, shape) -> (gauges, part of each element))
    units = []
    if global_ball:
        units.append(([(t, 0, p.numel()) for t, p in enumerate(params) if p.numel()], radii[0], gauge_parts))
    else:
        at = 0
        counts = balls_per_tensor(balls, len(params))
        for t, p in enumerate(params):
            count = counts[t]
            n = row_numel[t] if row_numel else 0
            if row_gauges is not None and n and p.numel():  # the row balls of a tensor at once
                index = torch.arange(p.numel()) // n
                units.append(([(t, 0, p.numel())], [float(r) for r in radii[at:at + count]],
                              lambda x, shape, n=n, index=index: (row_gauges(x.reshape(-1, n)).cpu(), index)))
            else:
                units += [([(t, start, length)], r, gauge_parts)
                          for (_, start, length), r in zip(balls[at:at + count], radii[at:at + count]) if length]
            at += count
    for segments, r, parts in units:
        r64 = torch.tensor(r, dtype=torch.float64)
        for _ in range(GAUGE_CORRECTION_PASSES):
            if len(segments) == 1:
                t, start, length = segments[0]
                whole = length == params[t].numel() and not (row_numel and row_numel[t])
                shape = tuple(params[t].shape) if whole else (length,)
                x = params[t].reshape(-1)[start:start + length].double()
            else:
                x = torch.cat([params[t].reshape(-1).double() for t, _, _ in segments])
                shape = (x.numel(),)
            g, index = parts(x, shape)
            if not bool((g > r64).any()):  # inside (NaN compares False: nothing to scale back)
                break
            at = 0
            for t, start, length in segments:
                cdt = compute_dtype(params[t].dtype)
                c = factor(g, r64, cdt)
                c = c if index is None else c[index[at:at + length]]
                view = params[t].reshape(-1)[start:start + length]
                view.copy_((view.to(cdt) * c.to(view.device)).to(params[t].dtype))
                at += length


def _ball_sums(terms: list[torch.Tensor], balls, global_ball: bool, integer: bool) -> list:
    """Each ball's sum of its elements' terms (one tensor of terms per parameter, flat): norm_sums for integer
    units, float64 sums otherwise; as Python numbers, in ball order (one for the global ball)."""
    def total(x: torch.Tensor) -> torch.Tensor:
        return norm_sums(x) if integer else x.sum(dim=-1)

    if global_ball:
        return [total(torch.cat([x.cpu() for x in terms])).item()]
    out = []
    counts = balls_per_tensor(balls, len(terms))
    for t, x in enumerate(terms):
        count = counts[t]
        if count:
            out.extend(total(x.cpu().reshape(count, -1)).tolist())
    return out


def _ball_elements(params, balls, global_ball: bool, scales) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per tensor, the ball of each element (an index into radii; 0 for the global ball), and each ball's scale
    read from ``scales`` (1 where it is empty), as a float64 tensor on the CPU."""
    count = 1 if global_ball else len(balls)
    if global_ball:
        ball_of = [torch.zeros(p.numel(), dtype=torch.int64, device=p.device) for p in params]
    else:  # ball_layout: a tensor's balls tile it in order, so each element's ball is a run of its index
        ball_of, first = [], 0
        for p, held in zip(params, balls_per_tensor(balls, len(params))):
            ids = torch.arange(first, first + held, device=p.device)
            ball_of.append(ids.repeat_interleave(p.numel() // held) if held else
                           torch.zeros(0, dtype=torch.int64, device=p.device))
            first += held
    scale = torch.ones(count, dtype=torch.float64)
    if scales:
        _check_scales(scales, params, balls, global_ball)
        scale = scales[0].detach().double().cpu().reshape(1) if global_ball else \
            torch.cat([x.detach().double().cpu().reshape(-1) for x in scales])
    return ball_of, scale.clone()


def _check_scales(scales, params, balls, global_ball: bool) -> None:
    if global_ball:
        ok = len(scales) == 1 and scales[0].numel() == 1
        want = "one tensor of one element for the global ball"
    else:
        counts = balls_per_tensor(balls, len(params))
        ok = len(scales) == len(params) and all(x.numel() == c for x, c in zip(scales, counts))
        want = f"one tensor per parameter with one scale per ball of it ({counts})"
    if not ok or any(x.dtype != torch.float64 for x in scales):
        raise ValueError(f"scales must be empty or {want}, float64, got "
                         f"{[(tuple(x.shape), x.dtype) for x in scales]}")


def _write_scales(scales, ball_scale: torch.Tensor, params, balls, global_ball: bool) -> None:
    """The next scales into ``scales``, but for empty balls (no element: their scale is left as it was)."""
    if global_ball:
        if any(p.numel() for p in params):
            scales[0].fill_(float(ball_scale[0]))
        return
    at = 0
    for t, x in enumerate(scales):
        if params[t].numel():
            x.copy_(ball_scale[at:at + x.numel()].reshape(x.shape))
        at += x.numel()


def linf_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: Sequence[float], global_ball: bool,
                  offsets: Sequence[int], seed: int, distribution: int, gap: torch.Tensor,
                  row_numel: Sequence[int] = ()) -> None:
    """One Frank-Wolfe step over L-infinity ball(s), in place: :func:`fw_step_` with the vertex
    ``-r sign(d)`` of every ball, every element held within +-R (the spec of the fused ``linf_fw_step_`` kernel:
    one pass, the vertex is elementwise; ``constraints.LInfBall.vertex``)."""
    fw_step_(lambda d, r, shape: -r * torch.sign(d), params, momentum, grads, schedule, tangent_coeffs, radii,
             global_ball, offsets, seed, distribution, gap, row_numel, feasibility=set_feasibility("linf"))


def _unit_max(d: torch.Tensor) -> torch.Tensor:
    """d in float64 divided by max |d_i| (d itself when that is 0 or d is empty): entries in [-1, 1], one of
    them +-1, so that norms and powers of it neither underflow nor overflow; the vertices below are invariant
    to a positive scale of d."""
    d64 = d.double()
    scale = d64.abs().max() if d64.numel() else None
    return d64 / scale if scale is not None and scale > 0 else d64


def lp_vertex(d: torch.Tensor, radius: float, p: float) -> torch.Tensor:
    """``argmin_{||s||_p <= r} <d, s>`` for 1 < p < inf (p = 2: the L2 ball), flat, in d's dtype:
    ``s_i = -r sign(d_i) (x_i / ||x||_q)^(q-1)`` with ``x = |d| / max|d|`` in float64 and 1/p + 1/q = 1
    (equality in Hoelder's inequality; 0 for d = 0). Dividing by max|d| first keeps ``x_i^q`` finite: for
    p = 1.01, q = 101, and any |d_i| > 1e3 overflowed. The spec of the fused ``lp_fw_step_``."""
    q = p / (p - 1)  # 2.0 exactly for p = 2, and pow(y, 1.0) = y: the L2 vertex -r d / ||d||_2
    x = _unit_max(d)
    norm_q = torch.linalg.vector_norm(x, ord=q)  # in [1, n^(1/q)]
    if norm_q == 0:
        return torch.zeros_like(d)
    return (-radius * torch.sign(x) * (x.abs() / norm_q).pow(q - 1)).to(d.dtype)


def magnitude_order(d: torch.Tensor) -> torch.Tensor:
    """The order of |d| the k-sparse vertex ranks by, as int64 keys: the bits of |d_i| in float64 (the same
    order as |d_i|, with every NaN above +inf, as the kernels compare them), taken along the last dim."""
    return d.double().view(torch.int64) & 0x7FFFFFFFFFFFFFFF


def ksparse_vertex(d: torch.Tensor, radius: float, k: int) -> torch.Tensor:
    """``argmin <d, s>`` over the k-sparse polytope of radius r (``||s||_inf <= r, ||s||_1 <= k r``), flat, in
    d's dtype: ``-r sign(d_i)`` on the k largest |d_i| (ties: the lowest indices; NaN counted largest, as
    the L1 step's argmax), 0 elsewhere. All of d when it has at most k elements. The spec of the fused
    ``ksparse_fw_step_``."""
    k = min(k, d.numel())
    # a stable descending sort of the keys: equal magnitudes keep their index order
    chosen = torch.sort(magnitude_order(d), descending=True, stable=True).indices[:k]
    s = torch.zeros_like(d)
    s[chosen] = -radius * torch.sign(d[chosen])
    return s


def lp_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                schedule: torch.Tensor, tangent_coeffs: torch.Tensor, radii: Sequence[float], global_ball: bool,
                offsets: Sequence[int], seed: int, distribution: int, gap: torch.Tensor, row_numel: Sequence[int] = (),
                p: float = 2.0, scales: Sequence[torch.Tensor] = ()) -> None:
    """One Frank-Wolfe step over Lp ball(s), 1 < p < inf: :func:`fw_step_` with :func:`lp_vertex` and the norm
    feedback on ||theta||_p <= r through ``scales`` (the spec of the fused ``lp_fw_step_`` kernels: a reduction
    pass for max|d| and ||d/max|d| ||_q per ball, then the update pass, which also sums the norms)."""
    if not 1 < p < float("inf"):
        raise ValueError(f"p must satisfy 1 < p < inf, got {p}")
    fw_step_(lambda d, r, shape: lp_vertex(d, r, p), params, momentum, grads, schedule, tangent_coeffs, radii,
             global_ball, offsets, seed, distribution, gap, row_numel, feasibility=set_feasibility("lp", p),
             scales=scales)


def ksparse_fw_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                     grads: Sequence[torch.Tensor], schedule: torch.Tensor, tangent_coeffs: torch.Tensor,
                     radii: Sequence[float], global_ball: bool, offsets: Sequence[int], seed: int, distribution: int,
                     gap: torch.Tensor, row_numel: Sequence[int] = (), k: int = 1,
                     scales: Sequence[torch.Tensor] = ()) -> None:
    """One Frank-Wolfe step over k-sparse polytope(s): :func:`fw_step_` with :func:`ksparse_vertex`, every element
    held within +-R and the norm feedback on ||theta||_1 <= k r through ``scales`` (the spec of the fused
    ``ksparse_fw_step_`` kernels: a selection of the k-th largest |d| per ball, then the update pass)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    fw_step_(lambda d, r, shape: ksparse_vertex(d, r, k), params, momentum, grads, schedule, tangent_coeffs, radii,
             global_ball, offsets, seed, distribution, gap, row_numel, feasibility=set_feasibility("ksparse", k),
             scales=scales)


RESCALES = ("diameter", "gradient")


def _rescaled_steps(rescale: str, alpha: float, params, directions, vertices, balls, radii, global_ball: bool,
                    row_numel, l2_diameter) -> list[torch.Tensor]:
    """fw_step_'s step of every element (float64, per tensor): each ball's rescaled alpha (see fw_step_). The balls of
    a tensor are computed together (its rows as one (rows, n) array), on its device, with no host read."""
    if rescale not in RESCALES:
        raise ValueError(f"rescale must be None or one of {RESCALES}, got {rescale!r}")
    if rescale == "diameter" and l2_diameter is None:
        raise ValueError("rescale='diameter' needs the set's l2_diameter")

    def ball_steps(d: torch.Tensor, theta: torch.Tensor, s: torch.Tensor, shape, rs: list) -> torch.Tensor:
        """The step of each ball of one tensor (or of the global ball): ``d``, ``theta`` and ``s`` float64, one row
        per ball (shape: a ball's shape), ``rs`` their radii."""
        if rescale == "diameter":
            diameters = [l2_diameter(shape, r) for r in rs]
            return torch.tensor([min(alpha / D, 1.0) if D > 0 else alpha for D in diameters], dtype=torch.float64,
                                device=d.device)
        distance = torch.linalg.vector_norm(theta - s, dim=1)
        step = torch.clamp_max(alpha * torch.linalg.vector_norm(d, dim=1) / distance, 1.0)
        return torch.where(distance > 0, step, alpha)  # a degenerate ball (theta = s) keeps alpha

    if global_ball:
        steps = [torch.full((d.numel(),), alpha, dtype=torch.float64, device=d.device) for d in directions]
        live = [t for t, d in enumerate(directions) if d.numel()]
        if live:
            cat = lambda xs: torch.cat([xs[t].double().reshape(-1).to(directions[live[0]].device)  # noqa: E731
                                        for t in live]).reshape(1, -1)
            a = ball_steps(cat(directions), cat([p.detach() for p in params]), cat(vertices),
                           (sum(directions[t].numel() for t in live),), [radii[0]])
            for t in live:
                steps[t].copy_(a.expand(steps[t].numel()))
        return steps
    steps = []
    at = 0
    counts = balls_per_tensor(balls, len(params))  # ball_layout: a tensor's balls tile it in order
    for t, (p, d) in enumerate(zip(params, directions)):
        count = counts[t]
        n = d.numel() // count if count else 0
        if n == 0:
            steps.append(torch.full((d.numel(),), alpha, dtype=torch.float64, device=d.device))
        else:
            shape = (n,) if count > 1 or (row_numel and row_numel[t]) else tuple(p.shape)
            rows = lambda x: x.double().reshape(count, n)  # noqa: E731
            per_ball = ball_steps(rows(d), rows(p.detach()), rows(vertices[t]), shape, list(radii[at:at + count]))
            steps.append(per_ball.repeat_interleave(n))
        at += count
    return steps


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite: one isfinite reduction per tensor (nothing is summed,
    so no finite tensor can overflow, as a float16 norm would above 65504), the verdicts gathered on the
    first tensor's device, one host synchronisation."""
    if not tensors:
        return True
    device = tensors[0].device
    return bool(torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all())


def balls_per_tensor(balls, count: int) -> list[int]:
    """How many of ``balls`` (ball_layout's (tensor, start, length)) each of ``count`` tensors holds."""
    counts = [0] * count
    for ball in balls:
        counts[ball[0]] += 1
    return counts


def ball_layout(numels: Sequence[int], global_ball: bool, row_numel: Sequence[int] = ()) -> list[tuple[int, int, int]]:
    """The balls of a step as (tensor, first element, length), in the order of their radii.

    Not for the global ball, which is every tensor at once: it returns one ball per tensor then (the
    order the kernels reduce in). Raises ``ValueError`` for a ``row_numel`` that does not fit.
    """
    if row_numel and len(row_numel) != len(numels):
        raise ValueError(f"row_numel must be empty or hold one row length per parameter ({len(numels)}), "
                         f"got {len(row_numel)}")
    if global_ball and any(row_numel):
        raise ValueError("row_numel must be all 0 for the global ball (one ball over every tensor)")
    balls = []
    for t, numel in enumerate(numels):
        n = row_numel[t] if row_numel else 0
        if n < 0 or (n > 0 and numel % n):
            raise ValueError(f"row_numel[{t}] must be 0 (one ball) or a row length that divides the "
                             f"{numel} elements of params[{t}], got {n}")
        if n == 0:
            balls.append((t, 0, numel))
        else:
            balls.extend((t, start, n) for start in range(0, numel, n))
    return balls


def l1_lmo(direction: torch.Tensor, radius: float) -> torch.Tensor:
    """Dense vertex s = argmin_{||s||_1 <= r} <direction, s> = -r sign(d_i*) e_i*. For tests and docs."""
    s = torch.zeros_like(direction)
    flat = direction.reshape(-1)
    if flat.numel():
        i = int(torch.argmax(flat.abs()))
        s.view(-1)[i] = -radius * torch.sign(flat[i])
    return s


def gradient_step_(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   schedule: torch.Tensor, tangent_coeffs: torch.Tensor | None = None, offsets: Sequence[int] = (),
                   seed: int = 0, distribution: int = 0) -> None:
    """The step of an unconstrained param group (``constraint=None``), in place: the direction d of
    :func:`l1_fw_step_` (the gradient or forward-gradient estimate, through the momentum when there is one),
    then ``theta <- theta - alpha_k d`` in the compute dtype: (stochastic) gradient descent with the group's
    step size as its learning rate. It has no vertex and adds nothing to the Frank-Wolfe gap."""
    alpha, _, directions = _directions(params, momentum, grads, schedule, tangent_coeffs, [1.0] * len(params), False,
                                       offsets, seed, distribution, ())
    if directions is None:  # a skipped step
        return
    for p, d in zip(params, directions):
        cdt = compute_dtype(p.dtype)
        theta = p.reshape(-1).to(cdt)
        p.copy_((theta - torch.tensor(alpha, dtype=cdt) * d).reshape(p.shape).to(p.dtype))
