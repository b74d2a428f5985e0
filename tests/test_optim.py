"""The optimizers against independent references: closed-form optima, hand-written algorithm steps, resume."""
import copy
import decimal
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import reference


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(dtype)


def batch(seed=1, dtype=torch.float64, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def l1_projection(b: torch.Tensor, r: float) -> torch.Tensor:
    """Euclidean projection onto the L1 ball (Duchi et al. 2008): the closed-form reference optimum."""
    if b.abs().sum() <= r:
        return b.clone()
    mu = torch.sort(b.abs(), descending=True).values
    cssv = torch.cumsum(mu, 0) - r
    ind = torch.arange(1, b.numel() + 1, dtype=b.dtype)
    rho = int(torch.nonzero(mu - cssv / ind > 0).max())
    tau = cssv[rho] / (rho + 1)
    return torch.sign(b) * torch.clamp(b.abs() - tau, min=0)


def least_squares_problem(d=12, n=30, r=1.0):
    """f(theta) = 0.5 ||Q theta - y||^2 with orthonormal Q: theta* = proj_L1(Q^T y) exactly."""
    g = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    y = torch.randn(n, generator=g, dtype=torch.float64) * 3
    theta_star = l1_projection(q.T @ y, r)
    assert theta_star.abs().sum() == pytest.approx(r)  # the constraint is active
    f = lambda th: 0.5 * ((q @ th - y) ** 2).sum()
    return f, theta_star, float(f(theta_star))


def test_frank_wolfe_reaches_certified_optimum_and_gap_bounds_suboptimality():
    f, _, f_star = least_squares_problem()
    theta = nn.Parameter(torch.zeros(12, dtype=torch.float64))
    opt = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=1.0))
    for _ in range(3000):
        opt.zero_grad()
        loss = f(theta)
        loss.backward()
        opt.step()
        # convexity: the FW gap at the pre-step point bounds its suboptimality
        assert float(opt.last_gap) >= loss.item() - f_star - 1e-12
        assert float(theta.detach().abs().sum()) <= 1.0 * (1 + 1e-6)
    assert float(f(theta.detach())) - f_star < 1e-3


