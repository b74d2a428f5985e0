"""Constraint sets and their linear minimisation oracles (LMOs).

A constraint is one verb for the algorithms: the vertex ``argmin_{s in C} <d, s>`` of each of its balls.
Every set here is applied per ball: one per parameter tensor (scope "tensor"), one per row of every
matrix (scope "row"), or one over all parameters of a param group (scope "global"), each with its own
radius. The L1 ball has fused kernels (CPU, CUDA, Triton) that never build the vertex; the L-infinity, L2,
Lp and k-sparse sets have fused ops of their own (:meth:`Constraint.fused_step`, docs/set_steps.md) where
the backend has them; the other sets step through :func:`fgfw.reference.fw_step_` with their dense vertex
(torch ops).

| set | vertex of a ball of radius r for the direction d | scopes |
|---|---|---|
| :class:`L1Ball` | ``-r sign(d_i) e_i``, i = argmax abs(d_i) | tensor, row, global |
| :class:`L2Ball` | ``-r d / ||d||_2`` | tensor, row, global |
| :class:`LInfBall` | ``-r sign(d)`` | tensor, row, global |
| :class:`LpBall` | ``-r sign(d) abs(d)^(q-1) / ||d||_q^(q-1)``, 1/p + 1/q = 1 | tensor, row, global |
| :class:`KSparsePolytope` | ``-r sign(d_i)`` on the k largest abs(d_i), 0 elsewhere | tensor, row, global |
| :class:`Simplex` | ``r e_i``, i = argmin d_i (``{s >= 0, sum s = r}``) | tensor, row, global |
| :class:`NonnegativeL1Ball` | ``r e_i`` if min d_i < 0, else 0 (``{s >= 0, sum s <= r}``) | tensor, row, global |
| :class:`NuclearNormBall` | ``-r u_1 v_1^T``, the top singular pair of the matrix d | tensor (matrices) |
| :class:`GroupL1Ball` | ``-r d_i / ||d_i||_2`` on the row i of largest ``||d_i||_2`` | tensor (matrices) |

Ties go to the lowest index, as in the L1 kernels. Radii: explicit, ``relative_to_init(scale)`` (scale
times the set's gauge of the initial parameters: its norm, or the sum for the simplices), or
``from_init_diameter(scale)``: the radius whose ball has the L2 diameter 2 scale E||theta_0||_2 of the
tensor's own initial values, the rule that makes every set equally large (see :meth:`_Ball.l2_diameter`).
A ball whose initial values are all zero (biases, normalisation shifts) takes the rule's value on
draws of its module's own initialisation, else on a stand-in of unit L2 norm (see
:meth:`Constraint.resolve_radii`).
"""
from __future__ import annotations

import math
import sys
import warnings
import weakref
from typing import Callable, Sequence

import torch
from torch import nn

from . import reference

SCOPES = ("tensor", "global", "row")
KIND_L1_BALL = "l1_ball"
# how radius-less balls get their radii from the initial parameters (see _Ball.resolve_radii)
RULES = ("relative_to_init", "init_diameter", "operator_norm")


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised by the caller that points at the first frame outside fgfw and
    torch.optim (the user's line that built the optimizer)."""
    frame, level = sys._getframe(1), 1  # the warning's caller is stacklevel 1
    # torch.utils._contextlib: the no_grad decorator around a step
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("fgfw.", "torch.optim",
                                                                                  "torch.utils._contextlib")):
        frame, level = frame.f_back, level + 1
    return level


def _check_radius(radius, name: str = "radius") -> float:
    if isinstance(radius, bool) or not isinstance(radius, (int, float)):
        raise TypeError(f"{name} must be a positive real number, got {type(radius).__name__} {radius!r}")
    if not math.isfinite(radius) or radius <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {radius!r}")
    return float(radius)


def _unit_max_rows(d: torch.Tensor) -> torch.Tensor:
    """_unit_max of every row of the (B, n) tensor d."""
    d64 = d.double()
    if not d64.numel():
        return d64
    scale = d64.abs().amax(dim=1, keepdim=True)
    return d64 / torch.where(scale > 0, scale, 1.0)


_unit_max = reference._unit_max  # d / max|d_i| in float64 (one definition, the reference's)

# Rows up to this many elements have their norms taken in one reduction per tensor (resolve_radii, make_feasible_),
# which gives each row the same bits as reducing it alone; a longer row is reduced alone, as before: torch splits
# a 1-D reduction that long across threads (at::internal::GRAIN_SIZE), which can change its last bits.
ROW_BATCH_MAX = 32768
# ... and the rows of a tensor are taken a block of about this many elements at a time, so that their float64
# copies stay small beside a large embedding (a row's result does not depend on the block it is in).
ROW_BLOCK_ELEMENTS = 1 << 22

# Each registered parameter's module (the one that holds it directly), for the radius rules of balls that
# start at zero (Constraint.resolve_radii): filled by the optimizers that are given a module and by
# fgfw.param_groups. id(parameter) -> (weak parameter, weak module): registering a model keeps none of it
# alive (a WeakKeyDictionary would compare tensors with ==, elementwise).
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
# Draws of a module's initialisation averaged by the radius rule of a ball that starts at zero.
INIT_DRAWS = 4


def register_modules(module: nn.Module) -> None:
    """Records which module holds each parameter of ``module``, so that the radius rules can draw a
    zero-initialised parameter's expected initial values from its module's ``reset_parameters``."""
    for m in module.modules():
        for p in m.parameters(recurse=False):
            key = id(p)
            _OWNERS[key] = (weakref.ref(p, lambda _, key=key: _OWNERS.pop(key, None)), weakref.ref(m))


def _owner(p: torch.Tensor) -> nn.Module | None:
    entry = _OWNERS.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


def init_draws(p: torch.Tensor) -> list[torch.Tensor]:
    """``INIT_DRAWS`` draws of ``p`` as its module's ``reset_parameters`` makes it (float64, on the CPU), or []
    when no module with ``reset_parameters`` is registered for ``p`` or the reset fails.

    The module is left as it was: the reset writes into stand-ins of its own parameters and buffers (a
    BatchNorm's reset also zeroes its running statistics), and the CPU generator is forked and seeded
    (the draws are the same on every run and the caller's random stream is untouched)."""
    module = _owner(p)
    reset = getattr(module, "reset_parameters", None)
    name = None if module is None else next((n for n, q in module._parameters.items() if q is p), None)
    if name is None or not callable(reset):
        return []
    own_params, own_buffers = module._parameters, module._buffers
    draws = []
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.random.default_generator.manual_seed(0)
            for _ in range(INIT_DRAWS):
                module._parameters = {n: None if q is None else nn.Parameter(torch.empty(q.shape, dtype=q.dtype),
                                                                            requires_grad=False)
                                      for n, q in own_params.items()}
                module._buffers = {n: None if b is None else b.detach().to("cpu", copy=True)
                                   for n, b in own_buffers.items()}
                reset()
                draws.append(module._parameters[name].detach().double())
    except Exception:  # noqa: BLE001  (a reset that cannot run on CPU stand-ins: the stated fallback applies)
        return []
    finally:
        module._parameters, module._buffers = own_params, own_buffers
    return draws


