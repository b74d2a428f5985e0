"""The compiled CPU l1_fw_step_ against fgfw.reference.l1_fw_step_ on identical inputs.

The kernel mirrors the reference's arithmetic operation by operation, so wherever no transcendental
function is involved (backprop gradients, Rademacher tangents) parameters and momentum must agree
bit for bit; Gaussian tangents differ by an ulp of log/sin/cos and are compared with a tolerance.
The gap is a float64 sum whose order differs, hence a relative tolerance.
"""
import random

import pytest
import torch

from fgfw import _ops
from fgfw import reference as ref

import kernel_cases
import set_cases
from kernel_cases import (EXACT, GAUSSIAN, GAUSSIAN_TOL, PARAM_DTYPES, RADEMACHER, SHAPES, assert_same_step,
                          check_backprop_gradient, check_forward_gradient, check_row_balls, flat_offsets, make_group,
                          run_both)

@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("coeffs", [(0.7,), (0.7, -1.3, 0.25)])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_forward_gradient_matches_reference(fgfw_ops, dtype, distribution, coeffs, momentum, global_ball):
    check_forward_gradient(fgfw_ops, "cpu", dtype, distribution, coeffs, momentum, global_ball)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_backprop_gradient_matches_reference(fgfw_ops, dtype, momentum, global_ball):
    check_backprop_gradient(fgfw_ops, "cpu", dtype, momentum, global_ball)


def test_step_and_seed_wrap_like_the_reference(fgfw_ops):
    params, moms, _ = make_group(SHAPES, torch.float32, momentum=True, grads=False)
    expected, got = run_both(fgfw_ops, params, moms, [], schedule=(2**33 + 5, 0.2, 0.5), seed=-3,
                             distribution=RADEMACHER)
    assert_same_step(expected, got, EXACT)


def test_ties_lowest_index_wins_per_tensor(fgfw_ops):
    params = [torch.full((6,), 0.5), torch.full((4,), -0.25)]
    grads = [torch.tensor([0.1, -0.5, 0.2, 0.5, -0.5, 0.0]), torch.tensor([0.0, 0.3, -0.3, 0.3])]
    expected, got = run_both(fgfw_ops, params, [], grads, schedule=(1, 0.5, 1.0), radii=[1.0, 2.0], offsets=[])
    assert_same_step(expected, got, EXACT)
    theta = got[0]
    # tensor 0: |d| = 0.5 at 1, 3, 4 -> index 1 (d < 0, so s = +r); tensor 1: 0.3 at 1, 2, 3 -> index 1.
    # Every value here is exact in float32: the step is the exact (1 - alpha) theta + alpha s.
    expected0, expected1 = 0.5 * torch.full((6,), 0.5), 0.5 * torch.full((4,), -0.25)
    expected0[1] += 0.5 * 1.0
    expected1[1] += 0.5 * -2.0
    assert torch.equal(theta[0], expected0) and torch.equal(theta[1], expected1)


def test_ties_across_tensors_first_tensor_wins_in_global_ball(fgfw_ops):
    params = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(3)]
    # the maximum |d| = 0.5 sits late in tensor 0, early in tensors 1 and 2
    grads = [torch.tensor([0.1, 0.2, 0.5]), torch.tensor([[-0.5, 0.5], [0.0, 0.5]]), torch.tensor([0.5, 0.0, 0.0])]
    expected, got = run_both(fgfw_ops, params, [], grads, schedule=(1, 1.0, 1.0), global_ball=True, radii=[3.0],
                             offsets=[])
    assert_same_step(expected, got, EXACT)
    theta = got[0]
    # the vertex -r e_2 of tensor 0, one float32 below r: the step keeps the stored norm under r with a margin of
    # a few float64 ulps, which rounding to float32 takes to the next value down (reference.l1_vertex_value)
    assert torch.equal(theta[0], torch.tensor([0.0, 0.0, -torch.nextafter(torch.tensor(3.0), torch.tensor(0.0))]))
    assert not theta[1].any() and not theta[2].any()