def manual_afgfw(model, x, y, steps, seed, radius, num_tangents=1, momentum=True, distribution=0):
    """AFGFW / FGFW written out from the paper with backprop directional derivatives and dense LMOs."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + -(-p.numel() // 4) * 4)  # each tensor starts at a Philox call
    v = [torch.zeros_like(p) for p in params]
    for k in range(1, steps + 1):
        alpha, gamma = (1.0 / k, 1.0 / math.sqrt(k)) if momentum else (2.0 / (k + 2), 1.0)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        tangents = [[reference.tangent(p.numel(), seed, k, t, o, distribution).double().view(p.shape)
                     for p, o in zip(params, offsets)] for t in range(num_tangents)]
        cs = [sum(float((p.grad * u).sum()) for p, u in zip(params, us)) for us in tangents]
        with torch.no_grad():
            for j, p in enumerate(params):
                g_hat = sum(c * us[j] for c, us in zip(cs, tangents)) / num_tangents
                v[j] = (1 - gamma) * v[j] + gamma * g_hat if momentum else g_hat
                p.copy_((1 - alpha) * p + alpha * reference.l1_lmo(v[j], radius))
    return model


@pytest.mark.parametrize("cls,momentum", [(fgfw.AFGFW, True), (fgfw.FGFW, False)])
@pytest.mark.parametrize("num_tangents,distribution", [(1, "gaussian"), (3, "rademacher")])
def test_forward_gradient_optimizers_follow_the_paper(cls, momentum, num_tangents, distribution):
    model, (x, y) = mlp(), batch()
    radius = 10.0  # above every tensor's initial L1 norm: the start is feasible as it is
    expected = manual_afgfw(model, x, y, steps=4, seed=11, radius=radius, num_tangents=num_tangents,
                            momentum=momentum, distribution=reference.DISTRIBUTIONS[distribution])
    opt = cls(model, constraint=fgfw.L1Ball(radius=radius), seed=11, num_tangents=num_tangents,
              tangent=distribution)
    for _ in range(4):
        opt.step(lambda: F.cross_entropy(model(x), y))
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scope", ["tensor", "global"])
@pytest.mark.parametrize("make", ["fw", "fw_momentum", "fgfw", "afgfw"])
def test_every_iterate_is_feasible(scope, make):
    model, (x, y) = mlp(dtype=torch.float32), batch(dtype=torch.float32)
    radius = 2.0
    constraint = fgfw.L1Ball(radius=radius, scope=scope)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default init is rescaled into the small ball
        if make.startswith("fw"):
            opt = fgfw.FrankWolfe(model.parameters(), constraint=constraint,
                                  momentum=0.9 if make == "fw_momentum" else None)
        else:
            cls = fgfw.AFGFW if make == "afgfw" else fgfw.FGFW
            opt = cls(model, constraint=constraint, seed=0, step_size=0.3)
    for _ in range(25):
        if make.startswith("fw"):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        else:
            opt.step(lambda: F.cross_entropy(model(x), y))
        norms = [float(p.detach().abs().sum()) for p in model.parameters()]
        if scope == "global":
            assert sum(norms) <= radius * (1 + 1e-6)
        else:
            assert max(norms) <= radius * (1 + 1e-6)


def test_first_paper_step_is_a_vertex_per_tensor():
    model, (x, y) = mlp(), batch()
    with pytest.warns(UserWarning, match="rescaled"):  # the default init is outside this small ball
        opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=3.0), seed=5)  # alpha_1 = 1/1
    opt.step(lambda: F.cross_entropy(model(x), y))
    for p in model.parameters():
        nonzero = p.detach().reshape(-1).nonzero()
        assert nonzero.numel() == 1
        assert float(p.detach().abs().sum()) == pytest.approx(3.0)


def train_step(opt, model, x, y):
    """One step the way each optimizer is used: backward + step, or a forward-gradient closure."""
    if isinstance(opt, fgfw.FrankWolfe):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    else:
        opt.step(lambda: F.cross_entropy(model(x), y))


def run_steps(make_opt, model, steps):
    opt = make_opt(model)
    dtype = next(model.parameters()).dtype
    for i in range(steps):
        train_step(opt, model, *batch(seed=100 + i, dtype=dtype))
    return opt


OPTIMIZERS = {
    "fw_momentum": lambda m: fgfw.FrankWolfe(m.parameters(), constraint=fgfw.L1Ball.relative_to_init(2.0),
                                             momentum=0.8),
    "fgfw": lambda m: fgfw.FGFW(m, constraint=fgfw.L1Ball.relative_to_init(2.0, scope="global"), seed=3),
    "afgfw": lambda m: fgfw.AFGFW(m, constraint=fgfw.L1Ball(radius=10.0), seed=3, num_tangents=2,
                                  step_size=0.05, tangent="rademacher"),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_resume_is_bit_identical(name, dtype):
    make = OPTIMIZERS[name]
    straight = mlp(dtype=dtype)
    run_steps(make, straight, 6)

    first = mlp(dtype=dtype)
    opt = run_steps(make, first, 3)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    resumed = mlp(seed=99, dtype=dtype)  # a different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = make(resumed)
    opt2.load_state_dict(saved["opt"])
    opt2_state = opt2.state_dict()
    assert opt2_state["fgfw"] == opt.state_dict()["fgfw"]
    for i in range(3, 6):
        train_step(opt2, resumed, *batch(seed=100 + i, dtype=dtype))
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_momentum_state_keeps_float32_for_bfloat16_params_on_load():
    model = mlp().to(torch.bfloat16)
    x, y = batch(dtype=torch.bfloat16)
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=1, step_size=0.1)
    opt.step(lambda: F.cross_entropy(model(x).float(), y))
    opt2 = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=1)
    opt2.load_state_dict(opt.state_dict())
    for p in model.parameters():
        assert opt2.state[p]["momentum"].dtype == torch.float32
        assert torch.equal(opt2.state[p]["momentum"], opt.state[p]["momentum"])


def test_relative_radius_and_infeasible_start():
    model = mlp()
    norms = [float(p.detach().abs().sum()) for p in model.parameters()]
    opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball.relative_to_init(1.5))
    assert opt.param_groups[0]["radii"] == pytest.approx([1.5 * n for n in norms])

    small = mlp()
    with pytest.warns(UserWarning, match="rescaled"):
        fgfw.FrankWolfe(small.parameters(), constraint=fgfw.L1Ball(radius=0.5, scope="global"))
    assert sum(float(p.detach().abs().sum()) for p in small.parameters()) == pytest.approx(0.5)


# -- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("radius", [0.0, -1.0, float("nan"), float("inf")])
def test_radius_must_be_positive_and_finite(radius):
    with pytest.raises(ValueError, match="radius"):
        fgfw.L1Ball(radius=radius)


def test_radius_type_and_missing_radius():
    with pytest.raises(TypeError, match="radius"):
        fgfw.L1Ball(radius="1")
    with pytest.raises(ValueError, match="radius is required"):
        fgfw.L1Ball()
    with pytest.raises(ValueError, match="scope"):
        fgfw.L1Ball(radius=1.0, scope="layer")


@pytest.mark.parametrize("kwargs,match", [
    (dict(step_size="1/k^2"), "step_size"),
    (dict(step_size=1.5), "step_size"),
    (dict(averaging_weight="cosine"), "averaging_weight"),
    (dict(tangent="uniform"), "tangent"),
    (dict(num_tangents=0), "num_tangents"),
    (dict(engine="magic"), "engine"),
    (dict(backend="opencl"), "backend"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_hyperparameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fgfw.AFGFW(mlp(), constraint=fgfw.L1Ball(radius=10.0), **kwargs)


def test_bad_parameters_are_named():
    with pytest.raises(TypeError, match="not floating point"):
        fgfw.FrankWolfe([torch.zeros(3, dtype=torch.int64)], constraint=fgfw.L1Ball(radius=1.0))
    with pytest.raises(TypeError, match="layout"):
        fgfw.FrankWolfe([torch.zeros(3, 3).to_sparse()], constraint=fgfw.L1Ball(radius=1.0))
    with pytest.raises(ValueError, match="contiguous"):
        fgfw.FrankWolfe([torch.zeros(3, 4).t()], constraint=fgfw.L1Ball(radius=1.0))
    with pytest.raises(ValueError, match="share a device"):
        fgfw.FrankWolfe([torch.zeros(3), torch.zeros(3, device="meta")], constraint=fgfw.L1Ball(radius=1.0))
    # a tensor without requires_grad is left out with a warning before the group's momentum is checked
    with pytest.raises(ValueError, match="momentum"), pytest.warns(UserWarning, match="frozen"):
        fgfw.FrankWolfe([torch.zeros(3)], constraint=fgfw.L1Ball(radius=1.0), momentum=1.0)
    with pytest.raises(TypeError, match="constraint"):
        fgfw.FrankWolfe([torch.zeros(3)], constraint=1.0)
    with pytest.raises(TypeError, match="module"):
        fgfw.AFGFW(mlp().parameters(), constraint=fgfw.L1Ball(radius=1.0))
    with pytest.raises(ValueError, match="cannot mix float64"):
        fgfw.FrankWolfe([torch.zeros(3, requires_grad=True), torch.zeros(3, dtype=torch.float64, requires_grad=True)],
                        constraint=fgfw.L1Ball(radius=1.0, scope="global"))
    with pytest.raises(ValueError, match="module"):
        fgfw.AFGFW(mlp(), [nn.Parameter(torch.zeros(3))], constraint=fgfw.L1Ball(radius=1.0))


def test_non_finite_directional_derivative_leaves_everything_untouched():
    model, (x, y) = mlp(), batch()
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=0, step_size=0.1)
    opt.step(lambda: F.cross_entropy(model(x), y))
    before = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="not finite"):
        opt.step(lambda: F.cross_entropy(model(x) * float("nan"), y))
    after = model.state_dict(), opt.state_dict()
    for key in before[0]:
        assert torch.equal(before[0][key], after[0][key])
    assert before[1]["fgfw"] == after[1]["fgfw"]
    for i, s in before[1]["state"].items():
        assert torch.equal(s["momentum"], after[1]["state"][i]["momentum"])


def test_non_finite_gradient_raises_before_the_update():
    theta = nn.Parameter(torch.ones(4))
    opt = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=4.0))
    theta.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    with pytest.raises(ValueError, match="not finite"):
        opt.step()
    assert torch.equal(theta.detach(), torch.ones(4))


def test_schedule_callable_out_of_range_is_caught_before_the_update():
    model, (x, y) = mlp(), batch()
    before = copy.deepcopy(model.state_dict())
    opt = fgfw.FGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=0, step_size=lambda k: 2.0)
    with pytest.raises(ValueError, match="step_size"):
        opt.step(lambda: F.cross_entropy(model(x), y))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


SCHEDULE_KS = list(range(1, 20001)) + [123457, 2**31 + 11, 2**40 + 3, 2**52 - 1, 2**53] + \
    [int(k) for k in torch.randint(1, 2**53, (2000,), generator=torch.Generator().manual_seed(0))]


def exact_schedule(name: str, k: int):
    """The schedule's exact value (60 decimal digits), an independent reference."""
    with decimal.localcontext() as context:
        context.prec = 60
        k = decimal.Decimal(k)
        return {"2/(k+2)": 2 / (k + 2), "1/k": 1 / k, "1/sqrt(k)": 1 / k.sqrt(),
                "4/(k+8)^(2/3)": 4 / (k + 8) ** (decimal.Decimal(2) / 3)}[name]


