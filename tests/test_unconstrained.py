"""Unconstrained param groups (``constraint=None``): a plain gradient step with the group's step size.

Checked against the spec (reference.gradient_step_, bit for bit) and against torch.optim.SGD, whose momentum
with dampening rho is FrankWolfe's ``v = rho v + (1 - rho) g``.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import reference


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_an_unconstrained_model_steps_as_sgd(momentum):
    """Without momentum: torch.optim.SGD. With it: SGD whose buffer starts at 0 and is damped,
    v = rho v + (1 - rho) g (torch's SGD starts its buffer at the first gradient), written out here."""
    model, twin = _model(), _model()
    x, y = _batch()
    opt = fgfw.FrankWolfe(model, constraint=None, step_size=0.05, momentum=momentum)
    sgd = torch.optim.SGD(twin.parameters(), lr=0.05)
    buffers = [torch.zeros_like(p) for p in twin.parameters()]
    for _ in range(10):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        twin.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        if momentum:
            with torch.no_grad():
                for p, v in zip(twin.parameters(), buffers):
                    v.mul_(momentum).add_(p.grad, alpha=1 - momentum)
                    p.sub_(0.05 * v)
        else:
            sgd.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        # 1 - (1 - rho) is rho up to a rounding: the two momentum buffers differ in the last bits
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert float(opt.last_gap) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("momentum", [None, 0.5])
def test_the_step_is_the_reference_bit_for_bit(dtype, momentum):
    g = torch.Generator().manual_seed(2)
    params = [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(4, 3), (6,)]]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn(p.shape, generator=g).to(dtype) for p in params] for _ in range(3)]
    opt = fgfw.FrankWolfe([{"params": params, "constraint": None}], constraint=fgfw.L1Ball(radius=1.0),
                          step_size="1/k", momentum=momentum)
    cdt = reference.compute_dtype(dtype)
    theta = [s.to(cdt).clone() for s in start]  # the reference steps in the compute dtype (the master copy)
    moms = [torch.zeros_like(t) for t in theta] if momentum else []
    for k, step_grads in enumerate(grads, start=1):
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        opt.step()
        schedule = torch.tensor([k, 1.0 / k, 1 - (momentum or 0.0)], dtype=torch.float64)
        reference.gradient_step_(theta, moms, step_grads, schedule, torch.zeros(0, dtype=torch.float64), [], 0, 0)
    for p, t in zip(params, theta):
        assert torch.equal(p.detach(), t.to(dtype)), (p, t)


def test_param_groups_with_none_train_norms_by_gradient_steps():
    model = _model()
    x, y = _batch()
    groups = fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(2.0), biases=None,
                               norms={"constraint": None, "step_size": 0.01})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to rescale: relative_to_init >= 1 keeps the start
        opt = fgfw.AFGFW(model, params=groups, constraint=fgfw.L1Ball(radius=1.0), seed=0, num_tangents=2)
    norm_weight = model[1].weight.detach().clone()
    radii = opt.param_groups[0]["radii"]
    for _ in range(5):
        opt.step(lambda: F.cross_entropy(model(x), y))
    # the LayerNorm gain moved (a gradient step), and the weights stayed in their balls
    assert not torch.equal(model[1].weight.detach(), norm_weight)
    for layer, r in zip((model[0], model[3]), radii):
        assert float(layer.weight.detach().abs().sum()) <= r * (1 + 1e-6)
    state = copy.deepcopy(opt.state_dict())
    assert state["param_groups"][2]["constraint"]["kind"] == "unconstrained"
    again = fgfw.AFGFW(model, params=fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(2.0),
                                                       biases=None, norms=None),
                       constraint=fgfw.L1Ball(radius=1.0), seed=0, num_tangents=2)
    again.load_state_dict(state)
    assert isinstance(again.param_groups[2]["constraint"], fgfw.Unconstrained)


