"""The compiled CUDA set steps (linf_fw_step_, lp_fw_step_, ksparse_fw_step_ in csrc/cuda/linf_fw_step.cu,
lp_fw_step.cu, ksparse_fw_step.cu) against fgfw.reference on identical inputs, through the shared checker
tests/set_cases.py, plus what the checker does not cover: many launches' worth of entries, rows with radii of their
own, balls of many slices, ties at the k-sparse threshold across slices, non-finite directions, huge magnitudes in the
Lp norm, determinism, no host synchronisation and CUDA graph capture.

Each test runs on the CPU kernels too, through the very same calls (the ops dispatch on the tensors' device), so
that this file's calls and expected errors are exercised without a GPU; its cuda variant skips without one.
GPU-only: test_no_host_synchronisation and test_cuda_graph_replays_equal_eager_steps.
test_set_steps_registered_for_cuda needs no GPU, only a build with CUDA kernels.
"""
import math

import pytest
import torch

import set_cases
from set_cases import (CASES, GAUSSIAN, RADEMACHER, SCOPES, SOURCES, assert_set_step_matches,
                       check_ksparse_selection_exact, run_set_step)

CUDA = "cuda"
OPS = {"linf": "linf_fw_step_", "lp": "lp_fw_step_", "ksparse": "ksparse_fw_step_"}
OTHER_DTYPES = [torch.float64, torch.bfloat16, torch.float16]


def _has_cuda_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"fgfw::{op}", "CUDA")


def test_set_steps_registered_for_cuda(fgfw_ops):
    # No GPU needed: a build with CUDA kernels (it has the CUDA l1_fw_step_) must have the set steps' too.
    if not _has_cuda_kernel("l1_fw_step_"):
        pytest.skip("fgfw._C was built without CUDA kernels (FGFW_CUDA=OFF, or no nvcc at build time)")
    missing = [op for op in OPS.values() if not _has_cuda_kernel(op)]
    assert not missing, f"fgfw._C has CUDA kernels but none for {missing} (csrc/cuda/{linf,lp,ksparse}_fw_step.cu not built?)"


@pytest.fixture(scope="session")
def cuda_set_ops(fgfw_cuda_ops):
    """torch.ops.fgfw with the CUDA set steps; skips without a GPU or where they were not built."""
    missing = [op for op in OPS.values() if not _has_cuda_kernel(op)]
    if missing:
        pytest.skip(f"fgfw._C has no CUDA kernels for {missing} (built without csrc/cuda/{linf,lp,ksparse}_fw_step.cu)")
    return fgfw_cuda_ops


@pytest.fixture(scope="session", params=["cpu", CUDA])
def device(request, fgfw_ops):
    """The device whose set steps a test runs (torch.ops.fgfw dispatches on the tensors' device): the CPU's
    everywhere, CUDA's where cuda_set_ops does not skip."""
    if request.param == CUDA:
        request.getfixturevalue("cuda_set_ops")
    return request.param


def op_of(ops, kind):
    return getattr(ops, OPS[kind])


# ---- the shared checker ----------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("kind,param", CASES)
def test_matches_reference(fgfw_ops, device, kind, param, scope, source, momentum):
    runs = run_set_step(op_of(fgfw_ops, kind), kind, param, torch.float32, momentum, source, scope, device,
                        backend=device)
    assert_set_step_matches(runs, kind, torch.float32, source, own_tangents=True)


