"""bench/mezo.py (the MeZO baseline) on a quadratic, against closed forms and z drawn here from the step's seed.

For f(x) = 1/2 x^T A x + b^T x the central difference is exact: (f(x + eps z) - f(x - eps z)) / (2 eps)
= <A x + b, z>. The z's are drawn by this file from ``last_seed`` with its own generator, so a MeZO that
drew other z's for the update than for the perturbation, or moved a parameter by the wrong amount,
fails here.
"""
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from mezo import MeZO  # noqa: E402


class Quadratic(nn.Module):
    """f(x) = 1/2 x^T A x + b^T x over two parameter tensors (a matrix and a vector, flattened together)."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g, dtype=dtype))
        self.v = nn.Parameter(torch.randn(5, generator=g, dtype=dtype))
        m = torch.randn(17, 17, generator=g, dtype=torch.float64)
        self.register_buffer("A", (m @ m.T / 17 + torch.eye(17, dtype=torch.float64)).to(dtype))
        self.register_buffer("b", torch.randn(17, generator=g, dtype=torch.float64).to(dtype))

    def flat(self):
        return torch.cat([self.w.reshape(-1), self.v])

    def forward(self):
        x = self.flat()
        return 0.5 * x @ self.A @ x + self.b @ x


def z_of(model, seed):
    """The step's z, drawn here: one CPU generator seeded with the step's seed, the tensors in order."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(p.shape, generator=g, dtype=p.dtype).reshape(-1) for p in model.parameters()])


def test_one_step_against_the_closed_form():
    model = Quadratic()
    opt = MeZO(model.parameters(), lr=0.01, eps=1e-3, seed=7)
    x0 = model.flat().detach().clone()
    seen = []
    loss_plus = opt.step(lambda: (seen.append(model.flat().detach().clone()), model())[1])
    z = z_of(model, opt.last_seed)
    eps = 1e-3
    # the two forwards ran at x0 + eps z and x0 - eps z (the second reached through x0 + eps z - 2 eps z)
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], x0 + eps * z, rtol=0, atol=1e-15)
    torch.testing.assert_close(seen[1], x0 - eps * z, rtol=0, atol=1e-15)
    f = lambda x: 0.5 * x @ model.A @ x + model.b @ x  # noqa: E731
    assert float(loss_plus) == pytest.approx(float(f(x0 + eps * z)), rel=1e-14)
    central = (f(x0 + eps * z) - f(x0 - eps * z)) / (2 * eps)
    directional = (model.A @ x0 + model.b) @ z  # the exact <grad f(x0), z>
    assert opt.last_projected_gradient == pytest.approx(float(central), rel=1e-9)
    assert opt.last_projected_gradient == pytest.approx(float(directional), rel=1e-9)
    torch.testing.assert_close(model.flat().detach(), x0 - 0.01 * opt.last_projected_gradient * z, rtol=0,
                               atol=1e-14)


def test_perturbations_restore_the_parameters_up_to_rounding():
    # float32, where a rounding error is visible: theta + eps z - 2 eps z + eps z is theta to within the
    # rounding of three additions, |err| <= 4 * 2^-24 (|theta| + 2 eps |z|) per element
    model = Quadratic(torch.float32)
    opt = MeZO(model.parameters(), lr=0.01, eps=0.05, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    for scale in (opt.eps, -2 * opt.eps, opt.eps):
        opt.perturb_(1234, scale)
    for p, p0, (_, z) in zip(model.parameters(), before, opt.perturbations(1234)):
        bound = 4 * 2.0**-24 * (p0.abs() + 2 * opt.eps * z.abs())
        assert ((p.detach() - p0).abs() <= bound).all()


def test_z_is_regenerated_bit_for_bit_per_tensor():
    model = Quadratic(torch.float32)
    opt = MeZO(model.parameters(), lr=0.01, seed=0)
    first = [z for _, z in opt.perturbations(99)]
    again = [z for _, z in opt.perturbations(99)]
    other = [z for _, z in opt.perturbations(100)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))
    torch.testing.assert_close(torch.cat([z.reshape(-1) for z in first]), z_of(model, 99), rtol=0, atol=0)


def test_same_seed_same_run():
    runs = []
    for _ in range(2):
        model = Quadratic()
        opt = MeZO(model.parameters(), lr=0.01, seed=5)
        for _ in range(10):
            opt.step(model)
        runs.append(model.flat().detach())
    assert torch.equal(*runs)


def test_converges_on_the_quadratic():
    # expected descent per step is -lr ||grad||^2 (1 - lr L (d + 2) / 2), d = 17, L = the largest eigenvalue of A
    # (5.9): lr = 0.01 makes lr L (d + 2) / 2 = 0.56
    model = Quadratic()
    opt = MeZO(model.parameters(), lr=0.01, seed=11)
    x_star = -torch.linalg.solve(model.A, model.b)
    f_star = float(0.5 * x_star @ model.A @ x_star + model.b @ x_star)
    gap0 = float(model().detach()) - f_star
    for _ in range(3000):
        opt.step(model)
    assert float(model().detach()) - f_star < 1e-3 * gap0


def test_rejects_bad_arguments():
    model = Quadratic()
    with pytest.raises(ValueError, match="lr and eps"):
        MeZO(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="requires_grad"):
        MeZO([torch.zeros(3)], lr=0.1)
