"""The iterates never leave the ball: long trajectories, the norm checked after every step.

The guarantee (README, "Guarantees"): for float32 and float64 parameters the stored iterate is inside
its ball exactly, ||theta||_1 <= r, at every step (the step's factors carry kappa = 1 - 4u, see
reference.feasibility_shrink); float16 and bfloat16 parameters are one rounding of a float32 master
iterate that is, so ||theta||_1 <= r (1 + u) with u the half dtype's unit roundoff. Before, rounding
drifted the iterate out of the ball: float16 reached ||theta||_1 = 1.17 for r = 1, and float32 passed
r (1 + 1e-6) after about 5,000 exact-gradient steps.
"""
import pytest
import torch

import fgfw
from fgfw import _ops

# The CPU kernels and the reference on the CPU; the CUDA kernels and compiled Triton on a GPU (the Triton
# interpreter is far too slow for these trajectories).
BACKENDS = ["cpu", "torch", "cuda", "triton"]


def _device(backend: str) -> torch.device:
    """Where the backend's trajectory runs, or a skip when it cannot run here."""
    device = torch.device("cuda" if backend in ("cuda", "triton") else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"backend {backend} needs a GPU here")
    if not _ops.backend_available(backend, device):
        pytest.skip(f"backend {backend} is not available on {device} (GPU: {torch.cuda.is_available()})")
    return device


def _l1(tensors) -> torch.Tensor:
    """The exact L1 norm of stored values (a float64 sum of at most a few thousand floats: exact enough), on their
    device: the trajectories keep their running maximum there, with no host read per step."""
    return sum(t.detach().double().abs().sum() for t in tensors)


def _least_squares(d=50, seed=0):
    """min ||A x - b||^2 over the L1 ball of radius 1, with the unconstrained optimum far outside it."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(2 * d, d, generator=gen)
    x_true = torch.randn(d, generator=gen)
    return a, a @ (3.0 * x_true / x_true.abs().sum())


@pytest.mark.parametrize("step_size", ["2/(k+2)", 1e-3, "1/k"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_iterates_stay_inside_the_ball_with_exact_gradients(backend, step_size):
    device = _device(backend)
    steps = 3_000 if backend == "torch" else 20_000  # the reference backend is slow per step
    a, b = (t.to(device) for t in _least_squares())
    x = torch.zeros(a.shape[1], requires_grad=True, device=device)
    opt = fgfw.FrankWolfe([x], constraint=fgfw.L1Ball(radius=1.0), step_size=step_size, backend=backend)
    worst = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(steps):
        opt.zero_grad()
        ((a @ x - b) ** 2).sum().backward()
        opt.step()
        worst = torch.maximum(worst, _l1([x]))
    worst = float(worst)
    assert worst <= 1.0, f"||x||_1 reached 1 + {worst - 1.0:.3g}"
    assert worst > 0.9  # the optimum is on the boundary: the iterates got near it


@pytest.mark.parametrize("step_size", [1e-4, lambda k: 1.0 / (k + 5000)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_iterates_are_one_rounding_from_the_ball(backend, dtype, step_size):
    device = _device(backend)
    steps = 1_000 if backend == "torch" else 5_000
    theta = torch.zeros(1000, dtype=dtype, requires_grad=True, device=device)
    with torch.no_grad():
        theta[0] = 1.0  # a vertex of the ball: feasible, and the worst case for drift
    opt = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=1.0), step_size=step_size, backend=backend)
    gen = torch.Generator().manual_seed(3)
    bound = 1.0 + torch.finfo(dtype).eps / 2
    worst = worst_master = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(steps):
        theta.grad = torch.randn(1000, generator=gen).to(device, dtype)
        opt.step()
        worst = torch.maximum(worst, _l1([theta]))
        if "master" in opt.state[theta]:
            worst_master = torch.maximum(worst_master, _l1([opt.state[theta]["master"]]))
    worst, worst_master = float(worst), float(worst_master)
    assert worst <= bound, f"||theta||_1 reached {worst!r} > r (1 + u) = {bound!r}"
    assert opt.state[theta]["master"].dtype == torch.float32 and worst_master <= 1.0


@pytest.mark.parametrize("scope", ["tensor", "row", "global"])
def test_afgfw_iterates_stay_inside_every_ball(scope):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    radius = 0.5  # below the initial norms: the start is rescaled, then every step keeps it inside
    with pytest.warns(UserWarning, match="rescaled"):
        opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=radius, scope=scope), step_size=0.05,
                         averaging_weight=0.5, seed=1, num_tangents=2)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))

    def balls():
        params = list(model.parameters())
        if scope == "global":
            return [params]
        if scope == "tensor":
            return [[p] for p in params]
        return [[row] for p in params for row in fgfw.L1Ball.rows(p)]

    assert all(float(_l1(ball)) <= radius for ball in balls())
    for _ in range(300):
        opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y))
        assert all(float(_l1(ball)) <= radius for ball in balls())
