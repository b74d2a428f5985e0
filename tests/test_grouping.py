"""Param groups share fused calls: one call per (device, compute dtype, schedule), whatever the number of
groups, and a model split into one group per tensor steps exactly as the same model in one group."""
import warnings

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
    assert all(float(row.abs().sum()) <= 1.0 for row in layers[0].weight.detach())
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


# -- settings changed between steps: applied in full, as at construction ------------------------------------------
F64 = torch.float64
GRAD = torch.tensor([0.3, -2.0, 0.7, 1.1], dtype=F64)


def _vector_run(constraint, steps=3, step_size=0.5):
    """FrankWolfe on one float64 vector with a fixed gradient: (the parameter, the optimizer)."""
    theta = nn.Parameter(torch.tensor([0.2, 0.1, -0.3, 0.25], dtype=F64))
    opt = fgfw.FrankWolfe([theta], constraint=constraint, step_size=step_size)
    for _ in range(steps):
        theta.grad = GRAD.clone()
        opt.step()
    return theta, opt


def _expected_step(theta_old, radius_old_gauge, radius, vertex, alpha):
    """The step after a change, written out: theta rescaled into the new ball (by r / gauge when outside), then
    theta <- theta + alpha (s - theta) (the L-infinity ball's exact combination, reference.dense_update)."""
    start = theta_old * min(1.0, radius / radius_old_gauge)
    return start + alpha * (vertex - start)


def _step_after(theta, opt):
    before = theta.detach().clone()
    theta.grad = GRAD.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return before, [str(w.message) for w in caught]


@pytest.mark.parametrize("how", ["new object", "radius on the object"])
@pytest.mark.parametrize("direction", ["shrink", "grow"])
def test_a_constraint_changed_between_steps_is_applied_in_full(how, direction):
    """A new constraint object, or a radius set on the live one, is the set of the next step: its vertex has the
    new radius and, when the ball shrank, the parameters are first rescaled into it (with a warning), as at
    construction. Before, the step used the new set with the old cached radius (LInfBall(0.1) stepped to a
    vertex of radius 1, ten times outside it) and a radius set on the object was ignored."""
    big, small = 1.0, 0.1
    r_old, r_new = (big, small) if direction == "shrink" else (small, big)
    theta, opt = _vector_run(fgfw.LInfBall(r_old))
    if how == "new object":
        opt.param_groups[0]["constraint"] = fgfw.LInfBall(r_new)
    else:
        opt.param_groups[0]["constraint"].radius = r_new
    before, warned = _step_after(theta, opt)
    linf = float(before.abs().max())
    expected = _expected_step(before, linf, r_new, -r_new * torch.sign(GRAD), alpha=0.5)
    torch.testing.assert_close(theta.detach(), expected, rtol=1e-15, atol=0)
    assert float(theta.detach().abs().max()) <= r_new
    assert opt.param_groups[0]["radii"] == [r_new]
    if direction == "shrink":
        assert len(warned) == 1 and "param group 0 (its settings changed)" in warned[0], warned
    else:
        assert not warned, warned
    # and it stays: the next steps keep the new ball
    _step_after(theta, opt)
    assert float(theta.detach().abs().max()) <= r_new


def test_another_set_between_steps_gets_its_own_vertex_and_radius():
    """L1Ball(1) replaced by LInfBall(0.1): the L-infinity vertex of radius 0.1, from the start rescaled by
    0.1 / ||theta||_inf; and back to an L1 ball of radius 2: its one-hot vertex -2 sign(d_i) e_i."""
    theta, opt = _vector_run(fgfw.L1Ball(1.0))
    opt.param_groups[0]["constraint"] = fgfw.LInfBall(0.1)
    before, _ = _step_after(theta, opt)
    torch.testing.assert_close(theta.detach(), _expected_step(before, float(before.abs().max()), 0.1,
                                                             -0.1 * torch.sign(GRAD), 0.5), rtol=1e-15, atol=0)
    opt.param_groups[0]["constraint"] = fgfw.L1Ball(2.0)
    before, warned = _step_after(theta, opt)
    vertex = torch.zeros(4, dtype=F64)
    vertex[1] = 2.0  # i* = argmax |d_i| = 1, d_1 < 0
    torch.testing.assert_close(theta.detach(), _expected_step(before, 1.0, 2.0, vertex, 0.5), rtol=1e-15, atol=0)
    assert not warned