@pytest.mark.parametrize("name", sorted(fgfw.schedules.NAMED))
def test_named_schedules_give_the_same_bits_on_the_host_and_as_tensors(name):
    """The CPU step evaluates a named schedule on the host, a GPU or compiled step on a float64 tensor: the
    same bits for every k, whatever the machine's sqrt (torch's float64 CPU sqrt is one ulp off for 1 % of
    these k on an AVX-512 machine). The first three are correctly rounded (1/sqrt(k) rounds twice, as
    1 / math.sqrt(k) does); 4/(k+8)^(2/3) lies within 2.5 ulps of its exact value."""
    closed_form = {"2/(k+2)": lambda k: 2 / (k + 2), "1/k": lambda k: 1 / k, "1/sqrt(k)": lambda k: 1 / math.sqrt(k),
                   "4/(k+8)^(2/3)": None}[name]
    host = [fgfw.schedules.evaluate(name, k, "step_size") for k in SCHEDULE_KS]
    ks = torch.tensor(SCHEDULE_KS, dtype=torch.float64)
    assert fgfw.schedules.evaluate(name, ks, "step_size").tolist() == host
    for k, value in zip(SCHEDULE_KS[::97], host[::97]):  # one element at a time, as the optimizers evaluate it
        assert float(fgfw.schedules.evaluate(name, torch.tensor(float(k), dtype=torch.float64), "step_size")) == value
    assert all(0 < value <= 1 for value in host)
    for k, value in zip(SCHEDULE_KS[::7], host[::7]):
        if closed_form is not None:
            assert value == closed_form(k), k
        assert abs(decimal.Decimal(value) - exact_schedule(name, k)) <= decimal.Decimal(2.5 * math.ulp(value)), k