@pytest.mark.parametrize("global_ball", [False, True])
def test_rademacher_everywhere_tied_picks_first_element(fgfw_ops, global_ball):
    # one Rademacher tangent without momentum: |d| = |c| at every element, ties across all segments
    params = [torch.zeros(50_001), torch.zeros(17)]
    radii = [1.0] if global_ball else [1.0, 1.0]
    expected, got = run_both(fgfw_ops, params, [], [], schedule=(3, 1.0, 1.0), coeffs=(0.5,), radii=radii,
                             global_ball=global_ball, distribution=RADEMACHER)
    assert_same_step(expected, got, EXACT)
    theta = got[0]
    assert theta[0][0] != 0 and theta[0][1:].count_nonzero() == 0
    assert theta[1].count_nonzero() == (0 if global_ball else 1) and (global_ball or theta[1][0] != 0)


def test_single_element_and_empty_tensors(fgfw_ops):
    params = [torch.tensor([0.3]), torch.empty(0), torch.tensor([[-0.2]])]
    moms = [torch.tensor([0.1]), torch.empty(0), torch.tensor([[0.0]])]
    for global_ball in (False, True):
        expected, got = run_both(fgfw_ops, params, moms, [], global_ball=global_ball, distribution=RADEMACHER)
        assert_same_step(expected, got, EXACT)


def test_empty_group_writes_zero_gap(fgfw_ops):
    gap = torch.full((), float("nan"), dtype=torch.float64)
    fgfw_ops.l1_fw_step_([], [], [], torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64),
                         torch.tensor([1.0], dtype=torch.float64), [], False, [], 0, GAUSSIAN, gap)
    assert gap.item() == 0.0


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_many_small_tensors(fgfw_ops, distribution, global_ball):
    rng = random.Random(0)
    shapes = [tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3))) for _ in range(50)]
    params, moms, _ = make_group(shapes, torch.float32, momentum=True, grads=False, seed=1)
    expected, got = run_both(fgfw_ops, params, moms, [], coeffs=(1.1, -0.4), global_ball=global_ball,
                             distribution=distribution)
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(expected, got, tol, gap_rtol=1e-9 if distribution == RADEMACHER else 1e-5)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_large_tensor_independent_of_thread_count(fgfw_ops, distribution, global_ball):
    params, moms, _ = make_group([(300_007,), (1000, 3)], torch.float32, momentum=True, grads=False, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected, one = run_both(fgfw_ops, params, moms, [], coeffs=(0.9, 0.2), global_ball=global_ball,
                                 distribution=distribution)
        torch.set_num_threads(2)
        _, two = run_both(fgfw_ops, params, moms, [], coeffs=(0.9, 0.2), global_ball=global_ball,
                          distribution=distribution)
    finally:
        torch.set_num_threads(threads)
    assert_same_step(one, two, EXACT)
    assert one[2].item() == two[2].item()
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(expected, one, tol, gap_rtol=1e-9 if distribution == RADEMACHER else 1e-5)


def test_nan_direction_matches_reference(fgfw_ops):
    # NaN is the largest |d| (torch.argmax's rule) and has sign 0 (torch.sign's): theta is only scaled
    params = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.4, 0.5])]
    grads = [torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([float("nan"), 9.0])]
    for global_ball in (False, True):
        expected, got = run_both(fgfw_ops, params, [], grads, global_ball=global_ball, offsets=[])
        assert_same_step(expected, got, EXACT)
        assert torch.isnan(got[2])


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
def test_iterates_stay_feasible(fgfw_ops, momentum, global_ball):
    shapes = [(40,), (8, 5), (3,)]
    params, moms, _ = make_group(shapes, torch.float32, momentum=momentum, grads=False, seed=3)
    radii = [1.5] if global_ball else [0.5, 2.0, 1.0]
    if global_ball:
        norm = sum(float(p.abs().sum()) for p in params)
        params = [p * (0.9 * radii[0] / norm) for p in params]
    else:
        params = [p * (0.9 * r / float(p.abs().sum())) for p, r in zip(params, radii)]
    offsets = flat_offsets(params)
    gap = torch.zeros((), dtype=torch.float64)
    for k in range(1, 31):
        alpha = 2.0 / (k + 2)
        schedule = torch.tensor([k, alpha, min(1.0, 4.0 / (k + 3))], dtype=torch.float64)
        fgfw_ops.l1_fw_step_(params, moms, [], schedule, torch.tensor([0.8, -0.6], dtype=torch.float64), radii,
                             global_ball, offsets, 11, GAUSSIAN, gap)
        assert gap.item() >= -1e-5  # <d, theta - s> >= 0 for the LMO vertex s
        if global_ball:
            assert sum(float(p.double().abs().sum()) for p in params) <= radii[0] * (1 + 1e-6)
        else:
            for p, r in zip(params, radii):
                assert float(p.double().abs().sum()) <= r * (1 + 1e-6)


