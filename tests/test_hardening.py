"""Hardening of the optimizers: checkpoints under torch.load's defaults, resumed in a new process; finite
checks that cannot overflow; frozen parameters; state from another model or optimizer; misuse messages;
param groups, missing and non-contiguous gradients; and the value of the Frank-Wolfe gap."""
import copy
import io
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import _ops, optim, reference

HERE = os.path.dirname(os.path.abspath(__file__))


def mlp(seed=0, dtype=torch.float64, hidden=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 3)).to(dtype)


def batch(seed=1, dtype=torch.float64, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


# -- 1. checkpoints: plain types only, default torch.load, resumed bit-identically in a new process ---------------
def _groups(m, first, second):
    """Two param groups: the first layer under ``first``, the second under ``second`` (dicts of group options)."""
    return [dict(first, params=list(m[0].parameters())), dict(second, params=list(m[2].parameters()))]


RESUME_CASES = {
    "fw_row_momentum": (torch.float32, lambda m: fgfw.FrankWolfe(
        m.parameters(), constraint=fgfw.L1Ball.relative_to_init(2.0, scope="row"), momentum=0.8)),
    "fw_two_groups": (torch.float64, lambda m: fgfw.FrankWolfe(
        _groups(m, {"constraint": fgfw.L1Ball(radius=4.0, scope="global"), "step_size": 0.2},
                {"momentum": 0.5}), constraint=fgfw.L1Ball.relative_to_init(1.5))),
    "fgfw_lean": (torch.float64, lambda m: fgfw.FGFW(
        m, constraint=fgfw.L1Ball.relative_to_init(2.0, scope="global"), seed=3, engine="lean")),
    "fgfw_forward_ad": (torch.float32, lambda m: fgfw.FGFW(
        m, constraint=fgfw.L1Ball(radius=10.0), seed=3, engine="forward_ad", num_tangents=2)),
    "afgfw_lean": (torch.float32, lambda m: fgfw.AFGFW(
        m, constraint=fgfw.L1Ball(radius=10.0), seed=3, num_tangents=2, step_size=0.05, tangent="rademacher")),
    "afgfw_forward_ad_groups": (torch.float64, lambda m: fgfw.AFGFW(
        m, _groups(m, {"constraint": fgfw.L1Ball(radius=10.0, scope="row"), "averaging_weight": 0.3},
                   {"step_size": "2/(k+2)"}), constraint=fgfw.L1Ball(radius=10.0), seed=7, engine="forward_ad")),
    "fgfw_activity": (torch.float64, lambda m: fgfw.FGFW(
        m, constraint=fgfw.L1Ball.relative_to_init(3.0, scope="row"), seed=5, step_size=0.05,
        estimator="activity")),
    "afgfw_activity": (torch.float32, lambda m: fgfw.AFGFW(
        m, constraint=fgfw.L1Ball(radius=10.0), seed=5, step_size=0.05, averaging_weight=0.2, num_tangents=2,
        estimator="activity")),
    # sets whose steps carry the norm feedback's state (norm_scale): per row, and the global ball's in one tensor
    "fw_l2_row": (torch.float32, lambda m: fgfw.FrankWolfe(
        m.parameters(), constraint=fgfw.L2Ball.relative_to_init(1.0, scope="row"), momentum=0.5)),
    "afgfw_ksparse_global": (torch.float64, lambda m: fgfw.AFGFW(
        m, constraint=fgfw.KSparsePolytope.relative_to_init(1.0, k=5, scope="global"), seed=3, step_size=0.1)),
}
RESUME_STEPS, RESUME_AT = 6, 3


def _train_step(opt, model, i, dtype):
    x, y = batch(seed=100 + i, dtype=dtype)
    if isinstance(opt, fgfw.FrankWolfe):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    elif opt.estimator == "activity":
        opt.step(lambda: F.cross_entropy(model(x), y, reduction="none"))
    else:
        opt.step(lambda: F.cross_entropy(model(x), y))


def _run(name, model, opt, steps):
    dtype, _ = RESUME_CASES[name]
    for i in steps:
        _train_step(opt, model, i, dtype)


def _resume_child(directory: str, threads: int) -> None:
    """Runs in a fresh interpreter: loads every checkpoint with torch.load's defaults and finishes the run."""
    torch.set_num_threads(threads)
    for name, (dtype, make) in RESUME_CASES.items():
        saved = torch.load(os.path.join(directory, f"{name}.pt"))  # the default: weights_only=True
        model = mlp(seed=99, dtype=dtype)  # another init: everything must come from the checkpoint
        model.load_state_dict(saved["model"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = make(model)
        opt.load_state_dict(saved["opt"])
        _run(name, model, opt, range(RESUME_AT, RESUME_STEPS))
        torch.save({"params": [p.detach() for p in model.parameters()], "gap": opt.last_gap,
                    "extra": opt.state_dict()["fgfw"]}, os.path.join(directory, f"{name}.out.pt"))


@pytest.fixture(scope="module")
def resumed_in_a_new_process(tmp_path_factory):
    """{case: (uninterrupted optimizer and params, what the new process resumed to)}."""
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    straight = {}
    for name, (dtype, make) in RESUME_CASES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, first = mlp(dtype=dtype), mlp(dtype=dtype)
            opt, opt_first = make(model), make(first)
        _run(name, model, opt, range(RESUME_STEPS))
        straight[name] = (opt, [p.detach().clone() for p in model.parameters()])
        _run(name, first, opt_first, range(RESUME_AT))
        torch.save({"model": first.state_dict(), "opt": opt_first.state_dict()}, os.path.join(directory, f"{name}.pt"))
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",
                                                            "TORCH_FORCE_WEIGHTS_ONLY_LOAD")}
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import test_hardening; "
            f"test_hardening._resume_child({directory!r}, {torch.get_num_threads()})")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the resuming process failed:\n{done.stderr[-4000:]}"
    return {name: (straight[name], torch.load(os.path.join(directory, f"{name}.out.pt"))) for name in RESUME_CASES}