def test_the_square_root_is_rounded_correctly_from_a_start_one_ulp_off():
    """schedules._round_sqrt turns a faithful square root (one ulp off either way, as some CPU builds of torch
    give) into the correctly rounded one, math.sqrt's, on the host and on tensors: what makes 1/sqrt(k) the
    same on every machine."""
    ks = SCHEDULE_KS[::3]
    exact = torch.tensor([math.sqrt(k) for k in ks], dtype=torch.float64)
    x = torch.tensor(ks, dtype=torch.float64)
    for start in (torch.nextafter(exact, torch.zeros_like(exact)), exact,
                  torch.nextafter(exact, torch.full_like(exact, math.inf))):
        assert torch.equal(fgfw.schedules._round_sqrt(x, start), exact)
        assert [fgfw.schedules._round_sqrt(float(k), y) for k, y in zip(ks[::11], start[::11].tolist())] == \
            exact[::11].tolist()


def test_the_momentum_rule_of_stochastic_frank_wolfe_as_averaging_weight():
    """averaging_weight="4/(k+8)^(2/3)" steps exactly as the constants 4/9^(2/3), 4/10^(2/3), ... (its values,
    checked against the exact ones above) do: it is gamma_k, the weight of the new estimate."""
    x, y = batch()
    runs = []
    for weights in ("4/(k+8)^(2/3)", [fgfw.schedules.evaluate("4/(k+8)^(2/3)", k, "w") for k in (1, 2, 3)]):
        model = mlp()
        opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=0, step_size=0.1,
                         averaging_weight=weights if isinstance(weights, str) else weights[0])
        for k in range(3):
            if not isinstance(weights, str):
                opt.param_groups[0]["averaging_weight"] = weights[k]
            opt.step(lambda: F.cross_entropy(model(x), y))
        runs.append([opt.state[p]["momentum"].clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_step_needs_a_closure():
    opt = fgfw.FGFW(mlp(), constraint=fgfw.L1Ball(radius=10.0), seed=0)
    with pytest.raises(TypeError, match="closure"):
        opt.step()


def test_load_state_dict_rejects_foreign_state():
    model = mlp()
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=0)
    foreign = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    with pytest.raises(ValueError, match="fgfw"):
        opt.load_state_dict(foreign)


@pytest.mark.parametrize("tangent", ["gaussian", "rademacher"])
def test_tangents_in_one_pass_follow_the_same_trajectory(tangent):
    x, y = batch()
    runs = []
    for one_pass in (False, True):
        model = mlp()
        opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=4, num_tangents=3, tangent=tangent,
                         step_size=0.1, tangents_in_one_pass=one_pass)
        for _ in range(3):
            opt.step(lambda: F.cross_entropy(model(x), y))
        runs.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_tangents_in_one_pass_needs_a_batched_engine():
    with pytest.raises(ValueError, match="tangents_in_one_pass"):
        fgfw.AFGFW(mlp(), constraint=fgfw.L1Ball(radius=10.0), engine="forward_ad", tangents_in_one_pass=True)


