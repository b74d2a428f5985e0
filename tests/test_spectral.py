"""The spectral-norm ball (Newton-Schulz vertex) and the column-norm ball, against exact SVDs and closed forms."""
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fgfw
from fgfw import constraints
from fgfw.constraints import polar_factor


def _directions():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(40, 40, generator=g, dtype=torch.float64)  # square: the smallest singular value is tiny
    yield torch.randn(30, 70, generator=g, dtype=torch.float64)  # wide
    yield torch.randn(90, 20, generator=g, dtype=torch.float64)  # tall
    low = torch.randn(50, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 60, generator=g, dtype=torch.float64)
    yield low  # rank 3: the other singular values are 0 and stay 0
    yield 1e-30 * torch.randn(8, 5, generator=g, dtype=torch.float64)  # tiny and huge: scaled before the products
    yield 1e30 * torch.randn(8, 5, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("case", range(6))
def test_vertex_is_the_polar_factor_to_the_stated_accuracy(case):
    d = list(_directions())[case]
    r = 1.7
    c = fgfw.SpectralNormBall(radius=r)
    s = c.vertex(d.reshape(-1), r, tuple(d.shape)).reshape(d.shape)
    u, sigma, vt = np.linalg.svd(d.numpy(), full_matrices=False)
    rank = int((sigma > 1e-12 * sigma[0]).sum())
    s_sigma = np.linalg.svd(s.numpy() / r, compute_uv=False)
    # in the ball (up to float32 rounding), and every significant direction within [0.97, 1]
    assert s_sigma.max() <= 1 + 1e-5
    assert s_sigma[:rank].min() >= 0.97
    assert np.all(s_sigma[rank:] <= 1e-3)  # float32 rounding noise, lifted by the quintic steps
    # <d, s> against the exact vertex's -r ||d||_* (within 3 %), and s against -r U V^T on the significant part
    nuclear = sigma.sum()
    assert float((d * s).sum()) <= -0.97 * r * nuclear
    exact = -r * (u[:, :rank] @ vt[:rank])
    assert np.linalg.norm(s.numpy() - exact) <= 0.03 * r * math.sqrt(rank)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_1024_square_direction_meets_the_stated_band(seed):
    """Every singular value at or above 1e-4 (sum sigma^4)^(1/4) ends in [0.9, 1], none above 1. Seed 0's
    smallest is above that (all in band), seed 3's below it (1e-5: it ends at 0.13)."""
    d = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(seed))
    sigma_d = torch.linalg.svdvals(d.double())
    relative = sigma_d / (sigma_d ** 4).sum() ** 0.25
    sigma_s = torch.linalg.svdvals(polar_factor(d).double())  # the steps keep the order of the singular values
    assert float(sigma_s.max()) <= 1.0 + 1e-5
    assert float(sigma_s[relative >= 1e-4].min()) >= 0.9
    assert float((sigma_d * sigma_s).sum() / sigma_d.sum()) >= 0.99  # <d, s> / ||d||_* for s = polar factor


def test_batched_polar_factor_equals_one_matrix_at_a_time():
    g = torch.Generator().manual_seed(2)
    d = torch.randn(5, 12, 7, generator=g)
    batched = polar_factor(d)
    for b in range(5):
        torch.testing.assert_close(batched[b], polar_factor(d[b]), rtol=1e-5, atol=1e-6)


def test_zero_direction_gives_the_zero_vertex():
    c = fgfw.SpectralNormBall(radius=1.0)
    assert not c.vertex(torch.zeros(12, dtype=torch.float64), 1.0, (3, 4)).any()


def _clip_singular_values(a: torch.Tensor, r: float) -> torch.Tensor:
    u, sigma, vt = torch.linalg.svd(a, full_matrices=False)
    return u @ torch.diag(sigma.clamp(max=r)) @ vt


def test_frank_wolfe_on_the_spectral_ball_converges_and_stays_inside():
    """min ||W - A||_F^2 over {sigma_max(W) <= r}: the optimum clips A's singular values at r (a closed form).
    FrankWolfe (exact gradients, float32) approaches it and every iterate keeps sigma_max <= r (1 + 1e-5)."""
    g = torch.Generator().manual_seed(3)
    a = 2.0 * torch.randn(12, 9, generator=g)
    r = 1.5
    w_star = _clip_singular_values(a.double(), r)
    f_star = float(((w_star - a.double()) ** 2).sum())
    w = nn.Parameter(torch.zeros(12, 9))
    opt = fgfw.FrankWolfe([w], constraint=fgfw.SpectralNormBall(radius=r))
    worst = 0.0
    for _ in range(2000):
        opt.zero_grad()
        ((w - a) ** 2).sum().backward()
        opt.step()
        worst = max(worst, float(torch.linalg.matrix_norm(w.detach().double(), ord=2)))
    f = float(((w.detach().double() - a.double()) ** 2).sum())
    assert worst <= r * (1 + 1e-5)
    assert f - f_star <= 2e-2 * f_star, (f, f_star)