@pytest.mark.parametrize("source,momentum", [("grad", False), ("rademacher", True), ("gaussian", True)])
@pytest.mark.parametrize("dtype", OTHER_DTYPES)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("kind,param", CASES)
def test_other_dtypes_match_reference(fgfw_ops, device, kind, param, scope, dtype, source, momentum):
    runs = run_set_step(op_of(fgfw_ops, kind), kind, param, dtype, momentum, source, scope, device, backend=device)
    assert_set_step_matches(runs, kind, dtype, source, own_tangents=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ksparse_selection_exact(fgfw_ops, device, dtype):
    check_ksparse_selection_exact(op_of(fgfw_ops, "ksparse"), device, dtype)


# ---- more shapes, radii and values -------------------------------------------------------------------------


def run_both(ops, kind, param, params, moms, grads, radii, *, global_ball=False, row_numel=(), offsets=None,
             source="grad", coeffs=(0.7, -1.1), schedule=(3.0, 0.2, 0.4)):
    """The reference, then the op, on copies of the same inputs (on the params' device): [(params, momentum, gap)]
    each, on the CPU."""
    ref_step, keyword, _ = set_cases.SETS[kind]
    device = params[0].device
    extra = set_cases.set_extra(kind, param)
    if offsets is None:
        offsets, start = [], 0
        for p in params:
            offsets.append(start)
            start += -(-p.numel() // 4) * 4
    coeff_t = torch.tensor(coeffs if source != "grad" else (), dtype=torch.float64, device=device)
    runs = []
    for fn in (ref_step, op_of(ops, kind)):
        ps, ms = [p.clone() for p in params], [m.clone() for m in moms]
        gap = torch.full((), float("nan"), dtype=torch.float64, device=device)
        fn(ps, ms, [g.clone() for g in grads], torch.tensor(schedule, dtype=torch.float64, device=device), coeff_t,
           list(radii), global_ball, list(offsets), 5, RADEMACHER if source == "rademacher" else GAUSSIAN, gap,
           list(row_numel), **extra)
        runs.append(([p.cpu() for p in ps], [m.cpu() for m in ms], float(gap)))
    return runs


def draw(shapes, dtype, device, *, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype).to(device) for s in shapes]


KINDS = [("linf", None), ("lp", 2.0), ("lp", 1.01), ("ksparse", 1), ("ksparse", 7)]


@pytest.mark.parametrize("kind,param", KINDS)
def test_rows_with_radii_of_their_own_and_many_entries(fgfw_ops, device, kind, param):
    # every row has its own radius, so every row is an entry: 300 tensors of 3 rows make 900 entries, several
    # launches of the kernels' entry tables
    shapes = [(3, 5 + t % 7) for t in range(300)]
    params = draw(shapes, torch.float32, device, seed=1, scale=0.01)
    moms = draw(shapes, torch.float32, device, seed=2)
    grads = draw(shapes, torch.float32, device, seed=3)
    radii = [0.1 + 0.001 * i for i in range(3 * len(shapes))]
    row_numel = [s[1] for s in shapes]
    runs = run_both(fgfw_ops, kind, param, params, moms, grads, radii, row_numel=row_numel)
    assert_set_step_matches(runs, kind, torch.float32, "grad")
    runs = run_both(fgfw_ops, kind, param, params, [], [], radii, row_numel=row_numel, source="rademacher")
    assert_set_step_matches(runs, kind, torch.float32, "rademacher")


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("kind,param", KINDS + [("ksparse", 5000)])
def test_balls_of_many_slices(fgfw_ops, device, kind, param, global_ball):
    # 1_000_003 elements: a ball of 245 slices, and a second tensor whose stream starts mid-call
    shapes = [(1_000_003,), (37,)]
    params = draw(shapes, torch.float32, device, seed=4, scale=0.01)
    moms = draw(shapes, torch.float32, device, seed=5)
    radii = [0.3] if global_ball else [0.3, 0.2]
    runs = run_both(fgfw_ops, kind, param, params, moms, [], radii, global_ball=global_ball, source="rademacher",
                    offsets=[0, 1_000_003 + 2])
    assert_set_step_matches(runs, kind, torch.float32, "rademacher")


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("k", [1, 1000, 30_000])
def test_ksparse_ties_at_the_threshold_span_slices(fgfw_ops, device, k, global_ball):
    # a few nonzero gradients and many zeros: for k above the nonzeros, the threshold is |d| = 0 and the lowest
    # indices among the zeros (in several slices, and in the later tensor for the global ball) are chosen
    shapes = [(20_000,), (9_000,)]
    grads = [torch.zeros(s, device=device) for s in shapes]
    spikes = torch.arange(0, 20_000, 997, device=device)
    grads[0][spikes] = torch.arange(1, spikes.numel() + 1, dtype=torch.float32, device=device)
    grads[1][5] = -3.0
    grads[1][4000] = 0.5
    params = draw(shapes, torch.float32, device, seed=6, scale=0.01)
    radii = [0.3] if global_ball else [0.3, 0.2]
    runs = run_both(fgfw_ops, "ksparse", k, params, [], grads, radii, global_ball=global_ball)
    assert_set_step_matches(runs, "ksparse", torch.float32, "grad")
    for a, b in zip(runs[1][0], runs[0][0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind,param", KINDS)
def test_non_finite_directions_like_the_reference(fgfw_ops, device, kind, param):
    # NaN is the largest |d| and has sign 0 (torch.sign), inf the next; the Lp vertex of such a ball is NaN.
    # The second tensor (its own ball) is unaffected; the gap is NaN.
    shapes = [(50,), (20,)]
    params = draw(shapes, torch.float32, device, seed=7, scale=0.01)
    grads = draw(shapes, torch.float32, device, seed=8)
    grads[0][7] = float("nan")
    grads[0][20] = float("inf")
    grads[0][30] = -float("inf")
    (p_ref, _, gap_ref), (p, _, gap) = run_both(fgfw_ops, kind, param, params, [], grads, [0.3, 0.2])
    for a, b in zip(p, p_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert gap != gap and gap_ref != gap_ref  # both NaN


@pytest.mark.parametrize("p", [1.01, 1.5, 3.0])
def test_lp_huge_magnitudes_do_not_overflow(fgfw_ops, device, p):
    # |d|^q overflows float64 for |d| ~ 1e300 (and float32 magnitudes ~ 1e38 with q = 101): the scaled sums
    # must not
    params = draw([(3000,), (7, 9)], torch.float64, device, seed=9, scale=0.01)
    grads = draw([(3000,), (7, 9)], torch.float64, device, seed=10, scale=1e300)
    (p_ref, _, gap_ref), (got, _, gap) = run_both(fgfw_ops, "lp", p, params, [], grads, [0.3, 0.2])
    for a, b in zip(got, p_ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert gap == pytest.approx(gap_ref, rel=1e-10)
    params = draw([(3000,)], torch.float32, device, seed=11, scale=0.01)
    grads = draw([(3000,)], torch.float32, device, seed=12, scale=1e37)
    (p_ref, _, _), (got, _, _) = run_both(fgfw_ops, "lp", p, params, [], grads, [0.3])
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got[0], p_ref[0], rtol=1e-6, atol=1e-8)


def test_lp_step_of_directions_near_the_dtype_limits(fgfw_ops, device):
    set_cases.check_lp_directions_near_the_limits(fgfw_ops.lp_fw_step_, device)


@pytest.mark.parametrize("kind,param", KINDS)
def test_lp_and_friends_on_zero_directions(fgfw_ops, device, kind, param):
    # d = 0 on a whole ball: the Lp vertex is 0 (the reference's zero vertex), the L-infinity and k-sparse
    # ones are -r sign(0) = 0 as well: theta is only scaled, and the gap is 0
    params = draw([(40, 3), (9,)], torch.float32, device, seed=13, scale=0.01)
    grads = [torch.zeros(40, 3, device=device), torch.zeros(9, device=device)]
    runs = run_both(fgfw_ops, kind, param, params, [], grads, [0.3] * 40 + [0.2], row_numel=[3, 0])
    assert_set_step_matches(runs, kind, torch.float32, "grad")
    assert runs[1][2] == 0.0


@pytest.mark.parametrize("kind,param", KINDS)
def test_empty_params_and_empty_tensors_give_gap_zero(fgfw_ops, device, kind, param):
    """A step with no element writes a gap of 0, or NaN when the schedule's skip is set (reference.schedule_values;
    the CUDA ops wrote 0 there before)."""
    extra = set_cases.set_extra(kind, param)
    coeffs = torch.zeros(0, dtype=torch.float64, device=device)
    gap = torch.full((), 7.0, dtype=torch.float64, device=device)
    empties = [torch.zeros(0, device=device), torch.zeros(0, 4, device=device)]
    for values, expected in (((1.0, 0.5, 1.0), 0.0), ((1.0, 0.5, 1.0, 0.0), 0.0), ((1.0, 0.5, 1.0, 1.0), math.nan)):
        schedule = torch.tensor(values, dtype=torch.float64, device=device)
        gaps = []
        gap.fill_(7.0)
        op_of(fgfw_ops, kind)([], [], [], schedule, coeffs, [], False, [], 0, GAUSSIAN, gap, [], **extra)
        gaps.append(float(gap))
        for global_ball, radii in ((False, [0.5, 0.5]), (True, [0.5])):
            gap.fill_(7.0)
            op_of(fgfw_ops, kind)(empties, [], [torch.zeros_like(e) for e in empties], schedule, coeffs, radii,
                                  global_ball, [], 0, GAUSSIAN, gap, [], **extra)
            gaps.append(float(gap))
        assert all(math.isnan(g) for g in gaps) if math.isnan(expected) else gaps == [expected] * 3, (values, gaps)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("kind,param", KINDS)
def test_deterministic(fgfw_ops, device, kind, param, scope):
    # the same inputs give the same bits, gap included (every reduction is a fixed tree)
    params, moms, grads, coeffs, row_numel, radii, offsets = set_cases.inputs(torch.float32, True, "gaussian", scope,
                                                                              device)
    extra = set_cases.set_extra(kind, param)
    results = []
    for _ in range(2):
        ps, ms = [p.clone() for p in params], [m.clone() for m in moms]
        gap = torch.zeros((), dtype=torch.float64, device=device)
        op_of(fgfw_ops, kind)(ps, ms, [], torch.tensor((3.0, 0.2, 0.4), dtype=torch.float64, device=device), coeffs,
                              radii, scope == "global", offsets, 5, GAUSSIAN, gap, row_numel, **extra)
        results.append((ps, ms, gap))
    (p1, m1, g1), (p2, m2, g2) = results
    assert all(torch.equal(a, b) for a, b in zip(p1 + m1, p2 + m2))
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("kind,param", KINDS)
def test_no_host_synchronisation(cuda_set_ops, kind, param):
    params, moms, grads, coeffs, row_numel, radii, offsets = set_cases.inputs(torch.float32, True, "rademacher",
                                                                              "row", CUDA)
    extra = set_cases.set_extra(kind, param)
    schedule = torch.tensor((3.0, 0.2, 0.4), dtype=torch.float64, device=CUDA)
    gap = torch.zeros((), dtype=torch.float64, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        op_of(cuda_set_ops, kind)(params, moms, [], schedule, coeffs, radii, False, offsets, 5, RADEMACHER, gap,
                                  row_numel, **extra)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("source", ["grad", "rademacher"])
@pytest.mark.parametrize("kind,param", KINDS)
def test_cuda_graph_replays_equal_eager_steps(cuda_set_ops, kind, param, source):
    # Rows with radii of their own need nothing uploaded: the step is capturable as it is. Each replay reads
    # the schedule the host wrote into the captured tensor before it.
    op = op_of(cuda_set_ops, kind)
    extra = set_cases.set_extra(kind, param)
    shapes = [(6, 40), (5000,), (3,)]
    row_numel = [40, 0, 0]
    radii = [0.1 * (i + 1) for i in range(6)] + [0.7, 0.05]
    offsets = [0, 240, 5240]
    params = draw(shapes, torch.float32, CUDA, seed=14, scale=0.01)
    moms = draw(shapes, torch.float32, CUDA, seed=15)
    grads = draw(shapes, torch.float32, CUDA, seed=16) if source == "grad" else []
    coeffs = torch.tensor((0.7, -1.1) if source != "grad" else (), dtype=torch.float64, device=CUDA)
    distribution = RADEMACHER if source == "rademacher" else GAUSSIAN
    schedules = [(3.0, 0.2, 0.4), (4.0, 0.1, 0.3), (5.0, 0.05, 0.9)]

    def step(ps, ms, schedule, gap):
        op(ps, ms, grads, schedule, coeffs, radii, False, offsets, 5, distribution, gap, row_numel, **extra)

    eager_p, eager_m, eager_gaps = [p.clone() for p in params], [m.clone() for m in moms], []
    for s in schedules:
        gap = torch.zeros((), dtype=torch.float64, device=CUDA)
        step(eager_p, eager_m, torch.tensor(s, dtype=torch.float64, device=CUDA), gap)
        eager_gaps.append(gap)

    graph_p, graph_m = [p.clone() for p in params], [m.clone() for m in moms]
    schedule = torch.tensor(schedules[0], dtype=torch.float64, device=CUDA)
    gap = torch.zeros((), dtype=torch.float64, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up step on copies, as torch's graph docs ask
        step([p.clone() for p in params], [m.clone() for m in moms], schedule, gap.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_p, graph_m, schedule, gap)
    graph_gaps = []
    for s in schedules:
        schedule.copy_(torch.tensor(s, dtype=torch.float64))
        graph.replay()
        graph_gaps.append(gap.clone())
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(graph_p + graph_m, eager_p + eager_m))
    assert all(torch.equal(a, b) for a, b in zip(graph_gaps, eager_gaps))


@pytest.mark.parametrize("kind,extra", [("linf", {}), ("lp", dict(p=3.0, scales=[])),
                                        ("ksparse", dict(k=2, scales=[]))])
def test_argument_errors_name_their_op(fgfw_ops, device, kind, extra):
    set_cases.check_errors_name_the_op(op_of(fgfw_ops, kind), OPS[kind], extra, device)


def test_reference_agrees_on_a_small_case_by_hand(fgfw_ops, device):
    # one ball of 4: d = (0.5, -2, 2, 0) with k = 2 -> elements 1 and 2 (|d| = 2) move to +r and -r
    theta = torch.full((4,), 0.25, device=device)
    grads = [torch.tensor([0.5, -2.0, 2.0, 0.0], device=device)]
    (p_ref, _, gap_ref), (p, _, gap) = run_both(fgfw_ops, "ksparse", 2, [theta], [], grads, [1.0],
                                                 schedule=(1.0, 0.5, 1.0))
    # theta + alpha (s - theta), exact in float32 here: 0.25 + 0.5 (s - 0.25)
    expected = torch.tensor([0.125, 0.625, -0.375, 0.125])
    assert torch.equal(p[0], expected) and torch.equal(p_ref[0], expected)
    # <d, theta - s> = 0.25 * (0.5 - 2 + 2 + 0) + 2 + 2
    assert gap == pytest.approx(4.125) and gap_ref == pytest.approx(4.125)