def test_fgfw_warns_about_a_single_rademacher_tangent():
    with pytest.warns(UserWarning, match="first element"):
        fgfw.FGFW(mlp(), constraint=fgfw.L1Ball(radius=10.0), tangent="rademacher")


def test_a_param_group_can_bring_its_own_constraint():
    layer = nn.Linear(3, 2).double()
    nn.init.zeros_(layer.bias)  # no initial norm to scale (the rule would take a stand-in): a radius of its own
    opt = fgfw.FrankWolfe([{"params": [layer.weight]},
                           {"params": [layer.bias], "constraint": fgfw.L1Ball(radius=0.5)}],
                          constraint=fgfw.L1Ball.relative_to_init(2.0))
    assert opt.param_groups[0]["radii"] == pytest.approx([2.0 * float(layer.weight.detach().abs().sum())])
    assert opt.param_groups[1]["radii"] == [0.5]
    layer.weight.grad = torch.ones_like(layer.weight)
    layer.bias.grad = torch.tensor([1.0, -3.0], dtype=torch.float64)
    opt.step()  # k = 1, alpha = 2/3: the bias moves to 2/3 of the vertex +0.5 e_1
    assert torch.allclose(layer.bias.detach(), torch.tensor([0.0, 0.5 * 2 / 3], dtype=torch.float64))