@pytest.mark.parametrize("name", sorted(RESUME_CASES))
def test_checkpoint_loads_with_default_torch_load_and_resumes_bit_identically_in_a_new_process(
        name, resumed_in_a_new_process):
    (opt, params), resumed = resumed_in_a_new_process[name]
    assert len(params) == len(resumed["params"])
    for p, q in zip(params, resumed["params"]):
        assert torch.equal(p, q)
    assert torch.equal(opt.last_gap, resumed["gap"])
    assert resumed["extra"] == opt.state_dict()["fgfw"]


def test_state_dict_holds_plain_types_only():
    model = mlp()
    opt = fgfw.AFGFW(model, _groups(model, {"constraint": fgfw.L1Ball(radius=3.0, scope="row")}, {}),
                     constraint=fgfw.L1Ball.relative_to_init(2.0, scope="global"), seed=1)
    opt.step(lambda: F.cross_entropy(model(batch()[0]), batch()[1]))
    state = opt.state_dict()
    plain = (int, float, str, bool, type(None), torch.Tensor)

    def check(value, where):
        if isinstance(value, dict):
            for k, v in value.items():
                check(k, where)
                check(v, f"{where}[{k!r}]")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check(v, f"{where}[{i}]")
        else:
            assert isinstance(value, plain), f"state_dict{where} is a {type(value).__name__}"

    check(state, "")
    assert state["param_groups"][0]["constraint"] == {"kind": "l1_ball", "radius": 3.0, "scope": "row",
                                                      "relative_scale": None}
    assert state["param_groups"][1]["constraint"] == {"kind": "l1_ball", "radius": None, "scope": "global",
                                                      "relative_scale": 2.0}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    model2 = copy.deepcopy(model)
    opt2 = fgfw.AFGFW(model2, constraint=fgfw.L1Ball(radius=20.0), seed=0)
    with pytest.raises(ValueError, match="param groups"):  # one group here, two in the checkpoint
        opt2.load_state_dict(loaded)
    opt2 = fgfw.AFGFW(model2, _groups(model2, {}, {}), constraint=fgfw.L1Ball(radius=20.0), seed=0)
    with pytest.warns(UserWarning, match="replaces this optimizer's"):  # built with other sets than the saved ones
        opt2.load_state_dict(loaded)
    for g, g2 in zip(opt.param_groups, opt2.param_groups):
        assert isinstance(g2["constraint"], fgfw.L1Ball)
        assert g2["constraint"].to_dict() == g["constraint"].to_dict() and g2["radii"] == g["radii"]


