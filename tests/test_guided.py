"""AFGFW's guided tangents (``guided=True``, issue 31 item 3): tangent 0 along the running direction v, the others
the stream's tangents projected off it, g = c_0 v_hat + 1/(K-1) sum_t c_t P u_t. Checked against autograd on a
quadratic: the estimate is unbiased given v, its component along v is the exact directional derivative, its error
has the variance the docstring states, and the tangents passed to the engine are orthogonal to v_hat; then the
optimizer's contract: first step = the plain estimate, determinism, resume, engines, check_finite, bad arguments."""
import io
import math

import pytest
import torch
from torch import nn

import fgfw
from fgfw import forward_grad

F64 = torch.float64


class Quadratic(nn.Module):
    """f(theta) = 0.5 theta^T A theta + b^T theta over two parameters (a 3 x 4 matrix and a 5-vector) seen as one
    17-vector: the tangents run through both."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Parameter(torch.randn(3, 4, generator=g, dtype=F64) * 0.1)
        self.b = nn.Parameter(torch.randn(5, generator=g, dtype=F64) * 0.1)
        m = torch.randn(17, 17, generator=g, dtype=F64)
        self.register_buffer("hessian", m @ m.T / 17 + torch.eye(17, dtype=F64))
        self.register_buffer("linear", torch.randn(17, generator=g, dtype=F64))

    def forward(self) -> torch.Tensor:
        theta = torch.cat([self.a.reshape(-1), self.b])
        return 0.5 * theta @ (self.hessian @ theta) + self.linear @ theta


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def autograd_gradient(model: Quadratic) -> torch.Tensor:
    with torch.enable_grad():
        return flat(torch.autograd.grad(model(), [model.a, model.b]))


def optimizer(model: Quadratic, **options) -> fgfw.AFGFW:
    """Two param groups (other radii) over the model's two parameters."""
    groups = [{"params": [model.a], "constraint": fgfw.L1Ball(5.0)}, {"params": [model.b], "constraint": fgfw.L1Ball(3.0)}]
    return fgfw.AFGFW(model, groups, constraint=None, **dict(dict(seed=7, num_tangents=2, guided=True), **options))


def momentum(opt, model) -> torch.Tensor:
    return flat(opt.state[p]["momentum"] for p in (model.a, model.b))


def set_momentum(opt, model, v: torch.Tensor) -> None:
    opt.state[model.a]["momentum"].copy_(v[:12].reshape(3, 4))
    opt.state[model.b]["momentum"].copy_(v[12:])


def estimates(num_tangents: int, draws: int):
    """``draws`` guided estimates at a fixed theta, each given the same fixed v: step size 0 (theta stays) and
    averaging weight 1 (the momentum after a step is the step's estimate g). Returns (the estimates, v, the
    autograd gradient)."""
    model = Quadratic()
    opt = optimizer(model, num_tangents=num_tangents, step_size=lambda k: 0.0, averaging_weight=1.0)
    opt.step(model)  # v = 0 here: the plain estimate, and the state exists
    v = torch.randn(17, generator=torch.Generator().manual_seed(1), dtype=F64)
    out = []
    for _ in range(draws):
        set_momentum(opt, model, v)
        opt.step(model)
        out.append(momentum(opt, model))
    return torch.stack(out), v, autograd_gradient(model)


@pytest.mark.parametrize("num_tangents", [2, 3])
def test_the_estimate_is_unbiased_given_v_with_the_stated_variance(num_tangents):
    """E[g | v] = grad f: the mean of N estimates (deterministic seed) is within 4 standard errors of the autograd
    gradient, the standard error from the stated variance E||g - grad f||^2 = d ||P grad f||^2 / (K-1) (Gaussian
    tangents, d = 17), which the measured mean squared error matches within 20 %."""
    draws = 1500
    g, v, grad = estimates(num_tangents, draws)
    v_hat = v / v.norm()
    orthogonal = grad - (v_hat @ grad) * v_hat
    variance = 17 * orthogonal.square().sum() / (num_tangents - 1)
    error = (g.mean(0) - grad).norm()
    assert error <= 4 * math.sqrt(variance / draws), (error, math.sqrt(variance / draws))
    mse = (g - grad).square().sum(1).mean()
    assert abs(mse / variance - 1) < 0.2, (mse, variance)


def test_the_component_along_v_is_the_exact_directional_derivative():
    """<v_hat, g> = <v_hat, grad f> (autograd) for every draw, to rounding: the random tangents add nothing along v."""
    g, v, grad = estimates(2, 20)
    v_hat = v / v.norm()
    torch.testing.assert_close(g @ v_hat, (v_hat @ grad).expand(20), rtol=1e-12, atol=1e-12)


@pytest.fixture
def recorded(monkeypatch):
    """An engine that records the tangents it is handed (every parameter's, per pass) and runs the lean one."""
    passes = []

    def recording(module, params, make_tangent, closure):
        passes.append(flat(make_tangent(j) for j in range(len(params))))
        return forward_grad.ENGINES["lean"](module, params, make_tangent, closure)

    monkeypatch.setitem(forward_grad.ENGINES, "recording", recording)
    return passes


