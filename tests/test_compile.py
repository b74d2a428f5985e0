"""torch.compile of whole optimizer steps (fullgraph=True) against eager, and the ops' registrations.

Also the Triton backend's whole AFGFW trajectory against the reference's. On the CPU the Triton kernels
run in the interpreter; the CUDA and GPU-Triton variants skip without a GPU. Compiling takes tens of
seconds per graph here, so the models are tiny and every compiled run is checked for several things.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# As in test_triton.py: the interpreter must be chosen before fgfw.triton is first imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import fgfw  # noqa: E402
from fgfw import _ops  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEPS = 5


def _require(backend: str, device: str) -> None:
    if not _ops.backend_available(backend, device):
        pytest.skip(f"backend {backend!r} cannot run on {device} here (available: {_ops.available_backends(device)})")


@pytest.fixture
def compiled_graphs():
    """A function returning the number of graphs dynamo compiled since the test started."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()


def _batches(device, steps=STEPS):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen).to(device), torch.randint(0, 3, (8,), generator=gen).to(device))
            for _ in range(steps)]


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(device)


def _afgfw_run(backend, device, tangent, *, compiled, graphs=None):
    """STEPS AFGFW steps with the paper's (named) schedules; returns (params, gaps, optimizer, counts), counts
    holding ``graphs()`` after each step when given (the compiled_graphs fixture), else None."""
    model = _model(device)
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=10.0), seed=11, tangent=tangent, num_tangents=2,
                     backend=backend, check_finite=False)
    step = lambda x, y: opt.step(lambda: F.cross_entropy(model(x), y))  # noqa: E731
    if compiled:
        step = torch.compile(step, fullgraph=True)
    gaps, counts = [], []
    for x, y in _batches(device):
        step(x, y)
        gaps.append(opt.last_gap.item())
        counts.append(graphs() if graphs else None)
    return [p.detach().clone() for p in model.parameters()], gaps, opt, counts if graphs else None


def _frank_wolfe_run(backend, device, *, compiled, graphs=None, constraint=None):
    """STEPS backprop FW steps with momentum and the "2/(k+2)" schedule; opt.step alone is compiled. Returns
    (params, gaps, optimizer, counts) as _afgfw_run."""
    model = _model(device)
    opt = fgfw.FrankWolfe(model.parameters(), constraint=constraint or fgfw.L1Ball(radius=10.0), momentum=0.9,
                          backend=backend, check_finite=False)
    step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
    gaps, counts = [], []
    for x, y in _batches(device):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        step()
        gaps.append(opt.last_gap.item())
        counts.append(graphs() if graphs else None)
    return [p.detach().clone() for p in model.parameters()], gaps, opt, counts if graphs else None


def _assert_compiled_once_and_reused(counts):
    """``counts`` (graphs compiled so far, after each step): the first step compiled a graph (it ran compiled,
    not eagerly), the second may compile one more (the momentum state exists from then on), and steps 3..N
    reuse them (the step counter is a tensor: no graph per step)."""
    assert counts[0] >= 1, f"nothing was compiled: {counts}"
    assert counts[1] <= 2, f"graphs compiled after each step: {counts}"
    assert counts[2:] == [counts[1]] * (len(counts) - 2), f"recompiled after the second step: {counts}"