def test_callable_schedule_is_not_saved_and_the_rebuilt_optimizer_supplies_it():
    theta = nn.Parameter(torch.ones(4, dtype=torch.float64))
    schedule = lambda k: 0.5 / k  # noqa: E731
    opt = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=8.0), step_size=schedule)
    theta.grad = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert saved["param_groups"][0]["step_size"]["kind"] == "callable"
    named = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=8.0), step_size="1/k")
    with pytest.raises(ValueError, match=r"step_size.*callable.*cannot save"):
        named.load_state_dict(saved)
    assert named.param_groups[0]["step_size"] == "1/k"
    again = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=8.0), step_size=schedule)
    again.load_state_dict(saved)
    assert again.param_groups[0]["step_size"] is schedule and int(again._step_count_k) == 1


# -- 2. the finite check cannot overflow ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,value", [(torch.float16, 60000.0), (torch.bfloat16, 3e38), (torch.float32, 3e38)])
def test_finite_check_does_not_overflow(dtype, value):
    theta = nn.Parameter(torch.zeros(100, dtype=dtype))
    opt = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=1.0), step_size=0.5)
    grad = torch.full((100,), value / 2, dtype=dtype)
    grad[7] = -value  # finite entries whose L2 norm overflows the dtype (the largest |d| at 7)
    assert torch.isinf(torch._foreach_norm([grad])[0])  # what the check used to compute
    theta.grad = grad
    opt.step()
    assert float(theta.detach()[7]) == pytest.approx(0.5, rel=1e-6) and int(theta.detach().count_nonzero()) == 1
    theta.grad = grad.clone()
    theta.grad[3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        opt.step()
    # the kernel where there is one, the multi-tensor ops (the GPU's), and the spec
    for all_finite in (_ops.all_finite, _ops.all_finite_multi_tensor, reference.all_finite):
        assert all_finite([torch.ones(3), torch.full((4,), value, dtype=dtype)])
        assert not all_finite([torch.ones(3), torch.tensor([1.0, float("inf")], dtype=dtype)])
        assert all_finite([torch.empty(0, dtype=dtype)])


# -- 3. frozen parameters ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", ["afgfw_list", "afgfw_groups", "fgfw_activity", "fw_parameters"])
def test_frozen_parameters_are_left_out_and_never_touched(make):
    model, (x, y) = mlp(), batch()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    ball = fgfw.L1Ball(radius=0.5)  # below the initial norms: a kept parameter is rescaled at construction
    with pytest.warns(UserWarning) as record:
        if make == "afgfw_list":
            opt = fgfw.AFGFW(model, params=list(model.parameters()), constraint=ball, seed=0)
        elif make == "afgfw_groups":
            opt = fgfw.AFGFW(model, [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}],
                             constraint=ball, seed=0)
        elif make == "fgfw_activity":
            opt = fgfw.FGFW(model, params=model.parameters(), constraint=ball, seed=0, estimator="activity")
        else:
            opt = fgfw.FrankWolfe(model.parameters(), constraint=ball)
    messages = [str(w.message) for w in record]
    assert any("requires_grad=False" in m and "left out" in m for m in messages), messages
    if make != "fw_parameters":  # the forward-gradient optimizers know the parameters' names
        assert any("'0.weight'" in m for m in messages), messages
    assert all(p is not model[0].weight for g in opt.param_groups for p in g["params"])
    assert torch.equal(model[0].weight, frozen)
    for _ in range(3):
        if make == "fw_parameters":
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        elif make == "fgfw_activity":
            opt.step(lambda: F.cross_entropy(model(x), y, reduction="none"))
        else:
            opt.step(lambda: F.cross_entropy(model(x), y))
    assert torch.equal(model[0].weight, frozen)
    assert model[0].weight not in opt.state
    assert float(model[0].bias.detach().abs().sum()) <= 0.5 * (1 + 1e-9)