def test_a_scope_or_rule_changed_between_steps_makes_the_radii_again():
    """scope "tensor" -> "row" on the live object: one radius per row, each row stepping to its own vertex; a
    relative_to_init constraint given mid-run measures the current parameters (as construction measures the
    initial ones)."""
    model = _mlp()
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=40.0), step_size=0.01)
    _stepped(opt, model)
    opt.param_groups[0]["constraint"].scope = "row"
    opt.param_groups[0]["step_size"] = 1.0
    _stepped(opt, model)
    weight = opt.param_groups[0]["params"][0]
    assert opt.param_groups[0]["radii"][0] == (40.0,) * 16
    assert all(_is_vertex(row, 40.0) for row in weight)
    opt.param_groups[0]["constraint"] = fgfw.L1Ball.relative_to_init(2.0)
    opt.param_groups[0]["step_size"] = 0.01
    norms = [float(p.detach().double().abs().sum()) for p in model.parameters()]
    _stepped(opt, model)
    assert opt.param_groups[0]["radii"] == pytest.approx([2.0 * n for n in norms], rel=1e-15)


def test_a_constraint_shared_by_groups_changes_them_all():
    model = _mlp()
    layers = [m for m in model if isinstance(m, nn.Linear)]
    shared = fgfw.L1Ball(radius=5.0)
    opt = fgfw.FrankWolfe([{"params": list(m.parameters())} for m in layers], constraint=shared, step_size=0.01)
    _stepped(opt, model)
    shared.radius = 0.5
    opt.param_groups[1]["step_size"] = 1.0
    with pytest.warns(UserWarning, match="its settings changed"):
        _stepped(opt, model)
    assert all(group["radii"] == [0.5, 0.5] for group in opt.param_groups)
    assert all(float(p.detach().abs().sum()) <= 0.5 for p in model.parameters())
    assert _is_vertex(layers[1].weight, 0.5)


def test_invalid_settings_between_steps_raise_and_change_nothing():
    """A radius or scope set on the object that its constructor would refuse: ValueError naming the group and
    the setting; parameters, momentum and radii untouched, in every group; set right, the run goes on."""
    model = _mlp()
    layers = [m for m in model if isinstance(m, nn.Linear)]
    opt = fgfw.FrankWolfe([{"params": list(layers[0].parameters()), "constraint": fgfw.L1Ball(radius=1.0)},
                           {"params": list(layers[1].parameters()) + list(layers[2].parameters())}],
                          constraint=fgfw.L1Ball(radius=5.0), momentum=0.9)
    _stepped(opt, model)
    before = [p.detach().clone() for p in model.parameters()]
    moms = [opt.state[p]["momentum"].clone() for p in model.parameters()]
    radii = [list(g["radii"]) for g in opt.param_groups]
    opt.param_groups[0]["constraint"].radius = 0.01  # valid, but group 1's change below is not
    for setting, value, match in [("radius", -2.0, "radius must be a finite number > 0, got -2.0"),
                                  ("scope", "rows", "scope must be one of")]:
        setattr(opt.param_groups[1]["constraint"], setting, value)
        with pytest.raises(ValueError, match=f"param group 1: its constraint was changed to invalid settings: {match}"):
            _stepped(opt, model)
        assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
        assert all(torch.equal(opt.state[p]["momentum"], m) for p, m in zip(model.parameters(), moms))
        assert [list(g["radii"]) for g in opt.param_groups] == radii
        setattr(opt.param_groups[1]["constraint"], setting, {"radius": 5.0, "scope": "tensor"}[setting])
    with pytest.warns(UserWarning, match="param group 0 .its settings changed. have L1 norm"):
        _stepped(opt, model)
    assert opt.param_groups[0]["radii"] == [0.01, 0.01]


def test_a_half_precision_parameter_is_rescaled_through_its_master_copy():
    """bfloat16 steps through a float32 master copy, which the next step writes back: the rescale into a smaller
    ball moves the master (else the step would undo it) and the parameter is its rounding."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4).to(torch.bfloat16)
    opt = fgfw.FrankWolfe(layer.parameters(), constraint=fgfw.L2Ball(radius=3.0), step_size=0.1)
    for _ in range(2):
        layer.weight.grad = torch.ones_like(layer.weight)
        layer.bias.grad = torch.ones_like(layer.bias)
        opt.step()
    opt.param_groups[0]["constraint"].radius = 0.05
    opt.param_groups[0]["step_size"] = 1e-3
    layer.weight.grad = torch.ones_like(layer.weight)
    layer.bias.grad = torch.ones_like(layer.bias)
    with pytest.warns(UserWarning, match="its settings changed"):
        opt.step()
    for p in layer.parameters():
        master = opt.state[p]["master"]
        assert float(master.double().norm()) <= 0.05
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
