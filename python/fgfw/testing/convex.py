"""The optimizers on :func:`fgfw.testing.problems.least_squares_problem`: f - f* after every step (Theorems 1-2 of
the paper on a convex problem; tests/test_convex.py, bench/convex.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..constraints import L1Ball
from ..optim import AFGFW, FGFW, FrankWolfe
from .problems import least_squares_problem


class _Point(nn.Module):
    """theta as the one parameter of a module: the forward-gradient optimizers perturb module parameters."""

    def __init__(self, dim: int, device: torch.device | str):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(dim, dtype=torch.float64, device=device))


def convex_suboptimality(method: str, seed: int, steps: int, dim: int = 10, radius: float = 1.0,
                         device: torch.device | str = "cpu", **options) -> list[float]:
    """f(theta_k) - f* after each step of ``method`` ("fw", "fgfw", "afgfw") on :func:`least_squares_problem`, on
    ``device``.

    Starts at theta_0 = 0 with the optimizer's default (the paper's) schedules unless ``options`` says
    otherwise; raises ``AssertionError`` if an iterate leaves the ball.
    """
    f, _, f_star = least_squares_problem(dim, radius, device=device)
    point = _Point(dim, device)
    constraint = L1Ball(radius=radius)
    if method == "fw":
        opt = FrankWolfe([point.theta], constraint=constraint, **options)
    else:
        opt = {"fgfw": FGFW, "afgfw": AFGFW}[method](point, constraint=constraint, seed=seed, **options)
    curve = []
    for _ in range(steps):
        if method == "fw":
            opt.zero_grad()
            f(point.theta).backward()
            opt.step()
        else:
            opt.step(lambda: f(point.theta))
        theta = point.theta.detach()
        if float(theta.abs().sum()) > radius * (1 + 1e-9):
            raise AssertionError(f"{method} left the L1 ball: ||theta||_1 = {float(theta.abs().sum())} > {radius}")
        curve.append(float(f(theta)) - f_star)
    return curve