class Constraint:
    """A convex set applied per ball (see the module docstring); the base of every set.

    A subclass names its ``KIND`` (its ``to_dict`` tag), its ``NAME`` and ``GAUGE`` (for messages) and
    implements :meth:`gauge` (the norm whose ball of radius r is the set), :meth:`vertex` (the LMO of one
    ball) and :meth:`l2_diameter`; sets that are not norm balls (the simplices) also override
    :meth:`shrink_into_` and :meth:`contains`.

    Args:
        radius: the radius r > 0. Leave it out and use :meth:`relative_to_init` or
            :meth:`from_init_diameter` for a rule.
        scope: ``"tensor"`` (default): one ball per parameter tensor, each of radius r (a product of balls;
            the paper's "constraint on the parameters in all layers"). ``"global"``: one ball over all
            parameters of a param group together (one vertex per step for the whole group). ``"row"``:
            one ball per slice ``p[i]`` along the first dimension of every tensor of two or more
            dimensions (a neuron's incoming weights, a convolution's output filter), one per tensor
            for the others (biases): every unit gets a vertex step at every step.
    """

    KIND = ""
    NAME = "set"
    GAUGE = "norm"
    ALLOWED_SCOPES = SCOPES
    PARAMS: tuple[str, ...] = ()  # the set's own constructor keywords (saved by to_dict)
    # How reference.fw_step_ steps a set that has no reference.Feasibility (the L1, L-infinity, Lp and k-sparse
    # sets have one: docs/feasibility.md): True, keep it inside a set that holds 0, by CORRECTS_BY_GAUGE below or
    # else with the feasibility shrink kappa = 1 - 4u (reference.feasibility_shrink);
    # False, theta + alpha (s - theta) without kappa, for a set on the hyperplane sum theta = r (the simplex),
    # where kappa pulled the sum below r by (1 - kappa) / alpha relative
    SHRINK_STEP = True
    # True for a set without a Feasibility whose gauge is cheap, positively homogeneous and non-decreasing in every
    # |theta_i|: its torch-op step is the exact combination, scaled back only where rounding left the set
    # (reference.correct_by_gauge_, with gauge_parts and row_gauges), instead of the shrink by kappa
    CORRECTS_BY_GAUGE = False
    row_gauges = None  # optional: (rows, n) float64 -> (rows,) gauges, for the row scope's balls at once

    def gauge_parts(self, x: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gauges of one ball's values x (flat, float64; ``shape`` the ball's shape) as (gauges, index): one
        gauge and index None for a set that is one ball; for a product of balls (the column-norm ball's columns)
        one gauge per factor and the factor of each element, so that each is scaled back on its own."""
        return torch.tensor([self.gauge(x)], dtype=torch.float64), None

    def __init__(self, radius: float | None = None, *, scope: str = "tensor", _relative_scale: float | None = None,
                 _rule: str = "relative_to_init"):
        if scope not in self.ALLOWED_SCOPES:
            raise ValueError(f"scope must be one of {self.ALLOWED_SCOPES} for a {self.NAME}, got {scope!r}")
        if radius is None and _relative_scale is None:
            raise ValueError(f"radius is required: pass {type(self).__name__}(radius=r) with r > 0, or use "
                             f"{type(self).__name__}.relative_to_init(scale) to set it from the initial weights")
        if _rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {_rule!r}")
        self.radius = None if radius is None else _check_radius(radius)
        self.relative_scale = None if _relative_scale is None else _check_radius(_relative_scale, "scale")
        self.rule = _rule
        self.scope = scope

    @classmethod
    def relative_to_init(cls, scale: float = 1.0, *, scope: str = "tensor", **params) -> "Constraint":
        """A ball whose radius is ``scale`` times the set's gauge of the initial parameters.

        Per tensor (``scope="tensor"``: r_t = scale * gauge(theta_t^0)), per row (``"row"``) or over the
        group (``"global"``). Measured on the weights at optimizer construction; ``scale >= 1`` keeps a
        default initialisation feasible, so training starts from the dense initial point instead of a
        rescaled one.
        """
        return cls(None, scope=scope, _relative_scale=scale, **params)

    @classmethod
    def from_init_diameter(cls, scale: float = 1.0, *, scope: str = "tensor", **params) -> "Constraint":
        """A ball whose L2 diameter is ``2 scale ||theta^0||_2``, theta^0 the ball's initial values: the
        radius ``r = 2 scale ||theta^0||_2 / l2_diameter(shape, 1)``.

        The same rule gives every set the same L2 extent as the initialisation (an L2 ball of radius
        ``scale ||theta^0||_2``; an L-infinity ball of ``scale ||theta^0||_2 / sqrt(n)``; an L1 ball of
        ``scale ||theta^0||_2``, far below the initial L1 norm, so the start is rescaled into it). This is
        the diameter rule of other Frank-Wolfe libraries for networks, with the realised initial values in
        place of their expectation under the layer's default initialisation (equal in expectation, and
        right for any initialisation).
        """
        return cls(None, scope=scope, _relative_scale=scale, _rule="init_diameter", **params)

    def check(self) -> None:
        """Raises ``ValueError`` (or ``TypeError``) naming the setting unless the set's settings are valid, as its
        constructor would: they may have been changed on the object after it was built."""
        type(self)(self.radius, scope=self.scope, _relative_scale=self.relative_scale, _rule=self.rule,
                   **self._params())

    @property
    def global_ball(self) -> bool:
        return self.scope == "global"

    def _params_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        if self.radius is not None:
            size = f"radius={self.radius}"
        elif self.rule == "init_diameter":
            size = f"from_init_diameter={self.relative_scale}"
        elif self.rule == "operator_norm":
            size = f"operator_norm={self.relative_scale}"
        else:
            size = f"relative_to_init={self.relative_scale}"
        return f"{type(self).__name__}({self._params_repr()}{size}, scope={self.scope!r})"

    def _params(self) -> dict:
        """The set's own parameters (PARAMS: p, k, ...) as constructor keywords."""
        return {name: getattr(self, name) for name in self.PARAMS}

    def to_dict(self) -> dict:
        """The set as plain values, as an optimizer's ``state_dict`` saves it (``torch.load`` with its default
        ``weights_only=True`` reads them); :func:`from_dict` builds the set again."""
        out = {"kind": self.KIND, "radius": self.radius, "scope": self.scope, "relative_scale": self.relative_scale}
        if self.rule != "relative_to_init":
            out["rule"] = self.rule
        return dict(out, **self._params())

    # -- the set -----------------------------------------------------------------------------------------------
    def gauge(self, x: torch.Tensor) -> float:
        """The set's gauge of the flat float64 tensor x: x lies in the ball of radius r iff gauge(x) <= r."""
        raise NotImplementedError

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        """``argmin_{s in C_r} <d, s>`` for one ball: ``d`` flat, ``shape`` the ball's shape (the tensor's, or
        ``(n,)`` for a row or a global ball); returns a flat tensor of d's dtype. Ties: the lowest index."""
        raise NotImplementedError

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        """``max ||s - s'||_2`` over the ball of radius r (for :meth:`from_init_diameter`)."""
        raise NotImplementedError

    def exact_lmo(self, shape: tuple[int, ...]) -> bool:
        """Whether :meth:`vertex` is the exact minimiser (to rounding) for a ball of this shape, so that the
        Frank-Wolfe gap computed with it, ``<d, theta - s>``, is the true gap ``max_{s in C} <d, theta - s>``.
        Every set's is, except a large nuclear-norm ball's (:class:`NuclearNormBall`)."""
        return True

    def fused_step(self) -> tuple[str, float | int | None] | None:
        """The fused kernel that steps this set (a key of ``fgfw._ops.SET_STEPS`` and its parameter), or None
        for a set stepped in torch ops through :meth:`vertex` (the L1 ball has kernels of its own)."""
        return None

    def row_vertices(self, d: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        """The vertices of B balls of n elements at once (scope "row"): ``d`` of shape (B, n) in float64,
        ``radii`` of shape (B,); row b of the result is ``vertex(d[b], radii[b], (n,))`` (equal where no sum is
        taken, within rounding where a norm is). This default calls :meth:`vertex` per row; the sets
        override it with one batched computation (a 1024-wide layer has 1024 rows per step)."""
        return torch.stack([self.vertex(row, float(r), (row.numel(),)) for row, r in zip(d, radii.tolist())]) \
            if d.shape[0] else d.clone()

    def contains(self, x: torch.Tensor, radius: float, rtol: float = 1e-6) -> bool:
        """Whether x (any shape) lies in the ball of radius r, up to a relative tolerance."""
        return self.gauge(x.detach().reshape(-1).double()) <= radius * (1 + rtol)

    def norm(self, tensors: Sequence[torch.Tensor]) -> float:
        """The gauge of several tensors taken as one vector (a global ball)."""
        return self.gauge(torch.cat([t.detach().reshape(-1).double() for t in tensors]) if tensors
                          else torch.zeros(0, dtype=torch.float64))

    # optional: (B, n) float64 -> (B,) float64, norm([row]) of every row in one reduction (see row_norms)
    _batched_row_norms = None

    def row_norms(self, m: torch.Tensor) -> torch.Tensor:
        """``norm([row])`` of every row of the (B, n) float64 matrix ``m``, as a float64 tensor: in one reduction
        where the set has one (``_batched_row_norms``) and the rows are at most ROW_BATCH_MAX long, else a row
        at a time."""
        if self._batched_row_norms is not None and m.shape[1] <= ROW_BATCH_MAX:
            return self._batched_row_norms(m)
        return torch.tensor([self.norm([row]) for row in m], dtype=torch.float64, device=m.device)

    def shrink_into_(self, tensors: Sequence[torch.Tensor], radius: float) -> bool:
        """Moves tensors outside the ball (taken as one vector) into it; returns whether they moved. Norm
        balls rescale (the direction is kept), then shrink by a few ulps until the stored values are in."""
        norm = self.norm(tensors)
        if norm <= radius:
            return False
        with torch.no_grad():
            for t in tensors:
                t.mul_(radius / norm)
            # the rescaled values are rounded: shrink by a few ulps until the stored norm is <= r, so that
            # the step's guarantee (docs/feasibility.md) starts from a feasible point
            for _ in range(16):
                if self.norm(tensors) <= radius:
                    break
                for t in tensors:
                    t.mul_(1.0 - 4.0 * torch.finfo(t.dtype).eps)
        return True

    def _excess(self, tensors: Sequence[torch.Tensor], radius: float) -> float:
        """How far outside the ball the tensors are, relative to r (for the warning), or 0."""
        norm = self.norm(tensors)
        return 0.0 if norm <= radius else (norm / radius - 1 if math.isfinite(norm) else math.inf)

    # -- balls and radii ---------------------------------------------------------------------------------------
    @staticmethod
    def rows(p: torch.Tensor) -> list[torch.Tensor]:
        """The balls of ``p`` under scope "row": its slices along dim 0 (views), or ``p`` itself below 2-D."""
        p = p.detach()  # views of the same memory, without autograd history
        return list(p.unbind(0)) if p.dim() >= 2 else [p]

    @staticmethod
    def row_count(p: torch.Tensor) -> int:
        """``len(rows(p))``, without making the views."""
        return p.shape[0] if p.dim() >= 2 else 1

    @staticmethod
    def row_matrix(p: torch.Tensor) -> torch.Tensor:
        """``p``'s row balls as the rows of a (row_count(p), n) matrix (a view where p is contiguous)."""
        p = p.detach()
        return p.reshape(p.shape[0], math.prod(p.shape[1:])) if p.dim() >= 2 else p.reshape(1, p.numel())

    @staticmethod
    def _row_blocks(m: torch.Tensor) -> list[slice]:
        """The rows of the (B, n) matrix m in blocks of about ROW_BLOCK_ELEMENTS elements."""
        step = max(1, ROW_BLOCK_ELEMENTS // max(m.shape[1], 1))
        return [slice(i, i + step) for i in range(0, m.shape[0], step)]

    def _rule_value(self, tensors: Sequence[torch.Tensor]) -> tuple[float, float, str]:
        """(the rule's radius, the initial norm it is taken from, that norm's name) for one ball's values."""
        if self.rule == "init_diameter":
            l2 = math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))
            shape = tuple(tensors[0].shape) if len(tensors) == 1 else (sum(t.numel() for t in tensors),)
            unit = self.l2_diameter(shape, 1.0)
            if not unit > 0:
                # a ball whose diameter is 0 for every radius (a one-element simplex {r}, an empty tensor):
                # no radius gives it the diameter of its initial values (this was a ZeroDivisionError)
                raise ValueError(f"{type(self).__name__}.from_init_diameter cannot set a radius for a {self.NAME} over "
                                 f"{math.prod(shape)} element(s): its L2 diameter is 0 whatever its radius; give it a "
                                 f"param group of its own with an explicit radius, e.g. "
                                 f"{{'params': [...], 'constraint': fgfw.{type(self).__name__}(radius=1.0)}}")
            return 2.0 * self.relative_scale * l2 / unit, l2, "L2 norm"
        norm = self.norm(tensors)
        return self.relative_scale * norm, norm, self.GAUGE

    def _rule_radius(self, tensors: Sequence[torch.Tensor], where: str,
                     draws: Sequence[Sequence[torch.Tensor]] = ()) -> float:
        """The rule's radius for one ball. A ball that starts at zero (no multiple of its norm is a ball) takes the
        mean of the rule over ``draws`` (the same ball in draws of its module's initialisation, see
        :func:`init_draws`), and where those are zero too (a normalisation layer's shift) or there are none,
        the rule on a stand-in of unit L2 norm: every entry 1/sqrt(n), n the ball's elements."""
        value, norm, what = self._rule_value(tensors)
        if norm == 0:
            values = [self._rule_value(draw)[0] for draw in draws]
            if values and all(v > 0 and math.isfinite(v) for v in values):
                return sum(values) / len(values)
            n = sum(t.numel() for t in tensors)
            value, norm, what = self._rule_value([torch.full((n,), 1.0 / math.sqrt(max(n, 1)), dtype=torch.float64)])
        if not norm > 0 or not math.isfinite(norm) or not value > 0 or not math.isfinite(value):
            raise ValueError(f"{type(self).__name__}.{self.rule if self.rule != 'init_diameter' else 'from_init_diameter'}"
                             f" cannot set a radius from {where}: its initial {what} is {norm}; give it a finite "
                             f"initialisation, or a param group of its own with an explicit radius, e.g. "
                             f"{{'params': [...], 'constraint': fgfw.{type(self).__name__}(radius=1.0)}}")
        return value

    def resolve_radii(self, params: Sequence[torch.Tensor]) -> list:
        """The radii: one per tensor ("tensor"), one for the group ("global"), a list per tensor ("row").

        Rules (``relative_to_init``, ``from_init_diameter``) are taken from each ball's initial values; a ball
        that is all zero takes the rule on draws of its module's initialisation (``reset_parameters``, where
        the module is registered: the optimizers given a model, and :func:`fgfw.param_groups`, register it),
        else on the unit-L2 stand-in of :meth:`_rule_radius`. So a BatchNorm or LayerNorm shift (zero, and
        zero again after a reset) gets the stand-in's radius (``relative_to_init(s)``: ``s sqrt(n)`` for the L1
        ball, ``s`` for L2, ``s / sqrt(n)`` for L-infinity), its gain (ones) the rule on the ones, and a
        Linear's zeroed bias the rule on its U(-1/sqrt(fan_in), 1/sqrt(fan_in)) draws."""
        if self.scope == "row":
            if self.radius is not None:
                return [[self.radius] * self.row_count(p) for p in params]
            return [self._row_rule_radii(p, i) for i, p in enumerate(params)]
        if self.radius is not None:
            return [self.radius] if self.global_ball else [self.radius] * len(params)
        if self.global_ball:
            return [self._rule_radius(list(params), "the group's parameters")]
        return [self._rule_radius([p], f"parameter {i} (shape {tuple(p.shape)})",
                                  [[d] for d in init_draws(p)] if not bool(p.detach().any()) else [])
                for i, p in enumerate(params)]

    def _row_rule_values(self, m: torch.Tensor, shape: tuple[int, ...]) -> tuple[list, list] | None:
        """``_rule_value([row])[:2]`` of every row of the (B, n) float64 matrix ``m`` (rows of ``shape``): the rule's
        radii and the norms they are taken from, with the same arithmetic per row; None where they must be
        taken a row at a time (a set with a rule of its own, a ball with no diameter)."""
        # Simplex's relative rule takes the sum of |theta| (its _row_rule_norms)
        if type(self)._rule_value not in (Constraint._rule_value, Simplex._rule_value):
            return None
        if self.rule == "init_diameter":
            unit = self.l2_diameter(shape, 1.0)
            if not unit > 0:
                return None  # _rule_value raises its error for the first row
            squares = m.pow(2).sum(dim=1).tolist() if m.shape[1] <= ROW_BATCH_MAX else \
                [float(row.pow(2).sum()) for row in m]
            l2 = [math.sqrt(v) for v in squares]  # math.sqrt per row, as _rule_value
            return [2.0 * self.relative_scale * v / unit for v in l2], l2
        norms = self._row_rule_norms(m).tolist()
        return [self.relative_scale * v for v in norms], norms

    def _row_rule_norms(self, m: torch.Tensor) -> torch.Tensor:
        """The norm of every row that the rule relative_to_init multiplies (_rule_value's ``norm``)."""
        return self.row_norms(m)

    def _row_rule_radii(self, p: torch.Tensor, i: int) -> list[float]:
        """The rule's radius of every row ball of ``p`` (parameter ``i``): the norms of all rows in one reduction; a row
        whose norm gives no radius (all zero, or not finite) goes through _rule_radius as before, with the draws
        of p's module where any row of p is all zero."""
        m = self.row_matrix(p)
        shape = tuple(p.shape[1:]) if p.dim() >= 2 else tuple(p.shape)
        parts = [self._row_rule_values(m[rows].double(), shape) for rows in self._row_blocks(m)]
        values = None if None in parts else \
            ([v for part in parts for v in part[0]], [v for part in parts for v in part[1]])
        radii, draws = [], None
        for j in range(m.shape[0]):
            if values is not None:
                value, norm = values[0][j], values[1][j]
                if norm > 0 and math.isfinite(norm) and value > 0 and math.isfinite(value):
                    radii.append(value)  # what _rule_radius returns for this row
                    continue
            if draws is None:  # read once per tensor, as before
                draws = init_draws(p) if not bool(m.ne(0).any(dim=1).all()) else []
            row = p.detach()[j] if p.dim() >= 2 else p.detach()
            radii.append(self._rule_radius([row], f"row {j} of parameter {i} (shape {tuple(p.shape)})",
                                           [[d[j] if d.dim() >= 2 else d] for d in draws]))
        return radii

    def make_feasible_(self, params: Sequence[torch.Tensor], radii: Sequence[float],
                       what: str = "initial parameters") -> None:
        """Moves an infeasible start into the set (with one warning beyond rounding, which calls the tensors
        ``what`` and counts the balls moved); feasible parameters are untouched."""
        if self.scope == "row" and type(self)._excess is Constraint._excess \
                and type(self).shrink_into_ is Constraint.shrink_into_:
            # a norm ball's rows: every row of a tensor at once (a GPT-2 has 100,000), as the loop below would
            found = [self._shrink_rows_into_(p, r) for p, r in zip(params, radii)]
            moved = sum(count for count, _ in found)
            first = next((first for _, first in found if first is not None), None)
            balls = sum(self.row_count(p) for p in params)
        else:
            if self.scope == "row":
                params = [row for p in params for row in self.rows(p)]
                radii = [r for per_tensor in radii for r in per_tensor]
            groups = [list(params)] if self.global_ball else [[p] for p in params]
            moved, first, balls = 0, None, len(groups)
            for tensors, r in zip(groups, radii):
                excess = self._excess(tensors, r)
                if not excess:
                    continue
                before = self.norm(tensors)
                self.shrink_into_(tensors, r)
                # an excess within rounding (e.g. a radius set from these very weights) is removed silently, and
                # so is the shrink that relative_to_init(scale < 1) asks for
                if excess > 1e-6 and not self._shrinks_by_rule():
                    moved += 1
                    first = first or (before, r, tensors)
        if moved:  # one warning for all the balls (a row ball per row: thousands in a model)
            message = self._moved_message(*first, what)
            if moved > 1:
                message += f" [the first of {moved} balls of the {balls} ({self.scope} scope) moved]"
            warnings.warn(message, stacklevel=_user_stacklevel())

    def _shrink_rows_into_(self, p: torch.Tensor, radii: Sequence[float]) -> tuple[int, tuple | None]:
        """make_feasible_'s loop (_excess, then shrink_into_) over the row balls of ``p`` at once, for a set that
        rescales (the base _excess and shrink_into_), with the same values: returns how many balls moved beyond
        rounding and the first one's (norm before, radius, [row]), or None."""
        x = p.detach()
        m = self.row_matrix(x)  # read only: the rows moved are written back through x
        if not m.numel():
            return 0, None  # no rows, or rows of no elements (norm 0): in every ball
        r = torch.tensor(radii, dtype=torch.float64, device=x.device)
        norms = torch.cat([self.row_norms(m[rows].double()) for rows in self._row_blocks(m)])
        out = torch.nonzero(~(norms <= r)).squeeze(1)  # the rows outside their balls (_excess != 0)
        if not out.numel():
            return 0, None
        moved, first = 0, None
        for block in torch.split(out, max(1, ROW_BLOCK_ELEMENTS // m.shape[1])):
            count, found = self._rescale_rows_(x, m, block, norms[block], r[block])
            moved, first = moved + count, first or found
        return moved, first

    def _rescale_rows_(self, x: torch.Tensor, m: torch.Tensor, out: torch.Tensor, before: torch.Tensor,
                       r: torch.Tensor) -> tuple[int, tuple | None]:
        """shrink_into_ of the rows ``out`` of x (m: x's row matrix; ``before``: their norms > r): see
        _shrink_rows_into_."""
        excess = torch.where(torch.isfinite(before), before / r - 1, math.inf)
        # t.mul_(radius / norm) per row: the factor in float64, rounded to the parameter's op dtype (float32 for
        # float16/bfloat16, as a Python scalar is there), the product rounded to the parameter's dtype
        op_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        rows = (m[out].to(op_dtype) * (r / before).to(op_dtype).unsqueeze(1)).to(x.dtype)
        # then shrink_into_'s few ulps, on the rows whose stored norm is still above r, up to 16 times each
        shrink, left = 1.0 - 4.0 * torch.finfo(x.dtype).eps, torch.arange(out.numel(), device=out.device)
        for _ in range(16):
            left = left[~(self.row_norms(rows[left].double()) <= r[left])]
            if not left.numel():
                break
            rows[left] = rows[left].mul(shrink)
        with torch.no_grad():
            if x.dim() >= 2:
                x[out] = rows.view((out.numel(),) + tuple(x.shape[1:]))
            else:
                x.copy_(rows.view(x.shape))
        if self._shrinks_by_rule():
            return 0, None  # make_feasible_'s loop counts no ball then
        counted = torch.nonzero(excess > 1e-6).squeeze(1)
        if not counted.numel():
            return 0, None
        k = int(counted[0])
        row = x[int(out[k])] if x.dim() >= 2 else x
        return counted.numel(), (float(before[k]), float(r[k]), [row])

    def _shrinks_by_rule(self) -> bool:
        """Whether the radius rule itself puts the initial point outside the ball: relative_to_init(scale < 1)."""
        return self.radius is None and self.rule == "relative_to_init" and self.relative_scale < 1

    def _moved_message(self, before: float, radius: float, tensors, what: str) -> str:
        return (f"{what} have {self.GAUGE} {before:.6g} > radius {radius:.6g}: rescaled into the "
                f"{self.NAME} by {radius / before:.6g} (pass a larger radius or {type(self).__name__}.relative_to_init "
                f"to keep the initialisation)")


class L1Ball(Constraint):
    """The L1 ball ``{theta : ||theta||_1 <= r}`` (the paper's sparsity-promoting constraint).

    Its vertices are ``-r sign(d_i) e_i``: a scaled one-hot, never stored densely by the optimizers (the
    fused kernels step it). Per-tensor balls let the unit with the largest gradient take every step of
    its layer while the other units shrink towards zero; in a narrow deep ReLU network they die, which
    scope "row" avoids (see bench/RESULTS.md). Arguments as in :class:`Constraint`.
    """

    KIND = KIND_L1_BALL
    NAME = "L1 ball"
    GAUGE = "L1 norm"

    def gauge(self, x: torch.Tensor) -> float:
        return float(x.abs().sum())

    def norm(self, tensors: Sequence[torch.Tensor]) -> float:
        return float(sum(t.detach().double().abs().sum() for t in tensors))

    @staticmethod
    def _batched_row_norms(m: torch.Tensor) -> torch.Tensor:
        return m.abs().sum(dim=1)

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        return reference.l1_lmo(d, radius)

    def row_vertices(self, d: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        s = torch.zeros_like(d)
        if d.numel():
            i = torch.argmax(d.abs(), dim=1, keepdim=True)  # the first maximum: the lowest index wins ties
            s.scatter_(1, i, -radii.to(d.dtype).unsqueeze(1) * torch.sign(d.gather(1, i)))
        return s

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        return 2.0 * radius if math.prod(shape) > 0 else 0.0

    @staticmethod
    def lmo(direction: torch.Tensor, radius: float) -> torch.Tensor:
        """Dense ``argmin_{||s||_1 <= r} <direction, s>`` (reference; the kernels never build it)."""
        return reference.l1_lmo(direction, radius)


class L2Ball(Constraint):
    """The L2 ball ``{theta : ||theta||_2 <= r}``: vertex ``-r d / ||d||_2`` (dense; 0 for d = 0)."""

    KIND, NAME, GAUGE = "l2_ball", "L2 ball", "L2 norm"

    def gauge(self, x: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(x))

    @staticmethod
    def _batched_row_norms(m: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(m, dim=1)

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        # d / max|d_i| first (inside lp_vertex): the norm squares its entries, which underflow to 0 below
        # ~1e-154 in float64 (giving the zero vector, no minimiser for d != 0) and overflow above ~1e154
        return reference.lp_vertex(d, radius, 2.0)

    def fused_step(self):
        return ("lp", 2.0)

    def row_vertices(self, d: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        d64 = _unit_max_rows(d)
        norm = torch.linalg.vector_norm(d64, dim=1, keepdim=True)
        s = -radii.to(torch.float64).unsqueeze(1) * d64 / torch.where(norm == 0, 1.0, norm)
        return s.to(d.dtype)  # a zero row stays 0

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        return 2.0 * radius


class LInfBall(Constraint):
    """The L-infinity ball ``{theta : max_i |theta_i| <= r}``: vertex ``-r sign(d)`` (dense; a bound on every
    weight, the box of quantisation-aware training)."""

    KIND, NAME, GAUGE = "linf_ball", "L-infinity ball", "L-infinity norm"

    def gauge(self, x: torch.Tensor) -> float:
        return float(x.abs().max()) if x.numel() else 0.0

    @staticmethod
    def _batched_row_norms(m: torch.Tensor) -> torch.Tensor:
        return m.abs().amax(dim=1) if m.shape[1] else torch.zeros(m.shape[0], dtype=m.dtype, device=m.device)

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        return -radius * torch.sign(d)

    def fused_step(self):
        return ("linf", None)

    def row_vertices(self, d: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        return -radii.to(d.dtype).unsqueeze(1) * torch.sign(d)

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        return 2.0 * radius * math.sqrt(math.prod(shape))


class LpBall(Constraint):
    """The Lp ball ``{theta : ||theta||_p <= r}`` for 1 < p < inf: vertex
    ``-r sign(d) |d|^(q-1) / ||d||_q^(q-1)`` with 1/p + 1/q = 1 (equality in Hoelder's inequality).

    Args:
        p: the exponent, 1 < p < inf (p = 1, 2, inf: :class:`L1Ball`, :class:`L2Ball`, :class:`LInfBall`).
    """

    KIND, NAME = "lp_ball", "Lp ball"
    PARAMS = ("p",)

    def __init__(self, radius: float | None = None, *, p: float, scope: str = "tensor", **kw):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (1 < p < math.inf):
            raise ValueError(f"p must be a number with 1 < p < inf (use L1Ball, L2Ball or LInfBall for 1, 2, inf), "
                             f"got {p!r}")
        self.p = float(p)
        self.GAUGE = f"L{self.p:g} norm"
        super().__init__(radius, scope=scope, **kw)

    def _params_repr(self) -> str:
        return f"p={self.p:g}, "

    def gauge(self, x: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(x, ord=self.p))

    def _batched_row_norms(self, m: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(m, ord=self.p, dim=1)

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        return reference.lp_vertex(d, radius, self.p)

    def fused_step(self):
        return ("lp", self.p)

    def row_vertices(self, d: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        q = self.p / (self.p - 1)
        d64 = _unit_max_rows(d)
        norm_q = torch.linalg.vector_norm(d64, ord=q, dim=1, keepdim=True)
        s = -radii.to(torch.float64).unsqueeze(1) * torch.sign(d64) * \
            (d64.abs() / torch.where(norm_q == 0, 1.0, norm_q)).pow(q - 1)
        return s.to(d.dtype)

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        n = math.prod(shape)
        return 2.0 * radius * n ** max(0.0, 0.5 - 1.0 / self.p)


class KSparsePolytope(Constraint):
    """The k-sparse polytope: the convex hull of the vectors with at most k non-zeros, each ``+-r``;
    equivalently ``{theta : ||theta||_inf <= r, ||theta||_1 <= k r}``. Its vertex for d is ``-r sign(d_i)``
    on the k largest ``|d_i|`` (ties: the lowest indices) and 0 elsewhere: a step moves k weights, and a
    model trained in it keeps its accuracy when pruned to few weights (see :mod:`fgfw.sparsity`).

    Args:
        k: the number of non-zeros of a vertex, an integer >= 1 (a ball with fewer elements than k is an
            L-infinity ball).
    """

    KIND, NAME, GAUGE = "k_sparse_polytope", "k-sparse polytope", "k-sparse gauge max(||x||_1 / k, ||x||_inf)"
    PARAMS = ("k",)

    def __init__(self, radius: float | None = None, *, k: int, scope: str = "tensor", **kw):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        self.k = k
        super().__init__(radius, scope=scope, **kw)

    def _params_repr(self) -> str:
        return f"k={self.k}, "

    def gauge(self, x: torch.Tensor) -> float:
        if not x.numel():
            return 0.0
        return max(float(x.abs().sum()) / min(self.k, x.numel()), float(x.abs().max()))

    def _batched_row_norms(self, m: torch.Tensor) -> torch.Tensor:
        if not m.shape[1]:
            return torch.zeros(m.shape[0], dtype=m.dtype, device=m.device)
        a = m.abs()
        return torch.maximum(a.sum(dim=1) / min(self.k, m.shape[1]), a.amax(dim=1))

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        return reference.ksparse_vertex(d, radius, self.k)

    def fused_step(self):
        return ("ksparse", self.k)

    def row_vertices(self, d: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        k = min(self.k, d.shape[1])
        # reference.ksparse_vertex's order per row: a stable descending sort, the lowest indices win ties
        order = torch.sort(reference.magnitude_order(d), dim=1, descending=True, stable=True).indices[:, :k]
        s = torch.zeros_like(d)
        s.scatter_(1, order, -radii.to(d.dtype).unsqueeze(1) * torch.sign(d.gather(1, order)))
        return s

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        return 2.0 * radius * math.sqrt(min(self.k, math.prod(shape)))


class Simplex(Constraint):
    """The scaled probability simplex ``{theta : theta >= 0, sum theta = r}``: vertex ``r e_i`` with
    i = argmin d_i (the lowest index on ties). Mixture weights, attention over a fixed set, convex
    combinations of experts. An infeasible start is projected onto it (Euclidean projection); its gauge is
    the sum of a non-negative tensor (infinite otherwise), so ``relative_to_init`` takes the sum of the
    absolute initial values."""

    KIND, NAME, GAUGE = "simplex", "simplex", "sum"
    SHRINK_STEP = False  # sum theta = r is an equality: see Constraint.SHRINK_STEP

    def gauge(self, x: torch.Tensor) -> float:
        return float(x.sum()) if not x.numel() or float(x.min()) >= 0 else math.inf

    def contains(self, x: torch.Tensor, radius: float, rtol: float = 1e-6) -> bool:
        x = x.detach().reshape(-1).double()
        return bool(x.numel() == 0 or (float(x.min()) >= 0 and abs(float(x.sum()) - radius) <= radius * rtol))

    def _rule_value(self, tensors) -> tuple[float, float, str]:
        if self.rule == "relative_to_init":  # the sum of |theta|: the gauge of the nearest non-negative point
            norm = sum(float(t.detach().double().abs().sum()) for t in tensors)
            return self.relative_scale * norm, norm, "sum of |theta|"
        return super()._rule_value(tensors)

    def _row_rule_norms(self, m: torch.Tensor) -> torch.Tensor:
        if self.rule != "relative_to_init":
            return super()._row_rule_norms(m)
        if m.shape[1] > ROW_BATCH_MAX:  # see ROW_BATCH_MAX
            return torch.tensor([float(row.abs().sum()) for row in m], dtype=torch.float64, device=m.device)
        return m.abs().sum(dim=1)

    @staticmethod
    def _batched_row_norms(m: torch.Tensor) -> torch.Tensor:  # gauge: the sum of a non-negative row, else inf
        return torch.where(m.amin(dim=1) >= 0, m.sum(dim=1), math.inf) if m.shape[1] else \
            torch.zeros(m.shape[0], dtype=m.dtype, device=m.device)

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        s = torch.zeros_like(d)
        if d.numel():
            s[int(torch.argmin(d))] = radius
        return s

    def row_vertices(self, d: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        s = torch.zeros_like(d)
        if d.numel():
            s.scatter_(1, torch.argmin(d, dim=1, keepdim=True), radii.to(d.dtype).unsqueeze(1))
        return s

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        return math.sqrt(2.0) * radius if math.prod(shape) > 1 else 0.0

    def _excess(self, tensors, radius: float) -> float:
        x = torch.cat([t.detach().reshape(-1).double() for t in tensors])
        if self.contains(x, radius, rtol=0.0):
            return 0.0
        return float(torch.linalg.vector_norm(x - project_simplex(x, radius))) / radius or 1e-300

    def shrink_into_(self, tensors: Sequence[torch.Tensor], radius: float) -> bool:
        x = torch.cat([t.detach().reshape(-1).double() for t in tensors])
        if self.contains(x, radius, rtol=0.0):
            return False
        y, at = project_simplex(x, radius), 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(y[at:at + t.numel()].view_as(t).to(t.dtype))
                at += t.numel()
        return True

    def _moved_message(self, before: float, radius: float, tensors, what: str) -> str:
        return (f"{what} are not in the simplex {{theta >= 0, sum theta = {radius:.6g}}}: projected "
                f"onto it (Euclidean projection)")


class NonnegativeL1Ball(Simplex):
    """The non-negative part of the L1 ball, ``{theta : theta >= 0, sum theta <= r}``: vertex ``r e_i`` with
    i = argmin d_i when d_i < 0, else 0 (the origin). An infeasible start is clamped at 0, then rescaled."""

    KIND, NAME, GAUGE = "nonnegative_l1_ball", "non-negative L1 ball", "sum"
    SHRINK_STEP = True  # not the simplex's equality: the exact combination, corrected by the gauge
    CORRECTS_BY_GAUGE = True

    @staticmethod
    def row_gauges(rows: torch.Tensor) -> torch.Tensor:
        return torch.where(rows.amin(dim=1) >= 0, rows.sum(dim=1), math.inf) if rows.shape[1] else \
            torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)

    def contains(self, x: torch.Tensor, radius: float, rtol: float = 1e-6) -> bool:
        x = x.detach().reshape(-1).double()
        return bool(x.numel() == 0 or (float(x.min()) >= 0 and float(x.sum()) <= radius * (1 + rtol)))

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        s = torch.zeros_like(d)
        if d.numel():
            i = int(torch.argmin(d))
            if d[i] < 0:
                s[i] = radius
        return s

    def row_vertices(self, d: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
        s = torch.zeros_like(d)
        if d.numel():
            i = torch.argmin(d, dim=1, keepdim=True)
            s.scatter_(1, i, torch.where(d.gather(1, i) < 0, radii.to(d.dtype).unsqueeze(1), 0.0))
        return s

    def _excess(self, tensors, radius: float) -> float:
        x = torch.cat([t.detach().reshape(-1).double() for t in tensors])
        if self.contains(x, radius, rtol=0.0):
            return 0.0
        return max(float(x.clamp(min=0).sum()) / radius - 1, float(-x.min()) / radius, 1e-300)

    def shrink_into_(self, tensors: Sequence[torch.Tensor], radius: float) -> bool:
        x = torch.cat([t.detach().reshape(-1).double() for t in tensors])
        if self.contains(x, radius, rtol=0.0):
            return False
        with torch.no_grad():
            for t in tensors:
                t.clamp_(min=0)
        Constraint.shrink_into_(self, tensors, radius)  # the L1 rescale of what is now non-negative
        return True

    def gauge(self, x: torch.Tensor) -> float:
        return float(x.sum()) if not x.numel() or float(x.min()) >= 0 else math.inf

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        # the vertices are 0 and r e_i: sqrt(2) r apart (two of the e_i), or r for one element (the segment
        # [0, r]; the simplex's rule, inherited before, gave 0 there and from_init_diameter divided by it)
        n = math.prod(shape)
        return math.sqrt(2.0) * radius if n > 1 else radius if n == 1 else 0.0

    def _moved_message(self, before: float, radius: float, tensors, what: str) -> str:
        return (f"{what} are not in the non-negative L1 ball {{theta >= 0, sum theta <= {radius:.6g}}}: "
                f"negative values set to 0, then rescaled into it")


class _MatrixSet(Constraint):
    """A set of weight matrices, one per tensor (scope "tensor" only): a tensor of more than two dimensions is
    taken as ``(shape[0], -1)``, a vector as one row; the gauge reads the ball's shape."""

    ALLOWED_SCOPES = ("tensor",)

    @staticmethod
    def _matrix(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        # (shape[0], -1) spelled out: -1 is ambiguous for an empty matrix
        return x.reshape(1, -1) if len(shape) < 2 else x.reshape(shape[0], math.prod(shape[1:]))

    def gauge(self, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> float:
        raise NotImplementedError

    def gauge_parts(self, x: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.tensor([self.gauge(x, shape)], dtype=torch.float64), None

    def norm(self, tensors: Sequence[torch.Tensor]) -> float:
        (t,) = tensors  # scope "tensor": one matrix per ball
        return self.gauge(t.detach().double(), tuple(t.shape))

    def contains(self, x: torch.Tensor, radius: float, rtol: float = 1e-6) -> bool:
        return self.gauge(x.detach().double(), tuple(x.shape)) <= radius * (1 + rtol)

    def resolve_radii(self, params: Sequence[torch.Tensor]) -> list:
        for i, p in enumerate(params):
            if p.dim() < 2:
                raise ValueError(f"a {self.NAME} is a set of matrices, but parameter {i} has shape {tuple(p.shape)} "
                                 f"(a bias or a normalisation gain?): give it a param group with another set, or "
                                 f"none (fgfw.param_groups(model, weights={type(self).__name__}(...)) does)")
        return super().resolve_radii(params)


def _orthonormal(a: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of the tall matrix a: torch.linalg.qr's Q, from the same LAPACK calls
    without its dispatch (16 ms against 10 us a call for an 8-column block on a busy 2-core machine)."""
    return torch.linalg.householder_product(*torch.geqrf(a))


class NuclearNormBall(_MatrixSet):
    """The nuclear-norm ball ``{W : sum of singular values <= r}`` of each weight matrix (low rank): vertex
    ``-r u_1 v_1^T`` from the top singular pair of the direction (as a matrix: a tensor of more than two
    dimensions is taken as ``(shape[0], -1)``, a vector as one row). Scope "tensor" only; torch ops, on the
    direction's device, in float64.

    The pair, by a rule on the matrix's smaller side n = min(rows, cols):

    * n <= ``full_svd_max`` (default 256): ``torch.linalg.svd``, exact to rounding whatever the direction
      (equal or close top singular values, a top pair orthogonal to any guess). The vertex is then the
      true LMO and the optimizers' ``last_gap`` the true Frank-Wolfe gap of the step's direction.
    * larger: block subspace iteration with Rayleigh-Ritz on 8 Gaussian columns of a fixed seed (so that
      no start can hide the top pair), the first plus the previous step's right singular vector, which
      the optimizers keep in their state as ``"singular_vector"`` (a start only), until the top Ritz pair's
      residual ``||d v - sigma u||`` is below 1e-8 sigma (its value then within ~1e-16), at most
      ``max_iterations`` iterations, after which the full SVD is used. A full SVD costs about as much as
      10-30 iterations at n = 256 (float64 on the CPU), and grows as n^3 against n^2 per iteration. A
      Ritz value never exceeds sigma_1, so ``last_gap`` is then an estimate from below of the true gap
      (:meth:`exact_lmo`; the optimizers' ``exact_gap``), equal to it when the iterations found the top
      pair (a random block misses it only for exceptional directions).

    Args:
        max_iterations: the most block iterations before the full SVD (matrices above ``full_svd_max``).
        full_svd_max: the largest smaller side n decomposed by a full SVD (0: always iterate).
    """

    KIND, NAME, GAUGE = "nuclear_norm_ball", "nuclear-norm ball", "nuclear norm"
    PARAMS = ("max_iterations", "full_svd_max")
    BLOCK = 8  # columns of the subspace iteration: the top pair converges at the rate sigma_9 / sigma_1
    RESIDUAL = 1e-8  # relative residual of the top Ritz pair that ends the iterations (the value: ~1e-16)

    def __init__(self, radius: float | None = None, *, scope: str = "tensor", max_iterations: int = 300,
                 full_svd_max: int = 256, **kw):
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise ValueError(f"max_iterations must be an integer >= 1, got {max_iterations!r}")
        if isinstance(full_svd_max, bool) or not isinstance(full_svd_max, int) or full_svd_max < 0:
            raise ValueError(f"full_svd_max must be an integer >= 0 (the largest min(rows, cols) decomposed by a "
                             f"full SVD), got {full_svd_max!r}")
        self.max_iterations = max_iterations
        self.full_svd_max = full_svd_max
        super().__init__(radius, scope=scope, **kw)

    def gauge(self, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> float:
        if not x.numel():
            return 0.0
        return float(torch.linalg.matrix_norm(self._matrix(x, shape or tuple(x.shape)), ord="nuc"))

    def exact_lmo(self, shape: tuple[int, ...]) -> bool:
        rows, cols = (1, math.prod(shape)) if len(shape) < 2 else (shape[0], math.prod(shape[1:]))
        return min(rows, cols) <= self.full_svd_max

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        return self.vertex_and_vector(d, radius, shape)[0]

    def vertex_and_vector(self, d: torch.Tensor, radius: float, shape: tuple[int, ...],
                          start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(the vertex, the right singular vector v_1 it used (float64, or None for d = 0), the number of block
        iterations: 0 for a full SVD). ``start``: the previous step's v_1, the first column of the iterations'
        block (a vector of another size is ignored); a full SVD needs none."""
        # scaled by 1 / max|d_ij| (the vertex does not change): no square of an entry under- or overflows
        m = self._matrix(_unit_max(d), shape)
        if not m.numel() or not float(m.abs().max()) > 0:
            # zero: every point of the ball is a minimiser, 0 among them; NaN (a non-finite d): NaN, as the
            # other sets give, rather than an SVD that fails to converge in the middle of a step
            value = 0.0 if m.numel() and float(m.abs().max()) == 0 else math.nan
            return torch.full_like(d, value), None, 0
        if self.exact_lmo(shape):
            u, v, iterations = *self._svd_pair(m), 0
        else:
            u, v, iterations = self._subspace_pair(m, start)
        return (-radius * torch.outer(u, v)).reshape(-1).to(d.dtype), v, iterations

    @staticmethod
    def _svd_pair(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u, _, vh = torch.linalg.svd(m, full_matrices=False)
        return u[:, 0], vh[0]

    def _subspace_pair(self, m: torch.Tensor, start: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The top singular pair of m by block subspace iteration (see the class), and its iteration count."""
        rows, cols = m.shape
        # a fixed seed on the CPU: the same block on every device and at every step (no global RNG drawn)
        block = torch.randn(cols, min(self.BLOCK, rows, cols), generator=torch.Generator().manual_seed(0),
                            dtype=torch.float64).to(m.device)
        if start is not None and start.numel() == cols and float(torch.linalg.vector_norm(start)) > 0:
            # added to a random column, not put in alone: the last v_1 may be an exact singular vector of this
            # direction that is not the top one any more, whose pair would pass the residual test at once
            block[:, 0] = block[:, 0] / torch.linalg.vector_norm(block[:, 0]) + \
                start.to(block) / torch.linalg.vector_norm(start.to(block))
        v = _orthonormal(block)
        for iterations in range(1, self.max_iterations + 1):
            u = _orthonormal(m @ v)
            w = m.T @ u
            # Rayleigh-Ritz on span(u): the top eigenpair of the b x b matrix u^T m m^T u = w^T w gives the top
            # singular triplet of u^T m (its squared value and left vector); m^T u spans the next v
            values, vectors = torch.linalg.eigh(w.T @ w)
            sigma = float(values[-1].clamp(min=0).sqrt())
            u1 = u @ vectors[:, -1]
            v1 = w @ vectors[:, -1] / sigma
            if float(torch.linalg.vector_norm(m @ v1 - sigma * u1)) <= self.RESIDUAL * sigma:
                return u1, v1 / torch.linalg.vector_norm(v1), iterations
            v = _orthonormal(w)
        return *self._svd_pair(m), self.max_iterations

    def warm_started(self, states: Sequence[dict]) -> "Callable":
        """A ``vertex(d, r, shape)`` for reference.fw_step_ over the balls of one call, in order (one per tensor:
        scope "tensor"), that starts each tensor's block iterations from ``states[t]["singular_vector"]`` and
        stores the new v_1 there (float64) with the iteration count (0: a full SVD) in
        ``"subspace_iterations"``."""
        at = iter(states)

        def vertex(d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
            state = next(at)
            s, v, iterations = self.vertex_and_vector(d, radius, shape, state.get("singular_vector"))
            if v is not None:
                state["singular_vector"] = v.to(torch.float64)
            state["subspace_iterations"] = iterations
            return s

        return vertex

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        return 2.0 * radius  # Frobenius: the vertices are unit rank-one matrices times r


class GroupL1Ball(_MatrixSet):
    """The group-L1 ball ``{W : sum_i ||W_i||_2 <= r}`` of each weight matrix, its rows W_i the groups (a
    unit's incoming weights; a tensor of more than two dimensions is taken as ``(shape[0], -1)``, a vector
    as one row): L2 inside a group, L1 across groups, so a step moves one whole unit and training prunes
    units rather than weights. Vertex: ``-r d_i / ||d_i||_2`` on the row i of largest ``||d_i||_2`` (the
    lowest index on ties), 0 elsewhere. Scope "tensor" only (the groups are the tensor's rows); torch ops.
    """

    KIND, NAME, GAUGE = "group_l1_ball", "group-L1 ball", "group-L1 norm (sum of row L2 norms)"
    CORRECTS_BY_GAUGE = True

    def gauge(self, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> float:
        if not x.numel():
            return 0.0
        return float(torch.linalg.vector_norm(self._matrix(x.double(), shape or tuple(x.shape)), dim=1).sum())


    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        m = self._matrix(_unit_max(d), shape)  # scaled first: the row norms neither underflow nor overflow
        norms = torch.linalg.vector_norm(m, dim=1)
        s = torch.zeros_like(m)
        if m.numel():
            i = int(torch.argmax(norms))  # the first maximum: the lowest row wins ties
            if norms[i] > 0:
                s[i] = -radius * m[i] / norms[i]
        return s.reshape(-1).to(d.dtype)

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        return 2.0 * radius if math.prod(shape) > 0 else 0.0


# Newton-Schulz: the quintic whose coefficients Muon and Scion use (it lifts small singular values fast and
# leaves them in about [0.7, 1.2]), then cubic steps 1.5 x - 0.5 x^3, which map (0, sqrt 3) into (0, 1] and
# pull the band up to 1 from below, so that the vertex is feasible (spectral norm <= r up to rounding).
NEWTON_SCHULZ_QUINTIC = (3.4445, -4.7750, 2.0315)
NEWTON_SCHULZ_CUBIC = (1.5, -0.5)


def polar_factor(d: torch.Tensor, quintic_steps: int = 7, cubic_steps: int = 2,
                 quintic_dtype: torch.dtype | None = None) -> torch.Tensor:
    """An approximation of ``U V^T`` from the reduced SVD ``d = U S V^T`` of each matrix of the batch ``d``
    (``(..., m, n)``), by Newton-Schulz iterations in ``d``'s dtype (matrix products only).

    ``d`` is first scaled by ``||d d^T||_F^(1/2) = (sum sigma^4)^(1/4) >= sigma_max`` (read off the first
    step's Gram matrix: no extra product), which leaves the small singular values far less small than the
    Frobenius scaling Muon uses. Each singular value then follows the scalar map of the steps: with 7
    quintic and 2 cubic steps, every sigma >= 1e-4 (sum sigma^4)^(1/4) ends in [0.9, 1] (>= 3e-4 of it in
    [0.97, 1]), smaller ones end between 0 and 0.9, none above 1 but for rounding; a zero singular value
    picks up at most ~1e-3 of float32 rounding noise. A zero matrix gives zeros (tests/test_spectral.py).

    ``quintic_dtype`` (e.g. torch.bfloat16: the matrix units' fast products, as Muon runs all its steps): the
    quintic steps in that dtype, the cubic steps still in ``d``'s. The cubic map 1.5 x - 0.5 x^3 is at most 1 on
    (0, sqrt 3), so the result stays at most 1 but for ``d``'s rounding; the band below 1 is wider (bfloat16's
    noise, ~4e-3 of the largest singular value, is lifted with the small ones: tests/test_spectral.py)."""
    x = d
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:  # the Gram matrix of the short side
        x = x.mT
    a, b, c = NEWTON_SCHULZ_QUINTIC
    gram = x @ x.mT
    norm = torch.linalg.matrix_norm(gram)
    scale = torch.where(norm > 0, norm.sqrt(), 1.0)[..., None, None]  # a zero matrix stays zero
    x = x / scale
    gram = gram / (scale * scale)
    work = d.dtype
    if quintic_dtype is not None and quintic_steps:
        x, gram = x.to(quintic_dtype), gram.to(quintic_dtype)
    for step in range(quintic_steps):
        if step:
            gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    x = x.to(work)
    p, q = NEWTON_SCHULZ_CUBIC
    for _ in range(cubic_steps):
        x = p * x + q * ((x @ x.mT) @ x)
    return x.mT if transposed else x


class SpectralNormBall(_MatrixSet):
    """The spectral-norm ball ``{W : sigma_max(W) <= r}`` of each weight matrix (the operator 2-norm; a tensor
    of more than two dimensions is taken as ``(shape[0], -1)``, a vector as one row): vertex ``-r U V^T``, the
    polar factor of the direction, by Newton-Schulz iterations (:func:`polar_factor`, float32 matrix products
    on the direction's device) instead of an SVD. This is the set of Scion's hidden layers (Pethick et al.,
    "Training Deep Learning Models with Norm-Constrained LMOs", 2025): FrankWolfe with momentum on it is
    their constrained update, and Muon is its unconstrained relative.

    Accuracy (:func:`polar_factor`, tests/test_spectral.py): the vertex's singular values are at most r (up to
    float32 rounding), so the vertex is in the ball, and lie in [0.9, 1] times r for every singular value of
    d at or above 1e-4 ``(sum sigma^4)^(1/4)`` (about 1/3000 of sigma_max for a square Gaussian matrix; the
    smallest singular values of such a matrix can be smaller still, and move only partway); ``<d, s>`` was
    within 3 % of ``-r ||d||_nuclear`` on every test direction. The stored iterate's spectral norm stays <= r
    up to float32 rounding. The gap is reported at this vertex: an estimate from below of the
    exact Frank-Wolfe gap, short of it by ``r ||d||_nuclear + <d, s>`` (:meth:`exact_lmo` is False, so the
    optimizers' ``exact_gap`` says so). Radii: :meth:`operator_norm`
    (``r = scale sqrt(fan_out / fan_in)``, Scion's), or the rules of every set. Scope "tensor" only.
    """

    KIND, NAME, GAUGE = "spectral_norm_ball", "spectral-norm ball", "spectral norm"
    PARAMS = ("quintic_steps", "cubic_steps", "quintic_dtype")
    QUINTIC_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
    BATCH_ON_CPU = False  # see batch_vertices

    def __init__(self, radius: float | None = None, *, scope: str = "tensor", quintic_steps: int = 7,
                 cubic_steps: int = 2, quintic_dtype: str = "float32", **kw):
        for name, value in (("quintic_steps", quintic_steps), ("cubic_steps", cubic_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if cubic_steps < 1:
            raise ValueError(f"cubic_steps must be >= 1 (the cubic steps keep the vertex in the ball), got "
                             f"{cubic_steps!r}")
        if quintic_dtype not in self.QUINTIC_DTYPES:
            raise ValueError(f"quintic_dtype must be one of {sorted(self.QUINTIC_DTYPES)} (the dtype of the quintic "
                             f"Newton-Schulz products; the cubic steps stay float32), got {quintic_dtype!r}")
        self.quintic_steps, self.cubic_steps, self.quintic_dtype = quintic_steps, cubic_steps, quintic_dtype
        super().__init__(radius, scope=scope, **kw)

    @classmethod
    def operator_norm(cls, scale: float = 1.0, **params) -> "SpectralNormBall":
        """Radius ``scale * sqrt(fan_out / fan_in)`` for a ``(fan_out, fan_in, ...)`` weight (``fan_in`` the
        product of the other dimensions): the RMS-to-RMS operator-norm rule of Scion and Muon."""
        return cls(None, _relative_scale=scale, _rule="operator_norm", **params)

    def _rule_value(self, tensors) -> tuple[float, float, str]:
        if self.rule == "operator_norm":
            (t,) = tensors
            m = self._matrix(t, tuple(t.shape))
            return self.relative_scale * math.sqrt(m.shape[0] / max(m.shape[1], 1)), 1.0, "shape"
        return super()._rule_value(tensors)

    def exact_lmo(self, shape: tuple[int, ...]) -> bool:
        return False  # Newton-Schulz: the gap at its vertex is an estimate from below (the optimizers' exact_gap)

    def gauge(self, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> float:
        if not x.numel():
            return 0.0
        # sigma_max from the largest eigenvalue of the smaller Gram matrix (float64, scaled first so that the
        # squares neither overflow nor underflow): to ~1e-15 relative, about 10 x faster than an SVD of a
        # 512 x 4608 convolution weight
        m = self._matrix(x.double(), shape or tuple(x.shape))
        scale = float(m.abs().max())
        if not scale > 0 or not math.isfinite(scale):
            return scale if not math.isnan(scale) else math.nan
        m = m / scale
        gram = m @ m.T if m.shape[0] <= m.shape[1] else m.T @ m
        return scale * math.sqrt(max(float(torch.linalg.eigvalsh(gram)[-1]), 0.0))

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        m = self._matrix(_unit_max(d), shape).float()  # scaled first: no overflow in the products
        if not m.numel():
            return torch.zeros_like(d)
        s = polar_factor(m, self.quintic_steps, self.cubic_steps, self.QUINTIC_DTYPES[self.quintic_dtype])
        return (-radius * s.double()).reshape(-1).to(d.dtype)

    def batch_vertices(self, directions: Sequence[torch.Tensor], radii: Sequence[float],
                       shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """The vertices of many matrices: those of one matrix shape (and device) stacked into one batched
        Newton-Schulz (polar_factor works per matrix of the batch, so each vertex is what vertex() gives, up to
        the rounding of batched matrix products): a transformer's dozens of equal-shape matrices in a few
        launches instead of one chain of products each. On the CPU one matrix at a time is faster (a 6 x 256
        GPT's step, one thread: 656 ms against 757 ms batched; bench/optimizer_step.py), so matrices there are
        batched only with ``BATCH_ON_CPU``."""
        out: list[torch.Tensor | None] = [None] * len(directions)
        by_shape: dict = {}
        for i, (d, shape) in enumerate(zip(directions, shapes)):
            if d.device.type == "cpu" and not self.BATCH_ON_CPU:
                out[i] = self.vertex(d, radii[i], shape)
            elif d.numel():
                m_shape = tuple(self._matrix(torch.empty(shape, device="meta"), shape).shape)
                by_shape.setdefault((m_shape, d.device, d.dtype), []).append(i)
            else:
                out[i] = torch.zeros_like(d)
        for (m_shape, _, dtype), members in by_shape.items():
            batch = torch.stack([_unit_max(directions[i]).reshape(m_shape) for i in members]).float()
            s = polar_factor(batch, self.quintic_steps, self.cubic_steps,
                             self.QUINTIC_DTYPES[self.quintic_dtype]).double()
            for j, i in enumerate(members):
                out[i] = (-radii[i] * s[j]).reshape(-1).to(dtype)
        return out

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        # the vertices -r U V^T have Frobenius norm r sqrt(rank), at most r sqrt(min(m, n))
        m = self._matrix(torch.empty(shape, device="meta"), shape)
        return 2.0 * radius * math.sqrt(min(m.shape)) if m.numel() else 0.0


class ColumnNormBall(_MatrixSet):
    """Every column of each weight matrix in an L2 ball: ``{W : ||W[:, j]||_2 <= r for all j}`` (a tensor of more
    than two dimensions taken as ``(shape[0], -1)``): the set of Scion's input layers (its "ColNorm"). Vertex
    ``-r d[:, j] / ||d[:, j]||_2`` for every column (0 for a zero column), in closed form. The row-wise set
    (Scion's "RowNorm", for output layers) is :class:`L2Ball` with ``scope="row"``, which has fused kernels.
    Scope "tensor" only.
    """

    KIND, NAME, GAUGE = "column_norm_ball", "column-norm ball", "largest column L2 norm"
    CORRECTS_BY_GAUGE = True

    def gauge_parts(self, x: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self._matrix(x.double(), shape)  # each column is a ball of its own: scaled back alone
        index = torch.arange(m.numel(), device=x.device) % max(m.shape[1], 1)
        return torch.linalg.vector_norm(m, dim=0).cpu(), index.cpu()

    def gauge(self, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> float:
        if not x.numel():
            return 0.0
        return float(torch.linalg.vector_norm(self._matrix(x.double(), shape or tuple(x.shape)), dim=0).max())

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        m = self._matrix(_unit_max(d), shape)  # scaled first: the column norms neither underflow nor overflow
        norms = torch.linalg.vector_norm(m, dim=0, keepdim=True)
        s = torch.where(norms > 0, -radius * m / torch.where(norms > 0, norms, 1.0), 0.0)
        return s.reshape(-1).to(d.dtype)

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        m = self._matrix(torch.empty(shape, device="meta"), shape)
        return 2.0 * radius * math.sqrt(m.shape[1]) if m.numel() else 0.0


class Unconstrained(Constraint):
    """No set: the param group's parameters take a plain gradient step ``theta <- theta - alpha_k d`` with the
    group's step size and direction (its momentum for FrankWolfe, the forward-gradient estimate for FGFW and
    AFGFW; :func:`fgfw.reference.gradient_step_` is its spec). ``constraint=None`` in a param group means
    this. For parameters a set would only hurt, such as normalisation gains: give the group a step size
    that suits a gradient step (a learning rate), not Frank-Wolfe's default ``2/(k+2)``.
    """

    KIND, NAME, GAUGE = "unconstrained", "unconstrained group", "none"
    ALLOWED_SCOPES = ("tensor",)

    def __init__(self, radius: float | None = None, *, scope: str = "tensor", **kw):
        # no radius: the 1.0 stored is a placeholder the step never reads
        super().__init__(1.0 if radius is None else radius, scope=scope, **kw)

    def __repr__(self) -> str:
        return "Unconstrained()"

    def gauge(self, x: torch.Tensor) -> float:
        return 0.0

    def contains(self, x: torch.Tensor, radius: float, rtol: float = 1e-6) -> bool:
        return True

    def resolve_radii(self, params: Sequence[torch.Tensor]) -> list:
        return [1.0] * len(params)

    def make_feasible_(self, params: Sequence[torch.Tensor], radii: Sequence[float],
                       what: str = "initial parameters") -> None:
        return None

    def vertex(self, d: torch.Tensor, radius: float, shape: tuple[int, ...]) -> torch.Tensor:
        raise TypeError("an unconstrained group has no vertex: it takes a gradient step (reference.gradient_step_)")

    def l2_diameter(self, shape: tuple[int, ...], radius: float) -> float:
        return math.inf


def project_simplex(x: torch.Tensor, radius: float) -> torch.Tensor:
    """The Euclidean projection of the flat tensor x onto ``{y >= 0, sum y = r}`` (sort and threshold)."""
    if not x.numel():
        return x.clone()
    u = torch.sort(x, descending=True).values
    cumulative = torch.cumsum(u, 0) - radius
    index = torch.arange(1, x.numel() + 1, dtype=x.dtype, device=x.device)
    rho = int(torch.nonzero(u - cumulative / index > 0).max())
    tau = cumulative[rho] / (rho + 1)
    return (x - tau).clamp(min=0)


# kind (to_dict's tag) -> set, for from_dict
SETS: dict[str, type[Constraint]] = {c.KIND: c for c in (L1Ball, L2Ball, LInfBall, LpBall, KSparsePolytope, Simplex,
                                                         NonnegativeL1Ball, NuclearNormBall, GroupL1Ball,
                                                         SpectralNormBall, ColumnNormBall, Unconstrained)}


def from_dict(spec: object) -> Constraint:
    """The constraint that ``to_dict`` described (what an optimizer's ``state_dict`` holds).

    Raises ``ValueError`` naming what does not fit: not a dict, an unknown ``kind``, unknown keys, or
    values the constructor refuses.
    """
    if not isinstance(spec, dict) or spec.get("kind") not in SETS:
        described = f"kind {spec.get('kind')!r}" if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"constraint must be a dict {{'kind': ..., 'radius': ..., 'scope': ..., 'relative_scale': "
                         f"...}} (a constraint's to_dict()) with kind one of {sorted(SETS)}, got {described}")
    cls = SETS[spec["kind"]]
    own = {k for k in cls.PARAMS if k in spec}
    known = {"kind", "radius", "scope", "relative_scale", "rule", *cls.PARAMS}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"constraint {spec!r} has unknown keys {unknown}; a {cls.NAME} has "
                         f"{', '.join(sorted(known - {'kind'}))}")
    try:
        return cls(spec.get("radius"), scope=spec.get("scope", "tensor"), _relative_scale=spec.get("relative_scale"),
                   _rule=spec.get("rule", "relative_to_init"), **{k: spec[k] for k in own})
    except (TypeError, ValueError) as err:
        raise ValueError(f"constraint {spec!r} is not a valid {cls.NAME}: {err}") from None