def _valid_args():
    params = [torch.zeros(4), torch.zeros(2, 3)]
    return dict(params=params, momentum=[torch.zeros(4), torch.zeros(2, 3)], grads=[],
                schedule=torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64),
                tangent_coeffs=torch.tensor([1.0], dtype=torch.float64), radii=[1.0, 1.0], global_ball=False,
                offsets=[0, 4], seed=0, distribution=GAUSSIAN, gap=torch.zeros((), dtype=torch.float64), row_numel=[])


BAD_ARGS = {
    "momentum length": (dict(momentum=[torch.zeros(4)]), "momentum"),
    "grads length": (dict(grads=[torch.zeros(4)], offsets=[]), "grads"),
    "grads numel": (dict(grads=[torch.zeros(4), torch.zeros(5)]), r"grads\[1\]"),
    "grads dtype": (dict(grads=[torch.zeros(4), torch.zeros(2, 3, dtype=torch.float64)]), r"grads\[1\]"),
    "momentum dtype": (dict(params=[torch.zeros(4, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16)],
                            momentum=[torch.zeros(4, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16)]),
                       r"momentum\[0\]"),
    "momentum numel": (dict(momentum=[torch.zeros(4), torch.zeros(7)]), r"momentum\[1\]"),
    "mixed param dtypes": (dict(params=[torch.zeros(4), torch.zeros(2, 3, dtype=torch.float64)]), r"params\[1\]"),
    "integer params": (dict(params=[torch.zeros(4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)],
                            momentum=[]), "params"),
    "non-contiguous param": (dict(params=[torch.zeros(4), torch.zeros(3, 2).t()]), r"params\[1\]"),
    "schedule dtype": (dict(schedule=torch.tensor([1.0, 0.5, 0.5])), "schedule"),
    "schedule length": (dict(schedule=torch.tensor([0.5, 0.5], dtype=torch.float64)), "schedule"),
    "coeffs empty": (dict(tangent_coeffs=torch.zeros(0, dtype=torch.float64)), "tangent_coeffs"),
    "coeffs dtype": (dict(tangent_coeffs=torch.ones(1)), "tangent_coeffs"),
    "radii per tensor": (dict(radii=[1.0]), "radii"),
    "radii global": (dict(radii=[1.0, 1.0], global_ball=True), "radii"),
    "radius zero": (dict(radii=[1.0, 0.0]), r"radii\[1\]"),
    "radius negative": (dict(radii=[-1.0, 1.0]), r"radii\[0\]"),
    "radius infinite": (dict(radii=[1.0, float("inf")]), r"radii\[1\]"),
    "radius nan": (dict(radii=[float("nan"), 1.0]), r"radii\[0\]"),
    "global radius zero": (dict(radii=[0.0], global_ball=True), r"radii\[0\]"),
    "offsets length": (dict(offsets=[0]), "offsets"),
    "offsets empty with forward gradient": (dict(offsets=[]), "offsets"),
    "negative offset": (dict(offsets=[0, -4]), r"offsets\[1\]"),
    "distribution": (dict(distribution=3), "distribution"),
    "gap dtype": (dict(gap=torch.zeros(())), "gap"),
    "gap size": (dict(gap=torch.zeros(2, dtype=torch.float64)), "gap"),
    "row_numel length": (dict(row_numel=[3]), "row_numel"),
    "row_numel not dividing": (dict(row_numel=[0, 4]), r"row_numel\[1\]"),
    "row_numel negative": (dict(row_numel=[-2, 0]), r"row_numel\[0\]"),
    "row_numel with global ball": (dict(row_numel=[2, 0], radii=[1.0], global_ball=True), "global ball"),
    "radii per row": (dict(row_numel=[2, 3]), "radii must hold one radius per ball"),
}