def test_a_parameter_frozen_after_construction_is_skipped_or_refused():
    model, (x, y) = mlp(), batch()
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=0, step_size=0.1)
    opt.step(lambda: F.cross_entropy(model(x), y))
    model[2].weight.requires_grad_(False)
    frozen, momentum = model[2].weight.detach().clone(), opt.state[model[2].weight]["momentum"].clone()
    others = [p.detach().clone() for p in model.parameters()]
    opt.step(lambda: F.cross_entropy(model(x), y))
    assert torch.equal(model[2].weight, frozen) and torch.equal(opt.state[model[2].weight]["momentum"], momentum)
    assert not torch.equal(model[0].weight, others[0])

    model = mlp()
    glob = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=100.0, scope="global"))
    F.cross_entropy(model(x), y).backward()
    model[2].weight.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"requires_grad=False.*global"):
        glob.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_only_frozen_parameters_is_an_error():
    model = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=10.0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("make", ["fw_groups", "afgfw_module", "add_param_group"])
def test_a_non_finite_start_is_refused_naming_the_parameter(bad, make):
    """A start holding NaN or inf raises ValueError naming the parameter, with nothing changed: not even a group
    before it that its ball would rescale. Before, rescaling it into the ball made a NaN start all-NaN and an
    inf start [nan, 0, 0], with only a "rescaled into the ball" warning."""
    model = mlp()
    model[2].bias.data[1] = bad
    before = [p.detach().clone() for p in model.parameters()]
    ball = fgfw.L1Ball(radius=0.1)  # below every initial norm: a group built before the error would be rescaled
    if make == "fw_groups":
        match = r"parameter 1 \(shape \(3,\), dtype torch.float64, device cpu\) of param group 1 holds 1 non-finite"
        with pytest.raises(ValueError, match=match):
            fgfw.FrankWolfe([{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}],
                            constraint=ball)
    elif make == "afgfw_module":
        with pytest.raises(ValueError, match=r"parameter '2.bias' \(shape \(3,\)\) of param group 0 holds 1"):
            fgfw.AFGFW(model, constraint=ball, seed=0)
    else:
        first = [p.detach().clone() for p in model[0].parameters()]
        with pytest.warns(UserWarning, match="rescaled"):
            opt = fgfw.FrankWolfe(model[0].parameters(), constraint=ball)
        before[:2] = [p.detach().clone() for p in model[0].parameters()]
        assert not all(torch.equal(p, q) for p, q in zip(first, before[:2]))
        with pytest.raises(ValueError, match="param group 1 holds 1 non-finite value"):
            opt.add_param_group({"params": list(model[2].parameters())})
        assert len(opt.param_groups) == 1
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q) or (torch.isnan(p).any() and torch.equal(p.isnan(), q.isnan()))


