"""L1Ball(scope="row"): one L1 ball per output unit, checked against a dense per-row Frank-Wolfe written out."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import reference


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()


def batch(seed=1, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def balls(p):
    """(flat index lists of p's balls): its rows for 2-D weights, the whole tensor for biases."""
    if p.dim() >= 2:
        width = p[0].numel()
        return [list(range(i * width, (i + 1) * width)) for i in range(p.shape[0])]
    return [list(range(p.numel()))]


def dense_row_step(params, directions, radii, alpha):
    """theta <- (1 - alpha) theta + alpha s with s the L1 vertex of every ball, from the direction d."""
    for p, d, rs in zip(params, directions, radii):
        flat, dflat = p.view(-1), d.reshape(-1)
        new = (1 - alpha) * flat.clone()
        for idx, r in zip(balls(p), rs):
            idx = torch.tensor(idx)
            new[idx] += alpha * reference.l1_lmo(dflat[idx], r)
        flat.copy_(new)


def test_relative_radii_are_per_row_and_feasible():
    model = mlp()
    weight = model[0].weight.detach().clone()
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball.relative_to_init(1.5, scope="row"))
    radii = opt.param_groups[0]["radii"]
    assert radii[0] == pytest.approx([1.5 * float(row.abs().sum()) for row in weight])
    assert radii[1] == pytest.approx([1.5 * float(model[0].bias.detach().abs().sum())])
    small = mlp()
    with pytest.warns(UserWarning, match="rescaled") as record:
        fgfw.FrankWolfe(small.parameters(), constraint=fgfw.L1Ball(radius=0.1, scope="row"))
    # one warning that counts the balls moved, not one per row
    rescaled = [str(w.message) for w in record if "rescaled" in str(w.message)]
    outside = sum(int((p.detach().abs().sum(-1) > 0.1).sum()) for p in mlp().parameters())  # rows, and biases
    assert len(rescaled) == 1 and f"the first of {outside} balls of the 10 (row scope)" in rescaled[0], rescaled
    # each row of each weight, and each bias, is rescaled into its own ball
    assert small[0].weight.detach().abs().sum(1) == pytest.approx([0.1] * 5)
    assert float(small[2].bias.detach().abs().sum()) == pytest.approx(0.1)


def test_frank_wolfe_with_momentum_matches_dense_per_row_steps():
    model, expected = mlp(), mlp()
    constraint = fgfw.L1Ball.relative_to_init(2.0, scope="row")
    opt = fgfw.FrankWolfe(model.parameters(), constraint=constraint, step_size=0.1, momentum=0.5)
    radii = opt.param_groups[0]["radii"]
    v = [torch.zeros_like(p) for p in expected.parameters()]
    for i in range(5):
        x, y = batch(seed=10 + i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        expected.zero_grad()
        F.cross_entropy(expected(x), y).backward()
        with torch.no_grad():
            for vv, p in zip(v, expected.parameters()):
                vv.mul_(0.5).add_(0.5 * p.grad)
            dense_row_step(list(expected.parameters()), v, radii, 0.1)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_afgfw_rows_use_the_tangents_of_the_whole_tensor():
    model, expected = mlp(), mlp()
    x, y = batch()
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0, scope="row"), seed=7, num_tangents=2,
                     step_size=0.2, averaging_weight="1/sqrt(k)")
    params = list(expected.parameters())
    offsets = [0]  # the optimizer's stream layout: every tensor starts at a multiple of 4
    for p in params[:-1]:
        offsets.append(offsets[-1] + -(-p.numel() // 4) * 4)
    v = [torch.zeros_like(p) for p in params]
    radii = [[10.0] * len(balls(p)) for p in params]
    for k in range(1, 5):
        opt.step(lambda: F.cross_entropy(model(x), y))
        expected.zero_grad()
        F.cross_entropy(expected(x), y).backward()
        us = [[reference.tangent(p.numel(), 7, k, t, o, 0).double().view(p.shape) for p, o in zip(params, offsets)]
              for t in range(2)]
        cs = [sum(float((p.grad * u).sum()) for p, u in zip(params, ut)) for ut in us]
        gamma = 1 / math.sqrt(k)
        with torch.no_grad():
            for j, p in enumerate(params):
                g_hat = sum(c * ut[j] for c, ut in zip(cs, us)) / 2
                v[j] = (1 - gamma) * v[j] + gamma * g_hat
            dense_row_step(params, v, radii, 0.2)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_every_row_stays_in_its_ball():
    model, (x, y) = mlp(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fgfw.FGFW(model, constraint=fgfw.L1Ball(radius=0.3, scope="row"), seed=0, step_size=0.5)
    for _ in range(10):
        opt.step(lambda: F.cross_entropy(model(x), y))
        for p in model.parameters():
            norms = p.detach().abs().sum(-1) if p.dim() >= 2 else p.detach().abs().sum().reshape(1)
            assert float(norms.max()) <= 0.3 * (1 + 1e-9)