def assert_runs_agree(runs, *, exact: bool, atol: float, gap_rel: float) -> None:
    """Two runs' (parameters, gap): bit for bit (gap within 1e-12) when ``exact``, else within rtol 1e-5 and
    ``atol`` (gap within ``gap_rel``)."""
    (params_a, gap_a), (params_b, gap_b) = runs
    if exact:
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
        assert gap_a == pytest.approx(gap_b, rel=1e-12)
    else:
        for a, b in zip(params_a, params_b):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)
        assert gap_a == pytest.approx(gap_b, rel=gap_rel)


@pytest.mark.parametrize("constraint", [fgfw.GroupL1Ball(radius=3.0), fgfw.Simplex(radius=1.0, scope="row"),
                                        fgfw.L2Ball(radius=3.0), fgfw.LpBall(radius=3.0, p=1.5, scope="row"),
                                        fgfw.LInfBall(radius=0.2, scope="row"),
                                        fgfw.KSparsePolytope(radius=0.3, k=4, scope="global"),
                                        fgfw.KSparsePolytope(radius=0.3, k=2, scope="row")])
def test_other_sets_draw_their_tangents_with_the_backend_and_match_the_reference(constraint):
    """Sets other than the L1 ball step in their fused CPU kernels (L-infinity, Lp, k-sparse) or in torch ops
    with tangents drawn by the compiled backend; either must give the pure-torch reference's trajectory
    (backend='torch', torch ops throughout). Rademacher tangents: bit for bit, but for the Lp balls, whose
    norm is summed in another order (a few ulps)."""
    if not fgfw.HAS_COMPILED_EXTENSION:
        pytest.skip("the compiled CPU kernels are not built")
    x, y = batch()
    runs = []
    for backend in ("cpu", "torch"):
        model = mlp()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a start outside the set is moved into it
            # a matrix set takes the weights, the biases a set that steps bit for bit too
            groups = (fgfw.param_groups(model, weights=constraint, biases=fgfw.LInfBall(radius=0.2))
                      if isinstance(constraint, fgfw.constraints._MatrixSet) else None)
            opt = fgfw.AFGFW(model, params=groups, constraint=constraint, step_size=0.1, averaging_weight=0.5,
                             seed=3, tangent="rademacher", num_tangents=2, backend=backend)
        for _ in range(3):
            opt.step(lambda: F.cross_entropy(model(x), y))
        runs.append(([p.detach().clone() for p in model.parameters()], float(opt.last_gap)))
    assert_runs_agree(runs, exact=not isinstance(constraint, (fgfw.L2Ball, fgfw.LpBall)), atol=1e-6, gap_rel=1e-5)


# -- rescaled steps: a step per ball -------------------------------------------------------------------------
def _one_rescaled_step(constraint, rescale, theta0, grad, alpha):
    theta = torch.nn.Parameter(theta0.clone())
    opt = fgfw.FrankWolfe([theta], constraint=constraint, step_size=alpha, rescale=rescale)
    theta.grad = grad.clone()
    opt.step()
    return theta.detach()


@pytest.mark.parametrize("rescale", ["diameter", "gradient"])
@pytest.mark.parametrize("constraint", [fgfw.L2Ball(radius=2.0), fgfw.LInfBall(radius=0.5), fgfw.L1Ball(radius=3.0),
                                        fgfw.KSparsePolytope(radius=0.5, k=3)])
