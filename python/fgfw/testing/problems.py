"""Convex problems with certified optima, for the tests and benchmarks of every backend.

Each problem draws its data on the CPU from a seeded generator (the same numbers for every device), certifies its
optimum there in float64, and then holds every tensor on the ``device`` it is asked for: the values a test
compares with its iterates live where the iterates do. A GPU run once found a problem that kept its matrix on the
CPU, so every test of the feasible update on CUDA and Triton failed with "mat is on cpu" before checking anything.
Every factory here passes its device explicitly (tests/test_testing_problems.py runs them with another default
device to check that).

Imports only the constraint sets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constraints import Constraint, KSparsePolytope, L1Ball, L2Ball, LInfBall

CPU = torch.device("cpu")


def l1_ball_projection(b: torch.Tensor, radius: float) -> torch.Tensor:
    """Euclidean projection of a vector onto the L1 ball (Duchi et al. 2008): sort, threshold, shrink."""
    if float(b.abs().sum()) <= radius:
        return b.clone()
    mu = torch.sort(b.abs(), descending=True).values
    cssv = torch.cumsum(mu, 0) - radius
    ind = torch.arange(1, b.numel() + 1, dtype=b.dtype, device=b.device)
    rho = int(torch.nonzero(mu - cssv / ind > 0).max())
    return torch.sign(b) * torch.clamp(b.abs() - cssv[rho] / (rho + 1), min=0)


def least_squares_problem(dim: int, radius: float = 1.0, seed: int = 3, device: torch.device | str = CPU):
    """(f, theta*, f*) for f(theta) = 0.5 ||Q theta - y||^2 over the L1 ball, with a certified optimum; Q, y and
    theta* on ``device``.

    Q (2 dim x dim) has orthonormal columns, so f(theta) = 0.5 ||theta - Q^T y||^2 + const and
    theta* = the projection of Q^T y onto the ball, in closed form. y is large enough that the
    constraint is active at theta*.
    """
    g = torch.Generator(device=CPU).manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(2 * dim, dim, generator=g, dtype=torch.float64, device=CPU))
    y = torch.randn(2 * dim, generator=g, dtype=torch.float64, device=CPU) * 3
    theta_star = l1_ball_projection(q.T @ y, radius)
    q, y, theta_star = q.to(device), y.to(device), theta_star.to(device)

    def f(theta: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((q @ theta - y) ** 2).sum()

    return f, theta_star, float(f(theta_star))


def set_projection(constraint: Constraint, x: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of the float64 vector x onto ``constraint`` at its radius (L1, L2, L-infinity,
    k-sparse), on x's device."""
    r = constraint.radius
    if isinstance(constraint, L1Ball):
        return l1_ball_projection(x, r)
    if isinstance(constraint, L2Ball):
        norm = float(torch.linalg.vector_norm(x))
        return x * (r / norm) if norm > r else x.clone()
    if isinstance(constraint, LInfBall):
        return x.clamp(-r, r)
    if isinstance(constraint, KSparsePolytope):
        # {|x_i| <= r, ||x||_1 <= k r}: sign(x) clamp(|x| - tau, 0, r) with the least tau >= 0 that meets the L1
        # bound. mass(tau) is piecewise linear and falling, with kinks at |x_i| and |x_i| - r: find the kinks
        # around k r and interpolate.
        magnitude = x.abs()
        mass = lambda tau: (magnitude[None, :] - tau[:, None]).clamp(0, r).sum(1)  # noqa: E731
        zero = torch.zeros(1, dtype=x.dtype, device=x.device)
        if float(mass(zero)) <= constraint.k * r:
            return x.clamp(-r, r)
        kinks = torch.cat([zero, magnitude, (magnitude - r).clamp(min=0)]).unique()
        masses = mass(kinks)
        above = int((masses > constraint.k * r).nonzero().max())  # kinks ascend, masses fall
        t0, t1, m0, m1 = kinks[above], kinks[above + 1], masses[above], masses[above + 1]
        tau = t0 + (t1 - t0) * (m0 - constraint.k * r) / (m0 - m1)
        return torch.sign(x) * (magnitude - tau).clamp(0, r)
    raise ValueError(f"no projection for {constraint!r}: L1Ball, L2Ball, LInfBall or KSparsePolytope")


@dataclass
class LeastSquaresOver:
    """f(x) = ||A x - b||^2 over a set, with its optimum: A, b in float32 (the runs' data), f evaluated in
    float64 on those values, on the device the problem was built for. ``f_star`` is a certified lower bound:
    f(x_star) minus the Frank-Wolfe gap ``certificate`` of x_star (f(x) - f* <= <grad f(x), x - s> for every
    feasible x)."""
    a: torch.Tensor
    b: torch.Tensor
    x_star: torch.Tensor
    f_star: float
    certificate: float
    # -<grad f(x*), x*> = r df*/dr: an iterate a relative delta inside the ball along x* costs about this times delta
    radius_price: float

    def value(self, x: torch.Tensor) -> float:
        """f(x) in float64; x must be on the problem's device (as the iterates of a run on it are)."""
        if x.device != self.a.device:
            raise ValueError(f"x is on {x.device}, the problem on {self.a.device}: build the problem with "
                             f"device={x.device}")
        residual = self.a.double() @ x.detach().double().reshape(-1) - self.b.double()
        return float(residual @ residual)

    def suboptimality(self, x: torch.Tensor) -> float:
        return self.value(x) - self.f_star


def least_squares_over(constraint: Constraint, dim: int = 50, seed: int = 0, iterations: int = 3_000,
                       device: torch.device | str = CPU) -> LeastSquaresOver:
    """A least-squares problem over ``constraint`` (radius given, one ball of ``dim`` elements) whose unconstrained
    optimum lies three radii out (b = A x_far, gauge(x_far) = 3 r), so the set is active at the optimum; its
    tensors on ``device``.

    The optimum comes from projected gradient in float64 on the CPU (step 1/L; A^T A is well conditioned, so it
    converges linearly) and is certified by its Frank-Wolfe gap, computed with the set's vertex."""
    gen = torch.Generator(device=CPU).manual_seed(seed)
    a = torch.randn(2 * dim, dim, generator=gen, device=CPU)
    direction = torch.randn(dim, generator=gen, dtype=torch.float64, device=CPU)
    x_far = direction * (3.0 * constraint.radius / constraint.gauge(direction))
    b = (a.double() @ x_far).float()
    a64, b64 = a.double(), b.double()
    step = 1.0 / (2.0 * float(torch.linalg.matrix_norm(a64, 2)) ** 2)
    x = torch.zeros(dim, dtype=torch.float64, device=CPU)
    for _ in range(iterations):
        x = set_projection(constraint, x - step * 2.0 * (a64.T @ (a64 @ x - b64)))
    grad = 2.0 * (a64.T @ (a64 @ x - b64))
    certificate = float(grad @ (x - constraint.vertex(grad, constraint.radius, (dim,))))
    residual = a64 @ x - b64
    return LeastSquaresOver(a.to(device), b.to(device), x.to(device), float(residual @ residual) - certificate,
                            certificate, float(-(grad @ x)))