@pytest.mark.parametrize("change,name", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_arguments_are_named(fgfw_ops, change, name):
    args = _valid_args()
    args.update(change)
    with pytest.raises(RuntimeError, match=name):
        fgfw_ops.l1_fw_step_(*args.values())


def test_valid_arguments_pass_the_checks(fgfw_ops):
    fgfw_ops.l1_fw_step_(*_valid_args().values())


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inf_and_nan_far_into_a_large_tensor(fgfw_ops, dtype, global_ball):
    # the kernel compares |d| as integers within a block: +inf must beat every number, the first
    # NaN must beat +inf, wherever they sit among blocks and segments
    params, _, grads = make_group([(70_001,), (9,)], dtype, momentum=False, grads=True, seed=4)
    grads[0][20_000] = float("inf")
    expected, got = run_both(fgfw_ops, params, [], grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT)
    grads[0][50_001] = float("nan")
    grads[0][60_000] = float("nan")
    expected, got = run_both(fgfw_ops, params, [], grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT)


@pytest.mark.parametrize("grads", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_balls_match_reference(fgfw_ops, dtype, distribution, momentum, grads):
    check_row_balls(fgfw_ops, "cpu", dtype, distribution, momentum, grads)


def test_row_balls_tie_lowest_index_of_each_row(fgfw_ops):
    # every |d| ties within a row: each row's own first element takes the vertex step
    params = [torch.full((3, 4), 0.01)]
    grads = [torch.tensor([[1.0, -1.0, 1.0, 1.0], [-2.0, 2.0, 2.0, -2.0], [0.5, 0.5, -0.5, 0.5]])]
    expected, got = run_both(fgfw_ops, params, [], grads, schedule=(1, 0.5, 1.0), radii=[1.0, 2.0, 3.0], offsets=[],
                             row_numel=[4])
    assert_same_step(expected, got, EXACT)
    assert got[0][0][:, 0].tolist() == pytest.approx([0.005 - 0.5, 0.005 + 1.0, 0.005 - 1.5], rel=1e-6)


# -- all_finite: the check_finite kernel -------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2])
def test_all_finite_kernel_agrees_with_the_definition(fgfw_ops, threads):
    import math
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tensors, expected in kernel_cases.nonfinite_cases():
            by_definition = all(math.isfinite(v) for t in tensors for v in t.double().reshape(-1).tolist())
            assert by_definition == expected
            assert fgfw_ops.all_finite(tensors) is expected
            assert ref.all_finite(tensors) is expected
            assert _ops.all_finite_multi_tensor(tensors) is expected  # the GPU's path, on the CPU
            found = fgfw_ops.nonfinite(tensors)  # the same verdict as a tensor (the skip flag)
            assert found.dtype == torch.bool and found.dim() == 0 and bool(found) is not expected
    finally:
        torch.set_num_threads(previous)


# -- the fused L-infinity step ------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["tensor", "row", "global"])
@pytest.mark.parametrize("source", ["grad", "rademacher", "gaussian"])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_linf_step_matches_reference(fgfw_ops, dtype, momentum, source, scope):
    gen = torch.Generator().manual_seed(7)
    shapes = [(7, 33), (5,), (3, 4, 5), (0,)]
    cdt = ref.compute_dtype(dtype)
    params = [((torch.rand(s, generator=gen) * 2 - 1) * 0.1).to(dtype) for s in shapes]  # inside every ball
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes] if source == "grad" else []
    moms = [torch.randn(s, generator=gen).to(cdt) for s in shapes] if momentum else []
    row_numel = [33, 0, 20, 0] if scope == "row" else []
    radii = {"global": [0.3], "row": [0.3] * 7 + [0.2] + [0.4] * 3 + [0.5], "tensor": [0.3, 0.2, 0.4, 0.5]}[scope]
    coeffs = (torch.tensor([0.7, -1.1], dtype=torch.float64) if source != "grad"
              else torch.zeros(0, dtype=torch.float64))
    schedule = torch.tensor([3.0, 0.2, 0.4], dtype=torch.float64)
    runs = []
    for step in (fgfw_ops.linf_fw_step_, ref.linf_fw_step_):
        ps, ms = [p.clone() for p in params], [m.clone() for m in moms]
        gap = torch.zeros((), dtype=torch.float64)
        step(ps, ms, grads, schedule, coeffs, radii, scope == "global", [0, 232, 240, 300], 5,
             RADEMACHER if source == "rademacher" else GAUSSIAN, gap, row_numel)
        runs.append((ps + ms, float(gap)))
    for got, want in zip(*(r[0] for r in runs)):
        if source == "gaussian":  # log/sin/cos differ in the last bits between the kernel and torch
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want)
    assert runs[0][1] == pytest.approx(runs[1][1], rel=1e-7 if source == "gaussian" else 1e-12)
    if dtype != torch.bfloat16:  # every iterate of a step from inside the ball stays in it
        for p, r in zip(runs[0][0][:len(shapes)], radii * (4 if scope == "global" else 1)):
            if scope == "tensor" and p.numel():
                assert float(p.abs().max()) <= r