@pytest.mark.parametrize("num_tangents", [2, 4])
def test_the_tangents_are_v_hat_and_random_ones_orthogonal_to_it(recorded, num_tangents):
    """Per step, tangent 0 is v_hat and the others are orthogonal to it over both groups' parameters together (to
    float64 rounding), and not zero; the directional derivative along tangent 0 is autograd's."""
    model = Quadratic()
    opt = optimizer(model, num_tangents=num_tangents, engine="recording")
    opt.step(model)
    for _ in range(5):
        v_hat = momentum(opt, model) / momentum(opt, model).norm()
        recorded.clear()
        opt.step(model)
        assert len(recorded) == num_tangents
        torch.testing.assert_close(recorded[0], v_hat, rtol=0, atol=1e-15)
        for u in recorded[1:]:
            assert abs(float(u @ v_hat)) < 1e-13 * float(u.norm()), float(u @ v_hat)
            assert float(u.norm()) > 1.0


def test_the_first_step_is_the_plain_estimate_and_the_second_is_not():
    """v = 0 at the first step: guided and plain AFGFW (same seed, K = 2) take the same step, bit for bit; from
    the second step on, guided differs."""
    guided, plain = Quadratic(), Quadratic()
    opt_guided, opt_plain = optimizer(guided), optimizer(plain, guided=False)
    opt_guided.step(guided)
    opt_plain.step(plain)
    assert torch.equal(flat(guided.parameters()), flat(plain.parameters()))
    assert torch.equal(momentum(opt_guided, guided), momentum(opt_plain, plain))
    opt_guided.step(guided)
    opt_plain.step(plain)
    assert not torch.equal(momentum(opt_guided, guided), momentum(opt_plain, plain))


def run(steps: int, **options) -> torch.Tensor:
    model = Quadratic()
    opt = optimizer(model, **options)
    for _ in range(steps):
        opt.step(model)
    return flat(model.parameters())


def test_same_seed_same_bits():
    assert torch.equal(run(8), run(8))
    assert not torch.equal(run(8), run(8, seed=8))


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit():
    """Save after 4 steps, load into a fresh model and optimizer (built with the defaults: guided comes from the
    state), take 4 more: the same bits as 8 steps in one run."""
    model = Quadratic()
    opt = optimizer(model)
    for _ in range(4):
        opt.step(model)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    fresh = Quadratic(seed=1)
    fresh.load_state_dict(saved["model"])
    resumed = optimizer(fresh, guided=False, seed=0)
    resumed.load_state_dict(saved["opt"])
    assert resumed.guided
    for _ in range(4):
        resumed.step(fresh)
    assert torch.equal(flat(fresh.parameters()), run(8))


def test_the_engines_and_one_pass_give_the_same_run():
    """forward_ad and lean, K passes or one: the same trajectory to float64 rounding (the c_t agree to rounding)."""
    lean = run(6, num_tangents=3)
    torch.testing.assert_close(run(6, num_tangents=3, engine="forward_ad"), lean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(run(6, num_tangents=3, tangents_in_one_pass=True), lean, rtol=1e-12, atol=1e-12)


def test_a_non_finite_directional_derivative_changes_nothing():
    """A NaN loss at a guided step raises ValueError (on the CPU at that step), and parameters and momentum keep
    their bits; the next steps run as if it had never been tried."""
    model = Quadratic()
    opt = optimizer(model)
    for _ in range(3):
        opt.step(model)
    before, v = flat(model.parameters()), momentum(opt, model)
    with pytest.raises(ValueError, match="not finite at step k=4"):
        opt.step(lambda: model() * float("nan"))
    assert torch.equal(flat(model.parameters()), before)
    assert torch.equal(momentum(opt, model), v)
    opt.step(model)
    assert torch.equal(flat(model.parameters()), run(4))


def test_bad_arguments_are_refused_early_naming_them():
    model = Quadratic()
    with pytest.raises(ValueError, match="num_tangents >= 2"):
        fgfw.AFGFW(model, constraint=fgfw.L1Ball(1.0), guided=True)
    with pytest.raises(TypeError, match="guided must be True or False"):
        fgfw.AFGFW(model, constraint=fgfw.L1Ball(1.0), num_tangents=2, guided=1)
    with pytest.raises(ValueError, match="estimator='weight'"):
        fgfw.AFGFW(model, constraint=fgfw.L1Ball(1.0), num_tangents=2, guided=True, estimator="activity")
    with pytest.raises(TypeError, match="guided"):  # FGFW has no running direction: no such argument
        fgfw.FGFW(model, constraint=fgfw.L1Ball(1.0), num_tangents=2, guided=True)


def test_a_state_that_cannot_be_guided_is_refused():
    """A state saved with guided=True but one tangent (edited) raises ValueError and leaves the optimizer as it was."""
    model = Quadratic()
    opt = optimizer(model)
    opt.step(model)
    state = opt.state_dict()
    state["fgfw"]["num_tangents"] = 1
    fresh = optimizer(Quadratic(), guided=False)
    with pytest.raises(ValueError, match="state_dict's guided=True needs num_tangents >= 2"):
        fresh.load_state_dict(state)
    assert not fresh.guided