def test_an_unconstrained_group_refuses_rescale():
    with pytest.raises(ValueError, match="leave rescale=None"):
        fgfw.FrankWolfe([{"params": [nn.Parameter(torch.ones(3))], "constraint": None}],
                        constraint=fgfw.L1Ball(radius=1.0), rescale="diameter")


def test_a_step_with_unconstrained_groups_compiles_whole_and_matches_eager():
    x, y = _batch()
    runs = []
    for compiled in (False, True):
        model = _model()
        groups = fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(2.0), biases=None, norms=None)
        opt = fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=1.0), momentum=0.9, check_finite=False,
                              backend="cpu")
        step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step  # reads nothing on the host
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("freeze_one", [False, True])
@pytest.mark.parametrize("algorithm", ["FGFW", "AFGFW"])
def test_the_forward_gradient_step_is_the_reference_bit_for_bit(dtype, freeze_one, algorithm):
    """FGFW's and AFGFW's unconstrained groups against reference.gradient_step_, which regenerates every tangent
    from the pure-torch stream at the tensor's offset: the same bits, with K = 2 Rademacher tangents (exact in
    every backend; the Gaussian's libm-like functions are not bit-identical across them), a bias frozen after
    construction (its place in the stream stays, a gap in the middle of the call's tensors) or not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3)).to(dtype)
    groups = fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(2.0),
                               biases={"constraint": None, "step_size": 0.01},
                               norms={"constraint": None, "step_size": 0.01})
    schedule = {"step_size": "1/k"} if algorithm == "FGFW" else {"step_size": "1/k", "averaging_weight": 0.5}
    opt = getattr(fgfw, algorithm)(model, params=groups, constraint=fgfw.L1Ball(radius=1.0), seed=3,
                                   num_tangents=2, tangent="rademacher", **schedule)
    if freeze_one:
        model[2].bias.requires_grad_(False)
    stepped = [p for g in opt.param_groups[1:] for p in g["params"] if p.requires_grad]
    cdt = reference.compute_dtype(dtype)
    theta = [p.detach().to(cdt).clone() for p in stepped]
    moms = [torch.zeros_like(t) for t in theta] if algorithm == "AFGFW" else []
    offsets = [opt._prepared().offsets[id(p)] for p in stepped]
    coeffs = torch.tensor([0.7, -1.3], dtype=torch.float64)
    for k in range(1, 4):
        opt._update_from_coefficients(coeffs * k)
        gamma = 0.5 if algorithm == "AFGFW" else 0.0
        reference.gradient_step_(theta, moms, [], torch.tensor([k, 0.01, gamma], dtype=torch.float64),
                                 coeffs * k / 2, offsets, 3, reference.RADEMACHER)
    for p, t in zip(stepped, theta):
        assert torch.equal(p.detach(), t.to(dtype)), (p, t)


@pytest.mark.parametrize("num_tangents", [1, 3])
def test_the_forward_gradient_update_compiles_to_eager_bits(num_tangents):
    """AFGFW's update of unconstrained groups under torch.compile(fullgraph=True) gives eager's bits, with one
    tangent and with several. With several, a tangent buffer refilled for the next tangent was read by Inductor
    after the refill (the first tangent's term fused into a later kernel): the compiled update drew the last
    tangent K times. Each tangent now has a buffer of its own."""
    coeffs = torch.tensor([0.5, -0.25, 0.125][:num_tangents], dtype=torch.float64)
    runs = []
    for compiled in (False, True):
        model = _model()
        groups = fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(2.0), biases=None, norms=None)
        opt = fgfw.AFGFW(model, params=groups, constraint=fgfw.L1Ball(radius=1.0), seed=0, tangent="rademacher",
                         num_tangents=num_tangents, check_finite=False, backend="cpu")
        update = torch.compile(opt._update_from_coefficients, fullgraph=True) if compiled \
            else opt._update_from_coefficients
        for k in range(1, 4):
            update(coeffs * k)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