def _assert_same_run(got, expected, gap_rel):
    # The parameters see the direction d only through its argmax and sign (theta <- keep theta, then the
    # vertex element from -r sign d_i* and the ball's norm sums): a rounding difference in d that leaves the argmax
    # alone leaves them bit for bit equal, and one that moves it is a step to another vertex, which no
    # tolerance would absorb.
    for p, q in zip(got[0], expected[0]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert got[1] == pytest.approx(expected[1], rel=gap_rel, abs=0)
    # the step counter advanced inside the graph and persists as in eager
    assert got[2].state_dict()["fgfw"] == expected[2].state_dict()["fgfw"]


# The gap <d, theta - s> of the forward gradient: compiled and eager forward passes round the directional
# derivative (the JVP, float32) differently in the last bits (Inductor fuses and reorders the loss's
# reductions), and d = v inherits that relative error: a few float32 ulps times the loss's conditioning
# (2.3e-7 measured here); Rademacher or Gaussian tangents alike, since both runs draw the same tangents.
JVP_GAP_REL = 1e-5


@pytest.mark.parametrize("backend, device, tangent", [
    ("cpu", "cpu", "rademacher"),
    ("cpu", "cpu", "gaussian"),
    ("triton", TRITON_DEVICE, "rademacher"),
    pytest.param("triton", "cuda", "gaussian", marks=GPU),
    pytest.param("cuda", "cuda", "rademacher", marks=GPU),
    pytest.param("cuda", "cuda", "gaussian", marks=GPU),
])
def test_forward_gradient_step_compiles_whole(backend, device, tangent, compiled_graphs):
    """JVP + fused update in one graph: equal to eager; compiled on the first step, at most once more on the
    second (when the momentum state exists), and reused by steps 3..5 (k is a tensor, so no graph per step)."""
    _require(backend, device)
    expected = _afgfw_run(backend, device, tangent, compiled=False)
    assert compiled_graphs() == 0
    got = _afgfw_run(backend, device, tangent, compiled=True, graphs=compiled_graphs)
    _assert_compiled_once_and_reused(got[3])
    _assert_same_run(got, expected, JVP_GAP_REL)


@pytest.mark.parametrize("backend, device", [
    ("cpu", "cpu"),
    pytest.param("cuda", "cuda", marks=GPU),
    pytest.param("triton", "cuda", marks=GPU),
])
def test_backprop_step_compiles_whole(backend, device, compiled_graphs):
    _require(backend, device)
    expected = _frank_wolfe_run(backend, device, compiled=False)
    assert compiled_graphs() == 0
    got = _frank_wolfe_run(backend, device, compiled=True, graphs=compiled_graphs)
    _assert_compiled_once_and_reused(got[3])
    # the gradients come from the same eager backward and the compiled step calls the same kernel on the same
    # inputs: parameters and gaps bit for bit
    _assert_same_run(got, expected, gap_rel=0)


@pytest.mark.parametrize("constraint", [fgfw.LInfBall(radius=10.0, scope="row"), fgfw.L2Ball(radius=10.0),
                                        fgfw.KSparsePolytope(radius=1.0, k=3, scope="global")])
def test_set_steps_compile_whole(fgfw_ops, constraint, compiled_graphs):
    """The fused set ops (linf_fw_step_, lp_fw_step_, ksparse_fw_step_) inside a compiled FrankWolfe step: one
    graph, reused, and the eager run's parameters and gaps bit for bit (the same kernel on the same inputs)."""
    expected = _frank_wolfe_run("cpu", "cpu", compiled=False, constraint=constraint)
    assert compiled_graphs() == 0
    got = _frank_wolfe_run("cpu", "cpu", compiled=True, graphs=compiled_graphs, constraint=constraint)
    _assert_compiled_once_and_reused(got[3])
    _assert_same_run(got, expected, gap_rel=0)


def test_named_schedules_compiled_give_the_host_bits(compiled_graphs):
    """A compiled step evaluates the named schedules on its float64 counter (Inductor's own sqrt, divisions
    and selects): the same bits as the host's evaluation of the CPU step, also at the k where torch's eager
    float64 CPU sqrt is one ulp off on some machines (51, 78, 107, ...)."""
    names = sorted(fgfw.schedules.NAMED)
    evaluate = torch.compile(lambda k: torch.stack([fgfw.schedules.NAMED[name](k) for name in names]), fullgraph=True)
    for k in [1, 2, 3, 51, 78, 107, 149, 170, 1000, 123457, 2**31 + 11, 2**52 - 1]:
        got = evaluate(torch.tensor(float(k), dtype=torch.float64)).tolist()
        assert got == [fgfw.schedules.evaluate(name, k, "step_size") for name in names], k
    assert compiled_graphs() == 1


@pytest.mark.parametrize("tangent", ["rademacher", "gaussian"])
def test_triton_trajectory_equals_the_reference(tangent):
    _require("triton", TRITON_DEVICE)
    expected = _afgfw_run("torch", TRITON_DEVICE, tangent, compiled=False)
    got = _afgfw_run("triton", TRITON_DEVICE, tangent, compiled=False)
    # Parameters bit for bit either way (see _assert_same_run). The gap: Rademacher tangents are the reference's
    # bit for bit, so only the summation order differs (float64: ~1e-16 relative); Gaussian ones are within a
    # few float32 ulps of the reference's (tests/test_properties.py, TANGENT_ULPS), and so are the JVP and d.
    _assert_same_run(got, expected, 1e-10 if tangent == "rademacher" else 1e-5)


def test_cpp_ops_pass_opcheck(fgfw_ops):
    """The fake implementations (fgfw/_fake.py) agree with the C++ kernels' schemas and aliasing."""
    torch.library.opcheck(fgfw_ops.fill_tangent_.default, (torch.empty(10), 3, 2, 1, 4, 1))
    torch.library.opcheck(fgfw_ops.fill_tangent_at_step_.default, (torch.empty(10), 3, torch.tensor(2), 1, 4, 1))
    for grads in ([], [torch.randn(5), torch.randn(7)]):
        args = ([torch.randn(5), torch.randn(7)], [torch.zeros(5), torch.zeros(7)], grads,
                torch.tensor([2.0, 0.5, 0.25], dtype=torch.float64), torch.tensor([0.3, -1.0], dtype=torch.float64),
                [1.0, 2.0], False, [0, 8], 5, 0, torch.zeros((), dtype=torch.float64))
        torch.library.opcheck(fgfw_ops.l1_fw_step_.default, args)
        # row balls: 5 = one ball, 7 = 7 rows of 1, one radius each
        torch.library.opcheck(fgfw_ops.l1_fw_step_.default, (*args[:5], [1.0] * 8, *args[6:], [0, 1]))
        # the Lp and k-sparse ops: their parameter, then the norm feedback's scales (none, and one per ball)
        scales = lambda counts: [torch.ones(c, dtype=torch.float64) for c in counts]  # noqa: E731
        for op, extra, rows_extra in ((fgfw_ops.linf_fw_step_, (), ()),
                                      (fgfw_ops.lp_fw_step_, (3.0, scales([1, 1])), (3.0, scales([1, 7]))),
                                      (fgfw_ops.lp_fw_step_, (3.0, []), (3.0, [])),
                                      (fgfw_ops.ksparse_fw_step_, (2, scales([1, 1])), (2, scales([1, 7])))):
            torch.library.opcheck(op.default, (*args, [], *extra))
            torch.library.opcheck(op.default, (*args[:5], [1.0] * 8, *args[6:], [0, 1], *rows_extra))


def test_triton_and_counter_ops_pass_opcheck():
    _require("triton", TRITON_DEVICE)
    out = torch.empty(10, device=TRITON_DEVICE)
    torch.library.opcheck(torch.ops.fgfw_triton.fill_tangent_.default, (out, 3, 2, 1, 4, 1))
    torch.library.opcheck(torch.ops.fgfw_triton.fill_tangent_at_step_.default, (out, 3, torch.tensor(2), 1, 4, 1))
    f64 = dict(dtype=torch.float64, device=TRITON_DEVICE)
    args = ([torch.randn(5, device=TRITON_DEVICE)], [torch.zeros(5, device=TRITON_DEVICE)], [],
            torch.tensor([2.0, 0.5, 0.25], **f64), torch.tensor([0.3], **f64), [1.0], True, [0], 5, 1,
            torch.zeros((), **f64), [])
    torch.library.opcheck(torch.ops.fgfw_triton.l1_fw_step_.default, args)


def test_a_second_optimizer_with_other_radii_compiles_whole_too():
    """The second optimizer's step recompiles with its radii traced as symbolic floats (dynamo's automatic
    dynamic): the plan's checks must not turn them into graph breaks (math.isfinite did, under fullgraph)."""
    torch._dynamo.reset()
    for radius in (1.0, 2.0, 3.0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3))
        opt = fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=radius), check_finite=False,
                              backend="cpu")
        step = torch.compile(opt.step, fullgraph=True)
        x = torch.randn(5, 4)
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            step()
        assert all(float(p.detach().abs().sum()) <= radius * (1 + 1e-6) for p in model.parameters())