def test_loading_a_state_saved_with_another_constraint_warns_naming_both():
    """The saved set and radii replace the ones the optimizer was built with (they are the run's), with a warning
    that names both; the same constraint loads silently."""
    source_model, model = mlp(), mlp()
    source = fgfw.FrankWolfe(source_model.parameters(), constraint=fgfw.L1Ball(radius=3.0, scope="row"))
    _train_step(source, source_model, 0, torch.float64)
    saved = source.state_dict()
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.LInfBall(radius=0.5))
    with pytest.warns(UserWarning, match=r"param group 0: the state_dict's constraint L1Ball\(radius=3.0, "
                                         r"scope='row'\) replaces this optimizer's LInfBall\(radius=0.5, "
                                         r"scope='tensor'\)"):
        opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert isinstance(group["constraint"], fgfw.L1Ball) and group["constraint"].scope == "row"
    assert group["radii"] == source.param_groups[0]["radii"]
    model.load_state_dict(source_model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no rescale either: the loaded parameters lie in the saved balls
        _train_step(opt, model, 1, torch.float64)
        same = fgfw.FrankWolfe(mlp().parameters(), constraint=fgfw.L1Ball(radius=3.0, scope="row"))
        same.load_state_dict(saved)


# -- 4. state from another model or optimizer ------------------------------------------------------------------------
def _snapshot(opt, model):
    return copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]


def _assert_unchanged(opt, model, snapshot):
    state, params = snapshot
    now = opt.state_dict()
    assert now["fgfw"] == state["fgfw"]
    assert now["param_groups"] == state["param_groups"]
    assert now["state"].keys() == state["state"].keys()
    for i, s in state["state"].items():
        assert s.keys() == now["state"][i].keys()
        for key in s:
            assert torch.equal(s[key], now["state"][i][key])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def _afgfw_after_a_step(model, **kw):
    x, y = batch()
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=0, **kw)
    opt.step(lambda: F.cross_entropy(model(x), y))
    return opt


def test_state_of_another_model_is_refused_before_anything_changes():
    source = _afgfw_after_a_step(mlp(hidden=4))  # the same number of tensors, other shapes
    model = mlp()
    opt = _afgfw_after_a_step(model)
    snapshot = _snapshot(opt, model)
    with pytest.raises(ValueError, match=r"momentum.*shape \(4, 6\).*\(5, 6\)"):
        opt.load_state_dict(source.state_dict())
    _assert_unchanged(opt, model, snapshot)
    opt.step(lambda: F.cross_entropy(model(batch()[0]), batch()[1]))  # still usable

    rows = fgfw.FrankWolfe(mlp(hidden=4).parameters(), constraint=fgfw.L1Ball(radius=10.0, scope="row"))
    target_model = mlp()
    target = fgfw.FrankWolfe(target_model.parameters(), constraint=fgfw.L1Ball(radius=10.0, scope="row"))
    snapshot = _snapshot(target, target_model)
    with pytest.raises(ValueError, match="radii"):  # no momentum, but one radius per row
        target.load_state_dict(rows.state_dict())
    _assert_unchanged(target, target_model, snapshot)


@pytest.mark.parametrize("source, target", [(s, t) for s in ("FrankWolfe", "FGFW", "AFGFW")
                                             for t in ("FrankWolfe", "FGFW", "AFGFW") if s != t])
def test_state_of_another_optimizer_kind_is_refused(source, target):
    model, (x, y) = mlp(), batch()

    def make(kind, m):
        if kind == "FrankWolfe":
            return fgfw.FrankWolfe(m.parameters(), constraint=fgfw.L1Ball(radius=10.0), momentum=0.5)
        return getattr(fgfw, kind)(m, constraint=fgfw.L1Ball(radius=10.0), seed=0)

    src_model = mlp()
    src = make(source, src_model)
    _train_step(src, src_model, 0, torch.float64)
    opt = make(target, model)
    _train_step(opt, model, 1, torch.float64)
    snapshot = _snapshot(opt, model)
    with pytest.raises(ValueError, match=f"saved by {source}.*{target}"):
        opt.load_state_dict(src.state_dict())
    _assert_unchanged(opt, model, snapshot)


