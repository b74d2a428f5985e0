"""Param groups share fused calls: one call per (device, compute dtype, schedule), whatever the number of
groups, and a model split into one group per tensor steps exactly as the same model in one group."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import _ops


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 12, generator=gen), torch.randint(0, 3, (32,), generator=gen)


@pytest.fixture
def op_calls(monkeypatch):
    """How many fused op calls the optimizers make."""
    calls = []
    original = _ops.l1_fw_step_

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return original(*args, **kwargs)

    monkeypatch.setattr(_ops, "l1_fw_step_", counting)
    return calls


def _groups(model, per_tensor, **group):
    params = list(model.parameters())
    return [dict(group, params=[p]) for p in params] if per_tensor else [dict(group, params=params)]


def _frank_wolfe_run(per_tensor, steps=15):
    model = _mlp()
    opt = fgfw.FrankWolfe(_groups(model, per_tensor), constraint=fgfw.L1Ball(radius=3.0, scope="row"),
                          momentum=0.9)
    x, y = _batch()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], float(opt.last_gap)


def _afgfw_run(per_tensor, steps=15):
    model = _mlp()
    opt = fgfw.AFGFW(model, _groups(model, per_tensor), constraint=fgfw.L1Ball(radius=3.0), step_size=0.05,
                     seed=4, tangent="rademacher", num_tangents=2)
    x, y = _batch()
    for _ in range(steps):
        opt.step(lambda: F.cross_entropy(model(x), y))
    return [p.detach().clone() for p in model.parameters()], float(opt.last_gap)


@pytest.mark.parametrize("run", [_frank_wolfe_run, _afgfw_run])
def test_one_group_per_tensor_steps_exactly_as_one_group(run, op_calls):
    one, _ = run(per_tensor=False), op_calls.copy()
    calls_one = list(op_calls)
    op_calls.clear()
    many = run(per_tensor=True)
    for p, q in zip(one[0], many[0]):
        assert torch.equal(p, q)
    assert one[1] == pytest.approx(many[1], rel=1e-12)  # the gap is summed in another order only
    # one fused call per step, six tensors each, either way
    assert calls_one == list(op_calls) == [6] * 15


def test_groups_differing_in_radius_and_scope_share_a_call(op_calls):
    model = _mlp()
    layers = [m for m in model if isinstance(m, nn.Linear)]
    groups = [{"params": list(layers[0].parameters()), "constraint": fgfw.L1Ball(radius=1.0, scope="row")},
              {"params": list(layers[1].parameters()), "constraint": fgfw.L1Ball(radius=2.0)},
              {"params": list(layers[2].parameters()), "constraint": fgfw.L1Ball.relative_to_init(1.0, scope="row")}]
    opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=5.0))
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert op_calls == [6]
    # each group kept its own balls: the first layer's rows moved, each within radius 1
    assert all(float(row.abs().sum()) <= 1.0 for row in layers[0].weight)
    assert any(not torch.equal(p, q) for p, q in zip(before, model.parameters()))


def test_groups_with_other_schedules_or_a_global_ball_get_calls_of_their_own(op_calls):
    model = _mlp()
    layers = [m for m in model if isinstance(m, nn.Linear)]
    groups = [{"params": list(layers[0].parameters()), "step_size": 0.1},
              {"params": list(layers[1].parameters()), "step_size": 0.2},
              {"params": list(layers[2].parameters()), "constraint": fgfw.L1Ball(radius=9.0, scope="global")}]
    opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=5.0))
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert sorted(op_calls) == [2, 2, 2]


# -- the cached plan: built once, rebuilt when a group changes -------------------------------------------------
def _stepped(opt, model):
    x, y = _batch()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


@pytest.fixture
def plan_builds(monkeypatch):
    """How many times optimizers build a step's plan."""
    builds = []
    original = fgfw.FrankWolfe._build_plan

    def counting(self):
        builds.append(1)
        return original(self)

    monkeypatch.setattr(fgfw.FrankWolfe, "_build_plan", counting)
    return builds


def _is_vertex(p: torch.Tensor, radius: float) -> bool:
    """p = -r sign(d_i) e_i for some i: one nonzero, of magnitude r (what a step with alpha = 1 leaves)."""
    nonzero = p.detach().reshape(-1).nonzero()
    return len(nonzero) == 1 and float(p.detach().abs().sum()) == pytest.approx(radius, rel=1e-6)


def test_the_plan_is_built_once_and_rebuilt_when_a_hyperparameter_changes(plan_builds):
    model = _mlp()
    groups = _groups(model, per_tensor=True)
    opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=5.0), step_size=0.1, momentum=0.5)
    for _ in range(3):
        _stepped(opt, model)
    assert len(plan_builds) == 1
    builds = len(plan_builds)
    # alpha = 1 replaces each tensor by a vertex of its ball: the new step size is used at once
    opt.param_groups[2]["step_size"] = 1.0
    _stepped(opt, model)
    assert len(plan_builds) == builds + 1
    assert _is_vertex(opt.param_groups[2]["params"][0], 5.0)
    assert not _is_vertex(opt.param_groups[0]["params"][0], 5.0)


def test_a_radius_changed_in_place_is_used_at_the_next_step():
    model = _mlp()
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=5.0), step_size=0.01)
    _stepped(opt, model)
    opt.param_groups[0]["step_size"] = 1.0
    opt.param_groups[0]["radii"][2] = 0.25
    _stepped(opt, model)
    params = opt.param_groups[0]["params"]
    assert _is_vertex(params[2], 0.25) and _is_vertex(params[0], 5.0)


def test_an_invalid_radius_set_between_steps_raises_and_changes_nothing():
    model = _mlp()
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=5.0), momentum=0.9)
    _stepped(opt, model)
    before = [p.detach().clone() for p in model.parameters()]
    moms = [opt.state[p]["momentum"].clone() for p in model.parameters()]
    opt.param_groups[0]["radii"][1] = -1.0
    with pytest.raises(ValueError, match="param group 0: radii must be finite numbers > 0, got -1.0"):
        _stepped(opt, model)
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert all(torch.equal(opt.state[p]["momentum"], m) for p, m in zip(model.parameters(), moms))


def test_row_radii_are_tuples_and_a_new_row_list_is_used():
    model = _mlp()
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=2.0, scope="row"), step_size=1.0)
    radii = opt.param_groups[0]["radii"]
    with pytest.raises(TypeError):  # in place, it would go unseen by the cached plan: refused
        radii[0][3] = 0.5
    radii[0] = [0.5] * 16  # a new list of row radii for the first weight
    _stepped(opt, model)
    weight = opt.param_groups[0]["params"][0]
    assert all(_is_vertex(row, 0.5) for row in weight)
    assert all(_is_vertex(row, 2.0) for row in opt.param_groups[0]["params"][2])