def test_momentum_and_forward_gradients_step_the_spectral_ball():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    groups = fgfw.param_groups(model, weights=fgfw.SpectralNormBall.operator_norm(1.0),
                               biases=fgfw.L2Ball.relative_to_init(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the start is moved into the operator-norm radii
        opt = fgfw.AFGFW(model, params=groups, constraint=fgfw.L1Ball(radius=1.0), step_size=0.05, seed=0)
    radii = opt.param_groups[0]["radii"]
    assert radii == pytest.approx([math.sqrt(8 / 6), math.sqrt(3 / 8)])
    for _ in range(20):
        opt.step(lambda: nn.functional.cross_entropy(model(x), y))
        for layer, r in zip((model[0], model[2]), radii):
            assert float(torch.linalg.matrix_norm(layer.weight.detach().double(), ord=2)) <= r * (1 + 1e-5)


def test_column_norm_ball_vertex_is_the_closed_form():
    g = torch.Generator().manual_seed(5)
    d = torch.randn(7, 5, generator=g, dtype=torch.float64)
    d[:, 2] = 0.0
    c = fgfw.ColumnNormBall(radius=0.8)
    s = c.vertex(d.reshape(-1), 0.8, (7, 5)).reshape(7, 5)
    for j in range(5):
        norm = float(d[:, j].norm())
        expected = torch.zeros(7, dtype=torch.float64) if norm == 0 else -0.8 * d[:, j] / norm
        torch.testing.assert_close(s[:, j], expected, rtol=1e-12, atol=1e-15)
    # the LMO of a product of balls: <d, s> = -r sum_j ||d_j||, and s is in the set
    assert float((d * s).sum()) == pytest.approx(-0.8 * float(d.norm(dim=0).sum()), rel=1e-12)
    assert c.contains(s, 0.8)


def test_matrix_sets_refuse_vectors_naming_the_parameter():
    for cls in (fgfw.SpectralNormBall, fgfw.ColumnNormBall, fgfw.NuclearNormBall, fgfw.GroupL1Ball):
        layer = nn.Linear(4, 3)
        with pytest.raises(ValueError, match=r"parameter 1 has shape \(3,\)"):
            fgfw.FrankWolfe(layer.parameters(), constraint=cls(radius=1.0))


def test_the_sets_round_trip_through_to_dict():
    for c in (fgfw.SpectralNormBall.operator_norm(0.5, quintic_steps=6), fgfw.SpectralNormBall(radius=2.0),
              fgfw.ColumnNormBall.from_init_diameter(1.0)):
        again = constraints.from_dict(c.to_dict())
        assert type(again) is type(c) and again.to_dict() == c.to_dict()
    with pytest.raises(ValueError, match="cubic_steps must be >= 1"):
        fgfw.SpectralNormBall(radius=1.0, cubic_steps=0)


def test_the_char_gpt_example_trains(capsys):
    """examples/train_char_gpt.py (docs/transformers.md's recipe) runs and reports a finite validation loss."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "train_char_gpt.py"
    spec = importlib.util.spec_from_file_location("train_char_gpt", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--steps", "2"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("step     2") and math.isfinite(float(line.split("val loss")[1].split()[0]))


@pytest.mark.parametrize("scale", [1e-200, 1.0, 1e200])
def test_the_spectral_gauge_is_the_largest_singular_value(scale):
    g = torch.Generator().manual_seed(6)
    for shape in [(7, 30), (30, 7), (2, 3, 4)]:
        x = scale * torch.randn(shape, generator=g, dtype=torch.float64)
        expected = np.linalg.norm(x.reshape(shape[0], -1).numpy(), ord=2)
        assert fgfw.SpectralNormBall(radius=1.0).gauge(x) == pytest.approx(expected, rel=1e-12)


def test_batched_vertices_match_one_vertex_per_matrix_with_one_newton_schulz_per_shape(monkeypatch):
    """batch_vertices stacks the matrices of one shape into one Newton-Schulz (one polar_factor call per shape,
    counted) and gives each matrix the vertex vertex() gives it alone, to float32 rounding; an empty matrix gets 0."""
    g = torch.Generator().manual_seed(4)
    shapes = [(16, 8), (8, 16), (16, 8), (16, 8), (8, 16), (4, 2, 3), (0, 5)]
    directions = [torch.randn(shape, generator=g, dtype=torch.float64).reshape(-1) * 10.0 ** (i - 3)
                  for i, shape in enumerate(shapes)]
    radii = [0.5 + i for i in range(len(shapes))]
    c = fgfw.SpectralNormBall(radius=1.0)
    monkeypatch.setattr(fgfw.SpectralNormBall, "BATCH_ON_CPU", True)  # the GPU's way, here on the CPU
    calls = []
    real = constraints.polar_factor
    monkeypatch.setattr(constraints, "polar_factor", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    batched = c.batch_vertices(directions, radii, shapes)
    assert sorted(calls) == sorted([(3, 16, 8), (2, 8, 16), (1, 4, 6)])
    for d, r, shape, s in zip(directions, radii, shapes, batched):
        alone = c.vertex(d, r, shape)
        assert s.shape == d.shape and s.dtype == d.dtype
        torch.testing.assert_close(s, alone, rtol=0, atol=2e-6 * r)


def test_frank_wolfe_on_a_transformer_block_batches_the_spectral_vertices(monkeypatch):
    """Through the optimizer: FrankWolfe on matrices of two shapes calls Newton-Schulz once per shape per step and
    steps as the per-matrix vertices would (the same parameters, to float32 rounding)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(12, 12, bias=False) for _ in range(4)], nn.Linear(12, 6, bias=False))
    twin = nn.Sequential(*[nn.Linear(12, 12, bias=False) for _ in range(4)], nn.Linear(12, 6, bias=False))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(32, 12)
    make = lambda m: fgfw.FrankWolfe(m.parameters(), constraint=fgfw.SpectralNormBall.operator_norm(1.0),  # noqa: E731
                                     step_size=0.1, momentum=0.9)
    opt, opt_twin = make(model), make(twin)
    monkeypatch.setattr(fgfw.SpectralNormBall, "BATCH_ON_CPU", True)  # the GPU's way, here on the CPU
    calls = []
    real = constraints.polar_factor
    monkeypatch.setattr(constraints, "polar_factor", lambda m, *a: calls.append(tuple(m.shape)) or real(m, *a))
    for _ in range(3):
        for m, o in ((model, opt), (twin, opt_twin)):
            o.zero_grad()
            m(x).square().mean().backward()
        opt.step()
        with monkeypatch.context() as patch:  # the twin: one vertex per matrix
            patch.setattr(fgfw.SpectralNormBall, "batch_vertices", None)
            opt_twin.step()
    batched = [shape for shape in calls if len(shape) == 3 and shape[0] > 1]
    assert batched == [(4, 12, 12)] * 3, calls
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    # on the CPU by default: one matrix at a time (faster there)
    monkeypatch.setattr(fgfw.SpectralNormBall, "BATCH_ON_CPU", False)
    calls.clear()
    opt.step()
    assert calls == [(12, 12)] * 4 + [(6, 12)], calls


