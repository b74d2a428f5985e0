"""Whole optimizer steps captured in a CUDA graph and replayed equal the same steps run eagerly.

A step is capturable when it makes no host-to-device copy and reads nothing on the host: the step
counter, the schedule (k, alpha_k, gamma_k) and the tangents' step live on the device and the step
advances them itself, so each replay is the next step, not a repeat of the captured one. Needs a GPU, except
test_eager_steps_advance_on_the_cpu: the eager half of the comparison, on the CPU kernels, so that the optimizers
and the state this file reads are exercised without a GPU too.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import _ops

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

WARMUP, REPLAYS = 3, 5

# The L1 ball and two sets with fused steps of their own (sign vertex, k-sparse selection).
SETS = {
    "l1": lambda: fgfw.L1Ball(radius=4.0),
    "linf": lambda: fgfw.LInfBall(radius=0.5),
    "ksparse": lambda: fgfw.KSparsePolytope(radius=1.0, k=40),
}


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)


def _batch(device):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 12, generator=gen).to(device), torch.randint(0, 4, (32,), generator=gen).to(device)


@contextlib.contextmanager
def _side_stream(device):
    """Runs the body on a side stream the current one then waits for, as torch's graph docs ask of a warm-up; on the
    CPU (no streams) as it is."""
    if device != "cuda":
        yield
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


def _afgfw(model, backend, constraint):
    # named schedules only: a constant or callable would be fine too, but these exercise the device k
    return fgfw.AFGFW(model, constraint=constraint, seed=7, num_tangents=2, engine="lean", backend=backend,
                      check_finite=False)


def _frank_wolfe(model, backend, constraint):
    return fgfw.FrankWolfe(model.parameters(), constraint=constraint, momentum=0.8, backend=backend,
                           check_finite=False)


def _trajectory(kind, backend, set_name, *, graphed, device):
    """WARMUP eager steps, then REPLAYS more: eagerly, or as REPLAYS replays of a graph holding one step (on a GPU).
    Returns, after each of the REPLAYS steps, (parameters, gap, step counter)."""
    model = _model(device)
    opt = (_afgfw if kind == "forward" else _frank_wolfe)(model, backend, SETS[set_name]())
    x, y = _batch(device)

    def step():
        if kind == "forward":
            opt.step(lambda: F.cross_entropy(model(x), y))
        else:
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    with _side_stream(device):
        for _ in range(WARMUP):
            step()
    graph = None
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    snapshots = []
    for _ in range(REPLAYS):
        graph.replay() if graphed else step()
        if device == "cuda":
            torch.cuda.synchronize()
        snapshots.append(([p.detach().clone() for p in model.parameters()], opt.last_gap.clone(),
                          int(opt._step_count_k)))
    return snapshots


@pytest.mark.parametrize("set_name", sorted(SETS))
@pytest.mark.parametrize("kind", ["forward", "backprop"])
def test_eager_steps_advance_on_the_cpu(kind, set_name):
    """The GPU-free half of test_replayed_steps_equal_eager_steps, on the compiled CPU kernels: the eager trajectory
    that the replays are compared with, each step the next one."""
    if not _ops.backend_available("cpu", torch.device("cpu")):
        pytest.skip("backend cpu is not available here (fgfw._C is not built)")
    eager = _trajectory(kind, "cpu", set_name, graphed=False, device="cpu")
    start = [p.detach() for p in _model("cpu").parameters()]
    for i, (_, gap, k) in enumerate(eager):
        assert k == WARMUP + i + 1, f"step {i}: step counter {k}"
        assert torch.isfinite(gap), f"step {i}: gap {gap}"
    assert not torch.equal(eager[0][0][0], start[0])
    assert not torch.equal(eager[-1][0][0], eager[-2][0][0])


@gpu_only
@pytest.mark.parametrize("set_name", sorted(SETS))
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("kind", ["forward", "backprop"])
def test_replayed_steps_equal_eager_steps(kind, backend, set_name):
    if not _ops.backend_available(backend, torch.device("cuda")):
        pytest.skip(f"backend {backend} is not available here")
    eager = _trajectory(kind, backend, set_name, graphed=False, device="cuda")
    replayed = _trajectory(kind, backend, set_name, graphed=True, device="cuda")
    start = [p.detach() for p in _model("cuda").parameters()]
    for i, ((p_g, gap_g, k_g), (p_e, gap_e, k_e)) in enumerate(zip(replayed, eager)):
        # each replay is the next step, compared with the eager step of the same number
        assert k_g == k_e == WARMUP + i + 1, f"replay {i}: step counter {k_g}, eager {k_e}"
        for t, (a, b) in enumerate(zip(p_g, p_e)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"replay {i}, param {t}: {m}")
        torch.testing.assert_close(gap_g, gap_e, rtol=1e-6, atol=1e-9, msg=lambda m: f"replay {i}, gap: {m}")
    # the steps moved the parameters, and differently each time (a replay of a frozen step would repeat one)
    assert not torch.equal(replayed[0][0][0], start[0])
    assert not torch.equal(replayed[-1][0][0], replayed[-2][0][0])


@gpu_only
def test_triton_tables_of_a_captured_step_outlive_the_layout_cache():
    """A captured Triton step replays the addresses of its device tables: stepping eagerly over more layouts
    than the cache keeps (64) afterwards must not free them (they would be reused by other allocations)."""
    if not _ops.backend_available("triton", torch.device("cuda")):
        pytest.skip("backend triton is not available here")
    from fgfw.triton import l1_fw_step as triton_fw_step
    ops = torch.ops.fgfw_triton
    gen = torch.Generator().manual_seed(4)
    shapes, row_numel = [(20, 33), (70,), (3, 5000)], [33, 0, 0]
    params0 = [(0.01 * torch.randn(s, generator=gen)).cuda() for s in shapes]
    moms0 = [torch.randn(s, generator=gen).cuda() for s in shapes]
    radii = [0.5 + 0.01 * b for b in range(20)] + [0.7, 0.9]
    offsets = [0, 660, 732]
    schedule = torch.tensor([5.0, 0.1, 0.3], dtype=torch.float64, device="cuda")
    coeffs = torch.tensor([0.4, -0.9], dtype=torch.float64, device="cuda")

    def step(p, m, gap, step_radii=radii):
        ops.l1_fw_step_(p, m, [], schedule, coeffs, step_radii, False, offsets, 3, fgfw.reference.GAUSSIAN, gap,
                        row_numel)

    eager_p, eager_m = [x.clone() for x in params0], [x.clone() for x in moms0]
    eager_gap = torch.empty((), dtype=torch.float64, device="cuda")
    for _ in range(3):
        step(eager_p, eager_m, eager_gap)
    graph_p, graph_m = [x.clone() for x in params0], [x.clone() for x in moms0]
    gap = torch.empty((), dtype=torch.float64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(graph_p, graph_m, gap)  # uploads the tables (keyed by these addresses) before the capture
        for x, x0 in zip(graph_p + graph_m, params0 + moms0):
            x.copy_(x0)  # back to the start, in place
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_p, graph_m, gap)
    # 80 other radii: 80 layouts, more than the cache holds; their tables take the freed memory if any was
    scratch_p, scratch_m = [x.clone() for x in params0], [x.clone() for x in moms0]
    scratch_gap = torch.empty((), dtype=torch.float64, device="cuda")
    for k in range(80):
        step(scratch_p, scratch_m, scratch_gap, step_radii=[r + 0.003 * (k + 1) for r in radii])
    assert triton_fw_step._layout.cache_info().currsize <= 64
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for t, (a, b) in enumerate(zip(graph_p, eager_p)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"param {t}: {m}")
    torch.testing.assert_close(gap, eager_gap, rtol=0, atol=0)


@gpu_only
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_captured_step_keeps_the_radius_it_was_captured_with(backend):
    """Documented (docs/fused_step.md, "CUDA graphs"): a graph replays the radii of its capture. Changing the
    constraint's radius afterwards changes eager steps, not replays: recapture to change a radius."""
    if not _ops.backend_available(backend, torch.device("cuda")):
        pytest.skip(f"backend {backend} is not available here")
    model = _model("cuda")
    constraint = fgfw.LInfBall(radius=0.5)
    opt = _frank_wolfe(model, backend, constraint)
    x, y = _batch("cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    opt.param_groups[0]["constraint"] = fgfw.LInfBall(radius=0.25)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    # after 20 replays with step 2/(k+2) the weights mix vertices of radius 0.5: some |w| is past 0.25
    assert max(float(p.detach().abs().max()) for p in model.parameters()) > 0.25