def test_a_rescaled_step_moves_each_ball_by_its_own_step(constraint, rescale):
    gen = torch.Generator().manual_seed(5)
    theta0 = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.01  # inside every ball above
    grad = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    alpha = 0.3
    s = constraint.vertex(grad.reshape(-1), constraint.radius, (4, 6)).reshape(4, 6)
    if rescale == "diameter":
        step = min(alpha / constraint.l2_diameter((4, 6), constraint.radius), 1.0)
    else:
        step = min(alpha * float(grad.norm()) / float((theta0 - s).norm()), 1.0)
    assert step != alpha  # the rescaling changes the step here
    expected = (1 - step) * theta0 + step * s
    got = _one_rescaled_step(constraint, rescale, theta0, grad, alpha)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


def test_row_balls_are_rescaled_one_by_one():
    constraint = fgfw.L2Ball(radius=1.0, scope="row")
    gen = torch.Generator().manual_seed(6)
    theta0 = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.01
    grad = torch.randn(3, 5, generator=gen, dtype=torch.float64) * torch.tensor([[0.1], [1.0], [10.0]],
                                                                               dtype=torch.float64)
    alpha = 0.05
    got = _one_rescaled_step(constraint, "gradient", theta0, grad, alpha)
    for i in range(3):
        s = constraint.vertex(grad[i], 1.0, (5,))
        step = min(alpha * float(grad[i].norm()) / float((theta0[i] - s).norm()), 1.0)
        torch.testing.assert_close(got[i], (1 - step) * theta0[i] + step * s, rtol=1e-12, atol=1e-15)


def test_rescale_is_checked_and_saved():
    theta = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="rescale must be None or one of"):
        fgfw.FrankWolfe([theta], constraint=fgfw.L2Ball(radius=1.0), rescale="lipschitz")
    opt = fgfw.FrankWolfe([theta], constraint=fgfw.L2Ball(radius=1.0), rescale="diameter")
    state = opt.state_dict()
    assert state["param_groups"][0]["rescale"] == "diameter"
    del state["param_groups"][0]["rescale"]  # a state saved before rescale existed loads as none
    opt.load_state_dict(state)
    assert opt.param_groups[0]["rescale"] is None


@pytest.mark.parametrize("constraint,kind", [(fgfw.LInfBall(radius=0.5, scope="row"), "linf"),
                                             (fgfw.L2Ball(radius=2.0, scope="row"), "lp"),
                                             (fgfw.LpBall(radius=2.0, p=3.0), "lp"),
                                             (fgfw.KSparsePolytope(radius=0.5, k=5, scope="row"), "ksparse"),
                                             (fgfw.KSparsePolytope(radius=0.5, k=50, scope="global"), "ksparse")])
def test_sets_step_in_their_fused_cpu_kernel_as_in_torch_ops(monkeypatch, constraint, kind):
    """FrankWolfe over L-infinity, Lp and k-sparse balls: the CPU backend makes one fused call of the set's op per
    step and gives the parameters of the torch-op step (backend='torch'): bit for bit with backprop gradients,
    within a few ulps for the Lp balls (their norm is summed in another order)."""
    if not fgfw.HAS_COMPILED_EXTENSION:
        pytest.skip("the compiled CPU kernels are not built")
    from fgfw import _ops
    calls = []
    original = _ops.set_fw_step_
    monkeypatch.setattr(_ops, "set_fw_step_", lambda *a, **k: (calls.append(a[0]), original(*a, **k))[1])
    x, y = batch()
    runs = []
    for backend in ("cpu", "torch"):
        model = mlp()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a start outside the set is moved into it
            opt = fgfw.FrankWolfe(model.parameters(), constraint=constraint, step_size=0.1, momentum=0.9,
                                  backend=backend)
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        runs.append(([p.detach().clone() for p in model.parameters()], float(opt.last_gap)))
    assert calls == [kind] * 4  # the cpu run; the torch run steps through reference.fw_step_
    assert_runs_agree(runs, exact=kind != "lp", atol=1e-7, gap_rel=1e-6)