@pytest.mark.parametrize("case", range(6))
def test_bfloat16_quintic_steps_keep_the_vertex_in_the_ball(case):
    """quintic_dtype="bfloat16" (Muon's product dtype for the quintic steps; the cubic steps stay float32): the
    vertex's singular values stay at most r (the cubic map is at most 1), and <d, s> within 3 % of the exact
    vertex's -r ||d||_nuclear. Unlike float32, bfloat16's noise in a low-rank direction's null space is lifted
    to singular values near 1 (measured: 1.0 for the rank-3 case): such a vertex is feasible and as good for
    <d, s>, but not U V^T there."""
    d = list(_directions())[case]
    r = 1.3
    c = fgfw.SpectralNormBall(radius=r, quintic_dtype="bfloat16")
    s = c.vertex(d.reshape(-1), r, tuple(d.shape)).reshape(d.shape)
    s_sigma = torch.linalg.svdvals(s / r)
    nuclear = float(torch.linalg.svdvals(d).sum())
    assert float(s_sigma.max()) <= 1 + 1e-5
    assert -float((d * s).sum()) >= 0.97 * r * nuclear
    assert -float((d * s).sum()) <= r * nuclear * (1 + 1e-9)


def test_quintic_dtype_is_checked_and_saved():
    with pytest.raises(ValueError, match="quintic_dtype"):
        fgfw.SpectralNormBall(1.0, quintic_dtype="float16")
    c = fgfw.SpectralNormBall.operator_norm(2.0, quintic_dtype="bfloat16")
    again = constraints.from_dict(c.to_dict())
    assert again.quintic_dtype == "bfloat16" and again.to_dict() == c.to_dict()
