"""The radius rules on tensors that start at zero, and fgfw.param_groups.

A zero tensor has no multiple of its norm that is a ball: the rules then take the expected initial norm from
draws of its module's reset_parameters (where the module is known), else a unit-L2 stand-in (every entry
1/sqrt(n)). Checked against the closed forms of those expectations and against the stated stand-in.
"""
import math

import numpy as np
import pytest
import torch
from torch import nn

import fgfw
from fgfw import constraints


def _zeroed_linear(fan_in=64, fan_out=32):
    layer = nn.Linear(fan_in, fan_out)
    nn.init.zeros_(layer.bias)
    return layer


def test_a_zeroed_bias_takes_its_modules_expected_initial_norm():
    # nn.Linear draws its bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)): E|b_i| = 1/(2 sqrt(fan_in)), so
    # E||b||_1 = fan_out / (2 sqrt(fan_in)) and E||b||_2^2 = fan_out / (3 fan_in)
    fan_in, fan_out = 64, 32
    layer = _zeroed_linear(fan_in, fan_out)
    opt = fgfw.FrankWolfe(layer, constraint=fgfw.L1Ball.relative_to_init(2.0))
    radius = opt.param_groups[0]["radii"][1]
    expected = 2.0 * fan_out / (2 * math.sqrt(fan_in))
    # the mean of INIT_DRAWS draws of a 32-element L1 norm: within a few standard errors (sd of |b_i| is
    # 1/(2 sqrt(3 fan_in)), so sd of the mean radius is 2 * sqrt(fan_out / (3 * 4 fan_in * draws)))
    sd = 2.0 * math.sqrt(fan_out / (12 * fan_in * constraints.INIT_DRAWS))
    assert abs(radius - expected) < 4 * sd, (radius, expected)
    opt = fgfw.FrankWolfe(_zeroed_linear(fan_in, fan_out), constraint=fgfw.L2Ball.relative_to_init(1.0))
    assert opt.param_groups[0]["radii"][1] == pytest.approx(math.sqrt(fan_out / (3 * fan_in)), rel=0.1)
    # the module's own values are untouched, and so is the caller's random stream
    assert not layer.bias.any()


def test_the_draws_leave_the_random_stream_and_the_module_alone():
    model = nn.Sequential(_zeroed_linear(), nn.BatchNorm1d(32))
    model[1].running_mean.fill_(3.0)
    state = torch.random.get_rng_state()
    weight = model[0].weight.detach().clone()
    fgfw.FrankWolfe(model, constraint=fgfw.L1Ball.relative_to_init(5.0))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(model[0].weight, weight)
    assert torch.equal(model[1].running_mean, torch.full((32,), 3.0))  # BatchNorm's reset zeroes its statistics


@pytest.mark.parametrize("cls,stand_in", [
    (fgfw.L1Ball, lambda n: math.sqrt(n)), (fgfw.L2Ball, lambda n: 1.0), (fgfw.LInfBall, lambda n: 1 / math.sqrt(n)),
])
def test_a_normalisation_shift_takes_the_unit_l2_stand_in(cls, stand_in):
    # LayerNorm draws its shift as zeros again: the rule on entries 1/sqrt(n); its gain (ones) the rule on ones
    norm = nn.LayerNorm(48)
    opt = fgfw.FrankWolfe(norm, constraint=cls.relative_to_init(3.0))
    gain_radius, shift_radius = opt.param_groups[0]["radii"]
    assert shift_radius == pytest.approx(3.0 * stand_in(48), rel=1e-12)
    ones = torch.ones(48, dtype=torch.float64)
    assert gain_radius == pytest.approx(3.0 * {fgfw.L1Ball: 48.0, fgfw.L2Ball: math.sqrt(48), fgfw.LInfBall: 1.0}[cls])
    assert cls(radius=1.0).gauge(ones) > 0


def test_from_init_diameter_on_a_zero_tensor_uses_the_same_stand_in():
    norm = nn.LayerNorm(20)
    opt = fgfw.FrankWolfe(norm, constraint=fgfw.KSparsePolytope.from_init_diameter(0.5, k=3))
    c = fgfw.KSparsePolytope(radius=1.0, k=3)
    # the stand-in's L2 norm is 1: r = 2 * 0.5 * 1 / diameter of the unit ball
    assert opt.param_groups[0]["radii"][1] == pytest.approx(1.0 / c.l2_diameter((20,), 1.0), rel=1e-12)


