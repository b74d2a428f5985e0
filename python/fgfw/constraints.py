"""Constraint sets and their linear minimisation oracles (LMOs).

A constraint is one verb for the algorithms: ``lmo(direction, radius)`` returns
``argmin_{s in C} <direction, s>``. The optimizers never look inside a set; the fused kernels implement
the LMO of the sets they support (today the L1 ball) without materialising the vertex.
"""
from __future__ import annotations

import math
import sys
import warnings
from typing import Sequence

import torch

from . import reference

SCOPES = ("tensor", "global", "row")
KIND_L1_BALL = "l1_ball"


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised by the caller that points at the first frame outside fgfw and
    torch.optim (the user's line that built the optimizer)."""
    frame, level = sys._getframe(1), 1  # the warning's caller is stacklevel 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("fgfw.", "torch.optim")):
        frame, level = frame.f_back, level + 1
    return level


def _check_radius(radius, name: str = "radius") -> float:
    if isinstance(radius, bool) or not isinstance(radius, (int, float)):
        raise TypeError(f"{name} must be a positive real number, got {type(radius).__name__} {radius!r}")
    if not math.isfinite(radius) or radius <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {radius!r}")
    return float(radius)


class L1Ball:
    """The L1 ball ``{theta : ||theta||_1 <= r}`` (the paper's sparsity-promoting constraint).

    Args:
        radius: the radius r > 0. Leave it out and use :meth:`relative_to_init` for a rule.
        scope: ``"tensor"`` (default): one ball per parameter tensor, each of radius r (a product of balls;
            the paper's "constraint on the parameters in all layers"). ``"global"``: one ball over all
            parameters of a param group together (one vertex per step for the whole group). ``"row"``:
            one ball per slice ``p[i]`` along the first dimension of every tensor of two or more
            dimensions (a neuron's incoming weights, a convolution's output filter), one per tensor
            for the others (biases): every unit gets a vertex step at every step. Per-tensor balls let
            the unit with the largest gradient take every step of its layer while the other units shrink
            towards zero; in a narrow deep ReLU network they die (see bench/RESULTS.md).

    Its vertices are ``-r sign(d_i) e_i``: a scaled one-hot, never stored densely by the optimizers.
    """

    def __init__(self, radius: float | None = None, *, scope: str = "tensor", _relative_scale: float | None = None):
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        if radius is None and _relative_scale is None:
            raise ValueError("radius is required: pass L1Ball(radius=r) with r > 0, or use "
                             "L1Ball.relative_to_init(scale) to set it from the initial weights")
        self.radius = None if radius is None else _check_radius(radius)
        self.relative_scale = None if _relative_scale is None else _check_radius(_relative_scale, "scale")
        self.scope = scope

    @classmethod
    def relative_to_init(cls, scale: float = 1.0, *, scope: str = "tensor") -> "L1Ball":
        """A ball whose radius is ``scale`` times the L1 norm of the initial parameters.

        Per tensor (``scope="tensor"``: r_t = scale * ||theta_t^0||_1) or over the group (``"global"``).
        Measured on the weights at optimizer construction; ``scale >= 1`` keeps a default initialisation
        feasible, so training starts from the dense initial point instead of a rescaled one.
        """
        return cls(None, scope=scope, _relative_scale=scale)

    @property
    def global_ball(self) -> bool:
        return self.scope == "global"

    def __repr__(self) -> str:
        size = f"radius={self.radius}" if self.radius is not None else f"relative_to_init={self.relative_scale}"
        return f"L1Ball({size}, scope={self.scope!r})"

    def to_dict(self) -> dict:
        """The ball as plain values, as an optimizer's ``state_dict`` saves it (``torch.load`` with its default
        ``weights_only=True`` reads them); :func:`from_dict` builds the ball again."""
        return {"kind": KIND_L1_BALL, "radius": self.radius, "scope": self.scope,
                "relative_scale": self.relative_scale}

    @staticmethod
    def norm(tensors: Sequence[torch.Tensor]) -> float:
        return float(sum(t.detach().double().abs().sum() for t in tensors))

    @staticmethod
    def rows(p: torch.Tensor) -> list[torch.Tensor]:
        """The balls of ``p`` under scope "row": its slices along dim 0 (views), or ``p`` itself below 2-D."""
        p = p.detach()  # views of the same memory, without autograd history
        return list(p.unbind(0)) if p.dim() >= 2 else [p]

    def resolve_radii(self, params: Sequence[torch.Tensor]) -> list:
        """The radii: one per tensor ("tensor"), one for the group ("global"), a list per tensor ("row")."""
        if self.scope == "row":
            if self.radius is not None:
                return [[self.radius] * len(self.rows(p)) for p in params]
            return [L1Ball(scope="tensor", _relative_scale=self.relative_scale).resolve_radii(self.rows(p))
                    for p in params]
        if self.radius is not None:
            return [self.radius] if self.global_ball else [self.radius] * len(params)
        groups = [list(params)] if self.global_ball else [[p] for p in params]
        radii = []
        for i, tensors in enumerate(groups):
            norm = self.norm(tensors)
            if not norm > 0 or not math.isfinite(norm):
                where = "the group's parameters" if self.global_ball else f"parameter {i} (shape {tuple(tensors[0].shape)})"
                raise ValueError(f"L1Ball.relative_to_init cannot set a radius from {where}: its initial L1 norm is "
                                 f"{norm}; initialise it to non-zero values, or give it a param group of its own "
                                 f"with an explicit radius, e.g. {{'params': [...], 'constraint': "
                                 f"fgfw.L1Ball(radius=1.0)}}")
            radii.append(self.relative_scale * norm)
        return radii

    def make_feasible_(self, params: Sequence[torch.Tensor], radii: Sequence[float]) -> None:
        """Rescales an infeasible start into the ball (with a warning); feasible parameters are untouched."""
        if self.scope == "row":
            params = [row for p in params for row in self.rows(p)]
            radii = [r for per_tensor in radii for r in per_tensor]
        groups = [list(params)] if self.global_ball else [[p] for p in params]
        for tensors, r in zip(groups, radii):
            norm = self.norm(tensors)
            if norm <= r:
                continue
            # an excess within rounding (e.g. a radius set from these very weights) is removed silently
            if norm > r * (1 + 1e-6):
                warnings.warn(f"initial parameters have L1 norm {norm:.6g} > radius {r:.6g}: rescaled into the "
                              f"L1 ball by {r / norm:.6g} (pass a larger radius or L1Ball.relative_to_init to keep "
                              f"the initialisation)", stacklevel=_user_stacklevel())
            with torch.no_grad():
                for t in tensors:
                    t.mul_(r / norm)
                # the rescaled values are rounded: shrink by a few ulps until the stored norm is <= r, so
                # that the step's guarantee (reference.feasibility_shrink) starts from a feasible point
                for _ in range(16):
                    if self.norm(tensors) <= r:
                        break
                    for t in tensors:
                        t.mul_(1.0 - 4.0 * torch.finfo(t.dtype).eps)

    @staticmethod
    def lmo(direction: torch.Tensor, radius: float) -> torch.Tensor:
        """Dense ``argmin_{||s||_1 <= r} <direction, s>`` (reference; the kernels never build it)."""
        return reference.l1_lmo(direction, radius)


def from_dict(spec: object) -> L1Ball:
    """The constraint that ``to_dict`` described (what an optimizer's ``state_dict`` holds).

    Raises ``ValueError`` naming what does not fit: not a dict, an unknown ``kind``, unknown keys, or
    values the constructor refuses.
    """
    if not isinstance(spec, dict) or spec.get("kind") != KIND_L1_BALL:
        described = f"kind {spec.get('kind')!r}" if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"constraint must be a dict {{'kind': {KIND_L1_BALL!r}, 'radius': ..., 'scope': ..., "
                         f"'relative_scale': ...}} (L1Ball.to_dict()), got {described}")
    unknown = sorted(set(spec) - {"kind", "radius", "scope", "relative_scale"})
    if unknown:
        raise ValueError(f"constraint {spec!r} has unknown keys {unknown}; an L1 ball has radius, scope and "
                         f"relative_scale")
    try:
        return L1Ball(spec.get("radius"), scope=spec.get("scope", "tensor"), _relative_scale=spec.get("relative_scale"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"constraint {spec!r} is not a valid L1 ball: {err}") from None