@pytest.mark.parametrize("corrupt,match", [
    (lambda s: s["fgfw"].update(tangent_stream_version=0), "tangent stream version"),
    (lambda s: s["fgfw"].update(tangent="uniform"), "tangent"),
    (lambda s: s["fgfw"].update(estimator="activations"), "estimator"),
    (lambda s: s["fgfw"].update(guided="yes"), "guided must be True or False"),
    (lambda s: s["fgfw"].update(guided=True), "guided=True needs num_tangents >= 2"),
    (lambda s: s["fgfw"].update(step=-1), "step"),
    (lambda s: s["param_groups"][0].update(constraint={"kind": "hexagon", "radius": 1.0}), "constraint"),
    (lambda s: s["param_groups"][0].update(step_size="1/k^2"), "step_size"),
    (lambda s: s["param_groups"][0].pop("averaging_weight"), "averaging_weight"),
    (lambda s: s["param_groups"][0]["radii"].pop(), "radii"),
    (lambda s: s["state"][0].update(momentum=torch.zeros(3)), "momentum"),
    (lambda s: s["state"][0].update(norm_scale=torch.ones(2, 2)), "norm_scale"),
    (lambda s: s["param_groups"][0]["params"].pop(), "parameters"),
])
def test_corrupt_state_is_refused_before_anything_changes(corrupt, match):
    model = mlp()
    opt = _afgfw_after_a_step(model)
    state = copy.deepcopy(opt.state_dict())
    corrupt(state)
    snapshot = _snapshot(opt, model)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state)
    _assert_unchanged(opt, model, snapshot)


def test_activity_state_loads_into_a_convolution():
    # the activity estimator perturbs any layer that holds a parameter (a convolution too): its state loads
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2)).double()
    source = fgfw.AFGFW(conv, params=conv[2].parameters(), constraint=fgfw.L1Ball(radius=10.0), seed=0,
                        estimator="activity")
    opt = fgfw.AFGFW(conv, params=[{"params": list(conv[0].parameters())[:1]}], constraint=fgfw.L1Ball(radius=10.0),
                     seed=0)
    state = source.state_dict()
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:1]
    state["param_groups"][0]["radii"] = state["param_groups"][0]["radii"][:1]
    opt.load_state_dict(state)
    assert opt.estimator == "activity"


# -- 5. misuse --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [fgfw.FGFW, fgfw.AFGFW])
def test_step_without_a_closure_says_how_to_call_it(cls):
    opt = cls(mlp(), constraint=fgfw.L1Ball(radius=10.0), seed=0)
    with pytest.raises(TypeError, match=rf"{cls.__name__}\.step needs a closure") as info:
        opt.step()
    assert "_ForwardGradientFrankWolfe" not in str(info.value)
    assert "opt.step(lambda:" in str(info.value)
    with pytest.raises(TypeError, match="got a Tensor"):
        opt.step(torch.zeros(()))


@pytest.mark.parametrize("kw", [dict(engine="lean"), dict(engine="forward_ad"),
                                dict(num_tangents=2, tangents_in_one_pass=True), dict(estimator="activity"),
                                dict(estimator="activity", num_tangents=2, tangents_in_one_pass=True)])
def test_closure_that_calls_backward_gets_a_message_that_says_what_to_do(kw):
    model, (x, y) = mlp(), batch()
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=0, **kw)
    before = [p.detach().clone() for p in model.parameters()]
    reduction = "none" if kw.get("estimator") == "activity" else "mean"

    def closure():
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        loss.sum().backward()
        return loss

    with pytest.raises(RuntimeError, match=r"closure passed to AFGFW\.step called backward\(\).*return the loss"):
        opt.step(closure)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and not opt.state

    def closure_grad():
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        torch.autograd.grad(loss.sum(), list(model.parameters()))
        return loss

    with pytest.raises(RuntimeError, match=r"closure passed to AFGFW\.step called backward\(\)"):
        opt.step(closure_grad)


def test_other_closure_errors_pass_through_unchanged():
    model, (x, y) = mlp(), batch()
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=0)

    def closure():
        raise RuntimeError("my own error")

    with pytest.raises(RuntimeError, match="^my own error$"):
        opt.step(closure)