def test_zero_rows_take_their_rows_in_the_draws():
    # an nn.Embedding draws N(0, 1) rows: a zeroed row takes E||row||_1 = n sqrt(2/pi) (padding rows, say)
    embed = nn.Embedding(10, 400)
    with torch.no_grad():
        embed.weight[3].zero_()
    opt = fgfw.FrankWolfe(embed, constraint=fgfw.L1Ball.relative_to_init(1.0, scope="row"))
    radii = opt.param_groups[0]["radii"][0]
    assert radii[3] == pytest.approx(400 * math.sqrt(2 / math.pi), rel=0.05)
    assert radii[2] == pytest.approx(float(embed.weight[2].double().abs().sum()), rel=1e-12)


def test_without_a_module_the_stand_in_applies_and_nothing_crashes():
    p = torch.zeros(25, requires_grad=True)
    opt = fgfw.FrankWolfe([p], constraint=fgfw.L1Ball.relative_to_init(2.0))
    assert opt.param_groups[0]["radii"] == [2.0 * 5.0]


def test_a_non_finite_start_still_raises():
    p = torch.tensor([1.0, float("inf")], requires_grad=True)
    with pytest.raises(ValueError, match="inf"):
        fgfw.FrankWolfe([p], constraint=fgfw.L1Ball.relative_to_init(2.0))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 30, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once, as the embedding's
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def test_param_groups_split_by_role():
    model = Block()
    groups = fgfw.param_groups(model, weights=fgfw.L1Ball(radius=3.0), biases=fgfw.LInfBall(radius=0.5),
                               norms={"constraint": fgfw.L2Ball(radius=2.0), "step_size": 0.1},
                               embeddings=fgfw.KSparsePolytope(radius=1.0, k=4))
    by_role = {g["role"]: g for g in groups}
    assert [g["role"] for g in groups] == ["weights", "biases", "norms", "embeddings"]
    ids = lambda ps: [id(p) for p in ps]  # noqa: E731
    assert ids(by_role["weights"]["params"]) == ids([model.proj.weight])
    assert ids(by_role["biases"]["params"]) == ids([model.proj.bias])
    assert ids(by_role["norms"]["params"]) == ids([model.norm.weight, model.norm.bias, model.bn.weight, model.bn.bias])
    assert ids(by_role["embeddings"]["params"]) == ids([model.embed.weight])
    assert by_role["norms"]["step_size"] == 0.1
    opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=1.0))
    assert [type(g["constraint"]).__name__ for g in opt.param_groups] == ["L1Ball", "LInfBall", "L2Ball",
                                                                         "KSparsePolytope"]
    assert sum(len(g["params"]) for g in opt.param_groups) == len([p for p in model.parameters() if p.requires_grad])


def test_param_groups_refuse_bad_roles():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        fgfw.param_groups([torch.zeros(2)], weights=fgfw.L1Ball(radius=1.0))
    with pytest.raises(TypeError, match="biases must be an fgfw constraint"):
        fgfw.param_groups(Block(), weights=fgfw.L1Ball(radius=1.0), biases="l1")
    with pytest.raises(ValueError, match="must not hold 'params'"):
        fgfw.param_groups(Block(), weights={"params": [], "constraint": fgfw.L1Ball(radius=1.0)})


def test_param_groups_register_the_modules_for_the_radius_rules():
    model = nn.Sequential(_zeroed_linear(16, 40))
    groups = fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(1.0),
                               biases=fgfw.L1Ball.relative_to_init(1.0))
    opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=1.0))
    # the zeroed bias's radius comes from U(-1/4, 1/4) draws (E||b||_1 = 40/8 = 5), not from the stand-in
    # (sqrt(40) = 6.3)
    assert opt.param_groups[1]["radii"][0] == pytest.approx(5.0, rel=0.15)
    assert np.isfinite(opt.param_groups[1]["radii"][0])


def test_relative_to_init_below_one_shrinks_without_a_warning():
    import warnings
    layer = nn.Linear(6, 4)
    weight = layer.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shrink is what scale < 1 asks for, not a mistake to warn about
        fgfw.FrankWolfe([layer.weight], constraint=fgfw.L1Ball.relative_to_init(0.5))
    assert float(layer.weight.detach().abs().sum()) <= 0.5 * float(weight.abs().sum()) * (1 + 1e-6)
    with pytest.warns(UserWarning, match="rescaled"):  # an explicit radius below the start still warns
        fgfw.FrankWolfe([nn.Linear(6, 4).weight], constraint=fgfw.L1Ball(radius=0.01))