# -- the fused Lp and k-sparse steps (and L-infinity again, through the shared checker) ---------------------
@pytest.mark.parametrize("scope", set_cases.SCOPES)
@pytest.mark.parametrize("source", set_cases.SOURCES)
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("kind,param", set_cases.CASES)
def test_set_steps_match_reference(fgfw_ops, kind, param, momentum, source, scope):
    step = getattr(fgfw_ops, set_cases.SETS[kind][0].__name__)
    runs = set_cases.run_set_step(step, kind, param, torch.float32, momentum, source, scope, "cpu", backend="cpu")
    set_cases.assert_set_step_matches(runs, kind, torch.float32, source, own_tangents=True)


@pytest.mark.parametrize("kind,param", [("lp", 2.0), ("lp", 3.0), ("ksparse", 3), ("ksparse", 5_000), ("linf", None)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_set_steps_match_reference_in_every_dtype(fgfw_ops, kind, param, dtype):
    step = getattr(fgfw_ops, set_cases.SETS[kind][0].__name__)
    for scope in set_cases.SCOPES:
        runs = set_cases.run_set_step(step, kind, param, dtype, True, "rademacher", scope, "cpu")
        set_cases.assert_set_step_matches(runs, kind, dtype, "rademacher")


def test_ksparse_step_breaks_ties_by_index_as_the_reference(fgfw_ops):
    set_cases.check_ksparse_selection_exact(fgfw_ops.ksparse_fw_step_, "cpu")


@pytest.mark.parametrize("threads", [1, 2])
def test_set_steps_do_not_depend_on_the_thread_count(fgfw_ops, threads):
    """Partials combine in segment order: the same bits for any number of threads (a 2^16-element tensor
    runs in parallel)."""
    previous = torch.get_num_threads()
    results = []
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            gen = torch.Generator().manual_seed(3)
            params = [torch.randn(1 << 16, generator=gen) * 1e-3]
            for op, extra in ((fgfw_ops.lp_fw_step_, dict(p=3.0, scales=[])),
                              (fgfw_ops.ksparse_fw_step_, dict(k=100, scales=[]))):
                p = [params[0].clone()]
                gap = torch.zeros((), dtype=torch.float64)
                op(p, [], [], torch.tensor([2.0, 0.1, 0.0], dtype=torch.float64),
                   torch.tensor([1.0], dtype=torch.float64), [1.0], False, [0], 9, GAUSSIAN, gap, [], **extra)
                results.append((p[0], float(gap)))
    finally:
        torch.set_num_threads(previous)
    for (a, gap_a), (b, gap_b) in zip(results[:2], results[2:]):
        assert torch.equal(a, b) and gap_a == gap_b


def test_set_steps_refuse_bad_parameters(fgfw_ops):
    p = [torch.zeros(4)]
    args = ([], [torch.ones(4)], torch.tensor([1.0, 0.1, 0.0], dtype=torch.float64), torch.zeros(0, dtype=torch.float64),
            [1.0], False, [0], 0, GAUSSIAN, torch.zeros((), dtype=torch.float64), [])
    for bad in (1.0, 0.5, float("inf"), float("nan")):
        with pytest.raises(RuntimeError, match="p must satisfy 1 < p < inf"):
            fgfw_ops.lp_fw_step_(p, *args, p=bad, scales=[])
    with pytest.raises(RuntimeError, match="k must be >= 1"):
        fgfw_ops.ksparse_fw_step_(p, *args, k=0, scales=[])
    assert torch.equal(p[0], torch.zeros(4))  # nothing moved


@pytest.mark.parametrize("name,extra", [("l1_fw_step_", {}), ("linf_fw_step_", {}),
                                        ("lp_fw_step_", dict(p=3.0, scales=[])),
                                        ("ksparse_fw_step_", dict(k=2, scales=[]))])
def test_step_argument_errors_name_their_op(fgfw_ops, name, extra):
    set_cases.check_errors_name_the_op(getattr(fgfw_ops, name), name, extra, "cpu")


@pytest.mark.parametrize("kind,param", [("linf", None), ("lp", 2.0), ("lp", 3.0), ("ksparse", 3), ("ksparse", 5_000)])
def test_set_steps_follow_the_reference_on_nonfinite_directions(fgfw_ops, kind, param):
    set_cases.check_nonfinite_directions(getattr(fgfw_ops, set_cases.SETS[kind][0].__name__), "cpu", kind, param)


def test_lp_step_of_directions_near_the_dtype_limits(fgfw_ops):
    set_cases.check_lp_directions_near_the_limits(fgfw_ops.lp_fw_step_, "cpu")


_BOTH_PATHS_SCRIPT = r"""
import sys, torch, fgfw
from torch import nn
torch.set_num_threads(1)
out = []
for dtype in (torch.float32, torch.float64, torch.bfloat16):
    for kind in ("afgfw", "fgfw_rademacher", "afgfw_rows", "fw", "fw_rows"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(300, 257), nn.Tanh(), nn.Linear(257, 10)).to(dtype)
        x, y = torch.randn(64, 300, dtype=dtype), torch.randint(0, 10, (64,))
        rows = kind.endswith("rows")
        ball = fgfw.L1Ball.relative_to_init(0.5, scope="row" if rows else "tensor")
        if kind.startswith("fw"):
            opt = fgfw.FrankWolfe(m, constraint=ball, momentum=0.9)
        elif kind == "fgfw_rademacher":
            opt = fgfw.FGFW(m, constraint=ball, seed=5, tangent="rademacher")
        else:
            opt = fgfw.AFGFW(m, constraint=ball, seed=5, num_tangents=1 if rows else 3)
        closure = lambda: nn.functional.cross_entropy(m(x).float(), y)
        for _ in range(3):
            if kind.startswith("fw"):
                opt.zero_grad()
                closure().backward()
                opt.step()
            else:
                opt.step(closure)
        out += [p.detach().clone() for p in m.parameters()]
        out += [t.clone() for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
torch.save(out, sys.argv[1])
"""


def test_cpu_step_has_the_same_bits_on_the_avx2_and_the_baseline_path(tmp_path):
    """The CPU pass runs AVX2-compiled loops where the CPU has AVX2 and the baseline (SSE2) loops elsewhere
    (FGFW_CPU_BASELINE=1 forces them): FrankWolfe, FGFW and AFGFW steps with tensor and row balls, in every dtype,
    Gaussian and Rademacher tangents, give the same bits on both paths."""
    import os
    import subprocess
    import sys

    results = []
    for baseline in (False, True):
        env = {k: v for k, v in os.environ.items() if k != "FGFW_CPU_BASELINE"}
        if baseline:
            env["FGFW_CPU_BASELINE"] = "1"
        path = tmp_path / f"{baseline}.pt"
        subprocess.run([sys.executable, "-c", _BOTH_PATHS_SCRIPT, str(path)], env=env, check=True, timeout=300,
                       capture_output=True)
        results.append(torch.load(path))
    avx2, base = results
    assert len(avx2) == len(base) > 30
    for a, b in zip(avx2, base):
        assert a.dtype == b.dtype and a.shape == b.shape
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert torch.equal(a.reshape(-1).view(width), b.reshape(-1).view(width))