# -- 6. param groups, missing and non-contiguous gradients ----------------------------------------------------------
def dense_vertices(params, directions, constraint, radii):
    """The dense LMO vertex s of every ball (reference.l1_lmo), per tensor, from the directions."""
    if constraint.scope == "global":
        flat = torch.cat([d.reshape(-1) for d in directions])
        s = reference.l1_lmo(flat, radii[0])
        return list(torch.split(s, [p.numel() for p in params]))
    out = []
    for p, d, r in zip(params, directions, radii):
        if constraint.scope == "row" and p.dim() >= 2:
            rows = d.reshape(p.shape[0], -1)
            out.append(torch.stack([reference.l1_lmo(row, ri) for row, ri in zip(rows, r)]).reshape(-1))
        else:
            out.append(reference.l1_lmo(d.reshape(-1), r[0] if constraint.scope == "row" else r).reshape(-1))
    return out


def named(spec, k):
    if isinstance(spec, str):
        return {"2/(k+2)": 2 / (k + 2), "1/k": 1 / k, "1/sqrt(k)": 1 / math.sqrt(k)}[spec]
    return spec(k) if callable(spec) else spec


@pytest.mark.parametrize("cls", [fgfw.FGFW, fgfw.AFGFW])
@pytest.mark.parametrize("engine", ["lean", "forward_ad"])
def test_forward_gradient_param_groups_follow_their_own_constraint_and_schedules(cls, engine):
    model, (x, y) = mlp(), batch()
    expected = copy.deepcopy(model)
    first = {"constraint": fgfw.L1Ball(radius=4.0, scope="row"), "step_size": 0.1}
    second = {"constraint": fgfw.L1Ball(radius=3.0, scope="global"), "step_size": lambda k: 0.3 / k}
    if cls is fgfw.AFGFW:
        first["averaging_weight"] = "1/sqrt(k)"
        second["averaging_weight"] = 0.4
    groups = [dict(first, params=[model[0].weight, model[2].bias]),
              dict(second, params=[model[2].weight, model[0].bias])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the global ball rescales its start
        opt = cls(model, groups, constraint=fgfw.L1Ball(radius=10.0), seed=9, num_tangents=2, engine=engine)
    exp = dict(expected.named_parameters())
    order = [[exp["0.weight"], exp["2.bias"]], [exp["2.weight"], exp["0.bias"]]]
    with torch.no_grad():  # the same start (the global group was rescaled)
        for group, ps in zip(opt.param_groups, order):
            for p, q in zip(group["params"], ps):
                q.copy_(p)
    flat = [p for ps in order for p in ps]
    offsets = [0]
    for p in flat[:-1]:
        offsets.append(offsets[-1] + -(-p.numel() // 4) * 4)
    v = [torch.zeros_like(p) for p in flat]
    for k in range(1, 5):
        opt.step(lambda: F.cross_entropy(model(x), y))
        expected.zero_grad()
        F.cross_entropy(expected(x), y).backward()
        us = [[reference.tangent(p.numel(), 9, k, t, o, 0).double().view(p.shape) for p, o in zip(flat, offsets)]
              for t in range(2)]
        cs = [sum(float((p.grad * u).sum()) for p, u in zip(flat, ut)) for ut in us]
        gap = 0.0
        with torch.no_grad():
            j = 0
            for spec, group, ps in zip((first, second), opt.param_groups, order):
                alpha = named(spec["step_size"], k)
                ds = []
                for p in ps:
                    g_hat = sum(c * ut[j] for c, ut in zip(cs, us)) / 2
                    if cls is fgfw.AFGFW:
                        gamma = named(spec["averaging_weight"], k)
                        v[j] = (1 - gamma) * v[j] + gamma * g_hat
                        ds.append(v[j])
                    else:
                        ds.append(g_hat)
                    j += 1
                ss = dense_vertices(ps, ds, spec["constraint"], group["radii"])
                for p, d, s in zip(ps, ds, ss):
                    gap += float((d.reshape(-1) * (p.reshape(-1) - s)).sum())
                    p.copy_(((1 - alpha) * p.reshape(-1) + alpha * s).view(p.shape))
        # the kernels' Gaussian tangents agree with the reference's to float32 rounding, and c with them
        assert float(opt.last_gap) == pytest.approx(gap, rel=1e-6)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scope", ["tensor", "row", "global"])
@pytest.mark.parametrize("momentum", [None, 0.5])
def test_frank_wolfe_parameters_without_gradient(scope, momentum):
    """Per-tensor and row balls: a parameter whose grad is None is skipped (no state, no move). A global
    ball: it takes a zero gradient (the update scales every parameter of the ball)."""
    model, (x, y) = mlp(), batch()
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=20.0, scope=scope), step_size=0.25,
                          momentum=momentum)
    radii = opt.param_groups[0]["radii"]
    params = list(model.parameters())
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    params[1].grad = None  # the first bias
    before = [p.detach().clone() for p in params]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    opt.step()
    directions = [(1 - momentum) * g if momentum else g for g in grads]
    if scope == "global":
        ss = dense_vertices(before, directions, opt.param_groups[0]["constraint"], radii)
        expected = [0.75 * b.reshape(-1) + 0.25 * s for b, s in zip(before, ss)]
    else:
        keep = [0, 2, 3]
        ss = dense_vertices([before[i] for i in keep], [directions[i] for i in keep],
                            opt.param_groups[0]["constraint"], [radii[i] for i in keep])
        expected = [b.reshape(-1) for b in before]
        for i, s in zip(keep, ss):
            expected[i] = 0.75 * before[i].reshape(-1) + 0.25 * s
        assert params[1] not in opt.state
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().reshape(-1), e, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("momentum", [None, 0.5])
def test_non_contiguous_gradient_gives_the_contiguous_result(backend, momentum):
    runs = []
    for contiguous in (True, False):
        theta = nn.Parameter(torch.linspace(-1, 1, 12, dtype=torch.float64).view(3, 4))
        opt = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=5.0, scope="row"), momentum=momentum,
                              backend=backend)
        for k in range(3):
            g = torch.randn(4, 3, generator=torch.Generator().manual_seed(k), dtype=torch.float64).t()
            theta.grad = g.contiguous() if contiguous else g
            assert theta.grad.is_contiguous() == contiguous
            opt.step()
        runs.append((theta.detach().clone(), opt.last_gap.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


# -- 7. the Frank-Wolfe gap -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["tensor", "global", "row"])
@pytest.mark.parametrize("momentum", [None, 0.7])
def test_last_gap_is_the_frank_wolfe_gap_at_the_pre_step_iterate(scope, momentum):
    """Two param groups (the first under ``scope``, the second per-tensor with another radius and step size):
    last_gap = sum over balls <d, theta_old - s>, d the step's direction, s the dense vertex of l1_lmo."""
    model = mlp()
    groups = [{"params": list(model[0].parameters()), "constraint": fgfw.L1Ball(radius=3.0, scope=scope)},
              {"params": list(model[2].parameters()), "constraint": fgfw.L1Ball(radius=2.0), "step_size": 0.3}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=1.0), momentum=momentum)
    v = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(2):
        x, y = batch(seed=10 + step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        old = [p.detach().clone() for p in model.parameters()]
        gap, j = 0.0, 0
        for group in opt.param_groups:
            ds = []
            for p in group["params"]:
                v[j] = momentum * v[j] + (1 - momentum) * p.grad if momentum else p.grad.clone()
                ds.append(v[j])
                j += 1
            olds = old[j - len(ds):j]
            ss = dense_vertices(olds, ds, group["constraint"], group["radii"])
            gap += sum(float((d.reshape(-1) * (o.reshape(-1) - s)).sum()) for d, o, s in zip(ds, olds, ss))
        opt.step()
        assert opt.last_gap.dtype == torch.float64
        assert float(opt.last_gap) == pytest.approx(gap, rel=1e-12, abs=1e-14)
