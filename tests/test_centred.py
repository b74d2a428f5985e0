"""Balls centred at the starting weights (param group ``center="init"``): the fine-tuning set
``{theta : theta - theta_0 in C}``, checked against the same optimizer stepping theta - theta_0 from 0."""
import io

import pytest
import torch
from torch import nn

import fgfw

F64 = torch.float64


@pytest.mark.parametrize("constraint", [fgfw.L1Ball(0.3, scope="row"), fgfw.L2Ball(0.2), fgfw.LInfBall(0.05),
                                        fgfw.KSparsePolytope(0.1, k=3), fgfw.NuclearNormBall(0.4)],
                         ids=["l1 rows", "l2", "linf", "k-sparse", "nuclear"])
def test_a_centred_ball_steps_theta_minus_its_start_as_an_uncentred_one_steps_from_zero(constraint):
    """theta_k - theta_0 of a centred group equals the iterate of the same optimizer on a parameter started at 0,
    fed the same gradients (float64: to a few ulps of theta, the rounding of subtracting and adding the centre)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, 7, generator=gen, dtype=F64)
    theta = nn.Parameter(start.clone())
    delta = nn.Parameter(torch.zeros(5, 7, dtype=F64))
    centred = fgfw.FrankWolfe([{"params": [theta], "constraint": constraint, "center": "init"}],
                              constraint=None, momentum=0.9, step_size=0.1)
    plain = fgfw.FrankWolfe([delta], constraint=constraint, momentum=0.9, step_size=0.1)
    for _ in range(20):
        g = torch.randn(5, 7, generator=gen, dtype=F64)
        theta.grad, delta.grad = g.clone(), g.clone()
        centred.step()
        plain.step()
        torch.testing.assert_close(theta.detach() - start, delta.detach(), rtol=0, atol=1e-14)
        torch.testing.assert_close(centred.last_gap, plain.last_gap, rtol=1e-12, atol=1e-14)


def test_afgfw_keeps_a_model_within_its_balls_around_the_pre_trained_weights():
    """A forward-gradient optimizer on a model (the lean engine): every row of every weight stays within its L1
    ball of radius 0.1 x its starting norm around the starting weights, where an origin-centred ball of the same
    radius would have forced the weights to shrink to a tenth."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    starts = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = fgfw.AFGFW(model, [{"params": list(model.parameters()), "center": "init",
                              "constraint": fgfw.L1Ball.relative_to_init(0.1, scope="row")}],
                     constraint=None, seed=3)
    radii = opt.param_groups[0]["radii"]
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    for _ in range(30):
        opt.step(lambda: nn.functional.cross_entropy(model(x), y))
    for (name, p), r in zip(model.named_parameters(), radii):
        delta = (p.detach() - starts[name]).double()
        norms = delta.abs().sum(-1) if p.dim() > 1 else delta.abs().sum().reshape(1)
        bound = torch.tensor(r if isinstance(r, (list, tuple)) else [r], dtype=F64)
        # the stored theta is one rounding of c + delta: within ~u |theta| of the ball
        slack = 4 * torch.finfo(torch.float32).eps * (p.detach().abs().sum(-1) if p.dim() > 1 else p.abs().sum())
        assert bool((norms <= bound * (1 + 1e-6) + slack.double()).all()), (name, norms, bound)
        assert float(delta.abs().max()) > 0  # it moved


def test_a_centred_group_resumes_from_its_state_dict():
    gen = torch.Generator().manual_seed(1)
    theta = nn.Parameter(torch.randn(4, 6, generator=gen))
    make = lambda p: fgfw.FrankWolfe([{"params": [p], "constraint": fgfw.L1Ball(0.5), "center": "init"}],  # noqa: E731
                                     constraint=None, step_size=0.2)
    opt = make(theta)
    grads = [torch.randn(4, 6, generator=gen) for _ in range(6)]
    for g in grads[:3]:
        theta.grad = g.clone()
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    twin = nn.Parameter(theta.detach().clone())
    resumed = make(twin)  # its own centre would be the current values: the saved one must win
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    for g in grads[3:]:
        theta.grad, twin.grad = g.clone(), g.clone()
        opt.step()
        resumed.step()
    assert torch.equal(theta, twin)


def test_center_is_checked_and_fixed_when_the_group_is_added():
    p = nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match="center must be one of"):
        fgfw.FrankWolfe([{"params": [p], "center": "start"}], constraint=fgfw.L1Ball(1.0))
    opt = fgfw.FrankWolfe([{"params": [p], "center": "init"}], constraint=fgfw.L1Ball(1.0))
    opt.param_groups[0]["center"] = None
    before = p.detach().clone()
    p.grad = torch.ones(3, 3)
    with pytest.raises(ValueError, match="center was changed"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_a_smaller_radius_mid_run_moves_theta_minus_its_centre_into_the_new_ball():
    """A radius changed between steps rescales the offset from the centre (not theta itself) into the new ball."""
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(10, generator=gen, dtype=F64) + 5.0  # far from 0: rescaling theta would be obvious
    theta = nn.Parameter(start.clone())
    opt = fgfw.FrankWolfe([{"params": [theta], "constraint": fgfw.L1Ball(1.0), "center": "init"}],
                          constraint=None, step_size=0.5)
    for _ in range(4):
        theta.grad = torch.randn(10, generator=gen, dtype=F64)
        opt.step()
    offset = theta.detach() - start
    opt.param_groups[0]["constraint"].radius = 0.25
    theta.grad = torch.zeros(10, dtype=F64)
    with pytest.warns(UserWarning, match="less their centre"):
        opt.step()
    new_offset = theta.detach() - start
    assert float(new_offset.abs().sum()) <= 0.25 * (1 + 1e-12)
    # a zero gradient's vertex is the first element's; the rest of the offset is the rescaled old offset, halved
    torch.testing.assert_close(new_offset[1:], 0.5 * offset[1:] * (0.25 / float(offset.abs().sum())),
                               rtol=1e-12, atol=1e-14)


def test_param_groups_pass_the_centre_through():
    """fgfw.param_groups with a dict of group options: the weights' balls around their start, the rest unconstrained;
    after FrankWolfe steps every weight row is within its radius of its start (float64: to rounding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2)).double()
    starts = [m.weight.detach().clone() for m in (model[0], model[2])]
    groups = fgfw.param_groups(model, weights={"constraint": fgfw.L1Ball.relative_to_init(0.2, scope="row"),
                                               "center": "init"})
    opt = fgfw.FrankWolfe(groups, constraint=None, step_size=0.3)
    x = torch.randn(16, 6, dtype=F64)
    for _ in range(10):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    for m, start in zip((model[0], model[2]), starts):
        moved = (m.weight.detach() - start).abs().sum(dim=1)
        assert bool((moved <= 0.2 * start.abs().sum(dim=1) * (1 + 1e-12)).all())
        assert float(moved.max()) > 0
