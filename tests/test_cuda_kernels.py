"""The compiled l1_fw_step_ against fgfw.reference.l1_fw_step_ on identical inputs: the CUDA kernel, and the CPU
kernel through the very same calls (the ops dispatch on the tensors' device), so that this file's calls, layouts
and expected errors are exercised without a GPU too.

The kernel rounds every operation as the reference does, so wherever no transcendental function is
involved (backprop gradients, Rademacher tangents) parameters and momentum must agree bit for bit;
Gaussian tangents use the kernel's log/sin/cos and are compared with a tolerance. The gap is a float64
sum in another order, hence a relative tolerance. The cuda variants skip without a GPU or without the
CUDA kernels; what needs a GPU by its nature (CUDA == CPU kernel, graph capture, streams, no host
synchronisation) is GPU-only.
"""
import math
import random

import pytest
import torch

from fgfw import reference as ref

import kernel_cases
from kernel_cases import (EXACT, GAUSSIAN, GAUSSIAN_TOL, PARAM_DTYPES, RADEMACHER, assert_same_step,
                          check_backprop_gradient, check_forward_gradient, check_row_balls, flat_offsets, row_radii,
                          run_both, run_step)

CUDA = "cuda"


def make_group(shapes, dtype, *, device, **kwargs):
    # device is required here: kernel_cases' default (the CPU) would quietly take a cuda variant off the GPU
    return kernel_cases.make_group(shapes, dtype, device=device, **kwargs)


@pytest.fixture(scope="session")
def cuda_ops(fgfw_cuda_ops):
    """torch.ops.fgfw with a CUDA l1_fw_step_; skips where the extension was built without it."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::l1_fw_step_", "CUDA"):
        pytest.skip("fgfw._C has no CUDA l1_fw_step_ (built without csrc/cuda/l1_fw_step.cu)")
    return fgfw_cuda_ops


@pytest.fixture(scope="session", params=["cpu", CUDA])
def device(request, fgfw_ops):
    """The device whose kernels a test runs (torch.ops.fgfw dispatches on the tensors' device): the CPU's
    everywhere, CUDA's where cuda_ops does not skip."""
    if request.param == CUDA:
        request.getfixturevalue("cuda_ops")
    return request.param


def realistic_shapes(width=64, layers=16):
    """A small transformer's parameter shapes: 2 + 12 per layer + 2 tensors (194 for 16 layers)."""
    shapes = [(1000, width), (128, width)]  # token and position embeddings
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,), (width,)]


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("coeffs", [(0.7,), (0.7, -1.3, 0.25)])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_forward_gradient_matches_reference(fgfw_ops, device, dtype, distribution, coeffs, momentum, global_ball):
    check_forward_gradient(fgfw_ops, device, dtype, distribution, coeffs, momentum, global_ball)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_backprop_gradient_matches_reference(fgfw_ops, device, dtype, momentum, global_ball):
    check_backprop_gradient(fgfw_ops, device, dtype, momentum, global_ball)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
@pytest.mark.parametrize("numel", [1, 7, 4096, "large"])
def test_sizes_match_reference(fgfw_ops, device, numel, dtype, distribution, global_ball):
    # "large" is 1_000_003 elements on the GPU, 100_003 (7 segments of the CPU kernel) on the CPU: a million
    # through the pure-torch reference, 16 times, would take half a minute of CI's two cores
    if numel == "large":
        numel = 1_000_003 if device == CUDA else 100_003
    # a second tensor whose stream starts mid-call (offset % 4 == numel % 4) follows the first
    params, moms, _ = make_group([(numel,), (37,)], dtype, momentum=True, grads=False, seed=numel, device=device)
    expected, got = run_both(fgfw_ops, params, moms, [], coeffs=(0.9, -0.2), global_ball=global_ball,
                             distribution=distribution)
    if distribution == RADEMACHER:
        assert_same_step(expected, got, EXACT, gap_rtol=1e-7)
    else:
        assert_same_step(expected, got, GAUSSIAN_TOL, gap_rtol=1e-5)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_realistic_model_shapes(fgfw_ops, device, distribution, global_ball):
    params, moms, _ = make_group(realistic_shapes(), torch.float32, momentum=True, grads=False, seed=4, device=device)
    expected, got = run_both(fgfw_ops, params, moms, [], coeffs=(1.1, -0.4), global_ball=global_ball,
                             distribution=distribution)
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(expected, got, tol, gap_rtol=1e-7 if distribution == RADEMACHER else 1e-5)


@pytest.mark.parametrize("global_ball", [False, True])
def test_more_tensors_than_one_launch_holds(fgfw_ops, device, global_ball):
    # 600 tensors take three chunk launches (256 rows each) and one finalize
    rng = random.Random(1)
    shapes = [(rng.randint(1, 300),) for _ in range(600)]
    params, moms, grads = make_group(shapes, torch.float32, momentum=True, grads=True, seed=5, device=device)
    expected, got = run_both(fgfw_ops, params, moms, grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)
    params, moms, _ = make_group(shapes, torch.bfloat16, momentum=False, grads=False, seed=6, device=device)
    expected, got = run_both(fgfw_ops, params, moms, [], global_ball=global_ball, distribution=RADEMACHER)
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)


def test_one_huge_tensor(fgfw_ops, device):
    # the CPU variant at 2^22 + 5 elements (257 segments of the CPU kernel): 2^26 through the
    # pure-torch reference takes too long on CI's two cores
    numel = 2**26 + 5 if device == CUDA else 2**22 + 5
    params, moms, _ = make_group([(numel,)], torch.float32, momentum=True, grads=False, seed=7, device=device)
    expected, got = run_both(fgfw_ops, params, moms, [], coeffs=(0.3,), distribution=RADEMACHER, offsets=[2])
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_unaligned_views_and_stream_offsets(fgfw_ops, device, dtype, distribution):
    # params, momentum and grads are views into flat buffers at every address alignment, and each
    # tensor's stream starts at every phase of a Philox call. A row takes the 16-byte path only when
    # every list's address minus its lead is aligned: params and momentum share their shift, so
    # tensors 0 and 2 (lead 1 and 3) take it in the forward-gradient run and the others do not; the
    # grads (another shift) send every 2- and 4-byte row to the scalar path in the second run.
    sizes = [4099, 4101, 3, 10_000, 8]
    cdt = ref.compute_dtype(dtype)
    gen = torch.Generator().manual_seed(8)
    buffers = [torch.randn(sum(sizes) + 8, generator=gen, dtype=torch.float64) for _ in range(3)]

    def views(buffer, out_dtype, shift, scale=1.0):
        buffer = (scale * buffer).to(out_dtype).to(device)
        out, start = [], shift
        for s in sizes:
            out.append(buffer[start:start + s])
            start += s + 1
        return out

    params = views(buffers[0], dtype, 1, scale=0.1)
    moms = views(buffers[1], cdt, 1)
    offsets = [1, 5002, 10_003, 20_000, 31_001]
    expected, got = run_both(fgfw_ops, params, moms, [], coeffs=(0.5, 0.25), offsets=offsets,
                             distribution=distribution)
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(expected, got, tol, gap_rtol=1e-7 if distribution == RADEMACHER else 1e-5)
    grads = views(buffers[2], dtype, 3)
    expected, got = run_both(fgfw_ops, params, moms, grads, offsets=offsets)
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)


def test_ties_lowest_index_wins_per_tensor(fgfw_ops, device):
    params = [torch.full((6,), 0.5, device=device), torch.full((4,), -0.25, device=device)]
    grads = [torch.tensor([0.1, -0.5, 0.2, 0.5, -0.5, 0.0], device=device),
             torch.tensor([0.0, 0.3, -0.3, 0.3], device=device)]
    expected, got = run_both(fgfw_ops, params, [], grads, schedule=(1, 0.5, 1.0), radii=[1.0, 2.0], offsets=[])
    assert_same_step(expected, got, EXACT)
    theta = [p.cpu() for p in got[0]]
    # every value here is exact in float32: the step is the exact (1 - alpha) theta + alpha s
    expected0, expected1 = 0.5 * torch.full((6,), 0.5), 0.5 * torch.full((4,), -0.25)
    expected0[1] += 0.5 * 1.0
    expected1[1] += 0.5 * -2.0
    assert torch.equal(theta[0], expected0) and torch.equal(theta[1], expected1)


def test_ties_across_tensors_first_tensor_wins_in_global_ball(fgfw_ops, device):
    params = [torch.zeros(3, device=device), torch.zeros(2, 2, device=device), torch.zeros(3, device=device)]
    grads = [torch.tensor([0.1, 0.2, 0.5]), torch.tensor([[-0.5, 0.5], [0.0, 0.5]]), torch.tensor([0.5, 0.0, 0.0])]
    expected, got = run_both(fgfw_ops, params, [], [g.to(device) for g in grads], schedule=(1, 1.0, 1.0),
                             global_ball=True, radii=[3.0], offsets=[])
    assert_same_step(expected, got, EXACT)
    theta = [p.cpu() for p in got[0]]
    # the vertex -r e_2 of tensor 0, one float32 below r (reference.l1_vertex_value's margin)
    assert torch.equal(theta[0], torch.tensor([0.0, 0.0, -torch.nextafter(torch.tensor(3.0), torch.tensor(0.0))]))
    assert not theta[1].any() and not theta[2].any()


@pytest.mark.parametrize("global_ball", [False, True])
def test_rademacher_everywhere_tied_picks_first_element(fgfw_ops, device, global_ball):
    # |d| = |c| everywhere: ties between threads, blocks, chunks, tensors and launches
    params = [torch.zeros(3_000_001, device=device), torch.zeros(17, device=device)] + \
             [torch.zeros(5, device=device) for _ in range(300)]
    radii = [1.0] if global_ball else [1.0] * len(params)
    expected, got = run_both(fgfw_ops, params, [], [], schedule=(3, 1.0, 1.0), coeffs=(0.5,), radii=radii,
                             global_ball=global_ball, distribution=RADEMACHER)
    assert_same_step(expected, got, EXACT)
    theta = got[0]
    assert theta[0][0] != 0 and theta[0][1:].count_nonzero() == 0
    for p in theta[1:]:
        assert p.count_nonzero() == (0 if global_ball else 1) and (global_ball or p[0] != 0)


def test_nan_direction_matches_reference(fgfw_ops, device):
    # NaN is the largest |d| (torch.argmax's rule) and has sign 0 (torch.sign's): theta is only scaled
    params = [torch.tensor([0.1, 0.2, 0.3], device=device), torch.tensor([0.4, 0.5], device=device)]
    grads = [torch.tensor([1.0, float("nan"), 2.0], device=device), torch.tensor([float("nan"), 9.0], device=device)]
    for global_ball in (False, True):
        expected, got = run_both(fgfw_ops, params, [], grads, global_ball=global_ball, offsets=[])
        assert_same_step(expected, got, EXACT)
        assert torch.isnan(got[2])


def test_single_element_and_empty_tensors(fgfw_ops, device):
    params = [torch.tensor([0.3], device=device), torch.empty(0, device=device), torch.tensor([[-0.2]], device=device)]
    moms = [torch.tensor([0.1], device=device), torch.empty(0, device=device), torch.tensor([[0.0]], device=device)]
    for global_ball in (False, True):
        expected, got = run_both(fgfw_ops, params, moms, [], global_ball=global_ball, distribution=RADEMACHER)
        assert_same_step(expected, got, EXACT)
    empty = [torch.empty(0, device=device), torch.empty(0, 3, device=device)]
    for global_ball in (False, True):
        expected, got = run_both(fgfw_ops, empty, [], [], global_ball=global_ball)
        assert got[2].item() == 0.0


def test_empty_group_writes_zero_gap(fgfw_ops, device):
    """No element: a gap of 0, or NaN when the schedule's skip is set (the CUDA op wrote 0 there before), for no
    params and for empty tensors."""
    coeffs = torch.tensor([1.0], dtype=torch.float64, device=device)
    for values, expected in (((1.0, 0.5, 0.5), 0.0), ((1.0, 0.5, 0.5, 0.0), 0.0), ((1.0, 0.5, 0.5, 2.0), math.nan)):
        schedule = torch.tensor(values, dtype=torch.float64, device=device)
        for params, radii in (([], []), ([torch.empty(0, device=device), torch.empty(0, 3, device=device)], [1, 1])):
            gap = torch.full((), 7.0, dtype=torch.float64, device=device)
            fgfw_ops.l1_fw_step_(params, [], [], schedule, coeffs, radii, False, flat_offsets(params), 0, GAUSSIAN,
                                 gap)
            assert math.isnan(gap.item()) if math.isnan(expected) else gap.item() == expected, (values, len(params))


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_cuda_equals_cpu_kernel(cuda_ops, dtype, distribution, global_ball):
    shapes = [(50_001,), (300, 7), (3,)]
    params, moms, _ = make_group(shapes, dtype, momentum=True, grads=False, seed=9, device="cpu")
    kwargs = dict(schedule=(12, 0.05, 0.2), coeffs=(0.8, 0.3), radii=[4.0] if global_ball else [1.0, 2.0, 3.0],
                  global_ball=global_ball, offsets=[6, 50_007, 60_000], seed=-11, distribution=distribution)
    on_cpu = run_step(cuda_ops.l1_fw_step_, params, moms, [], **kwargs)
    on_cuda = run_step(cuda_ops.l1_fw_step_, [p.to(CUDA) for p in params], [m.to(CUDA) for m in moms], [], **kwargs)
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(on_cpu, on_cuda, tol, gap_rtol=1e-9 if distribution == RADEMACHER else 1e-5)


@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_regenerated_tangents_equal_materialised_ones(fgfw_ops, device, dtype, distribution, momentum):
    # The update kernel regenerates u in registers; fill_tangent_ (on the same device) writes it to memory
    # for the JVP. Feeding g = sum_k c_k u_k, built from the materialised u with the kernel's roundings, to
    # the backprop path must give the very same step, bit for bit, Gaussian tangents included.
    shapes = [(10_007,), (33, 3), (2,)]
    params, moms, _ = make_group(shapes, dtype, momentum=momentum, grads=False, seed=10, device=device)
    offsets, seed, step, coeffs = [3, 10_011, 20_000], 77, 5, (0.6, -1.7)
    cdt = ref.compute_dtype(dtype)
    grads = []
    for p, offset in zip(params, offsets):
        g = None
        for k, c in enumerate(coeffs):
            u = torch.empty(p.shape, dtype=torch.float32, device=device)
            fgfw_ops.fill_tangent_(u, seed, step, k, offset, distribution)
            term = torch.tensor(c, dtype=torch.float64).to(cdt).to(device) * u.to(cdt)
            g = term if g is None else g + term
        grads.append(g.to(dtype))
    kwargs = dict(schedule=(step, 0.1, 0.4), coeffs=coeffs, radii=[1.0, 2.0, 3.0], global_ball=False, offsets=offsets,
                  seed=seed, distribution=distribution)
    regenerated = run_step(fgfw_ops.l1_fw_step_, params, moms, [], **kwargs)
    materialised = run_step(fgfw_ops.l1_fw_step_, params, moms, grads, **kwargs)
    assert_same_step(materialised, regenerated, EXACT, gap_rtol=0)
    assert_same_step(run_step(ref.l1_fw_step_, params, moms, grads, **kwargs), regenerated, EXACT)


@pytest.mark.parametrize("global_ball", [False, True])
def test_cuda_graph_replay_equals_eager(cuda_ops, global_ball):
    params, moms, _ = make_group(realistic_shapes(width=32, layers=4), torch.float32, momentum=True, grads=False,
                                 seed=11, device=CUDA)
    offsets = flat_offsets(params)
    radii = [5.0] if global_ball else [1.0] * len(params)
    schedules = [(k, 2.0 / (k + 2), min(1.0, 4.0 / (k + 3))) for k in range(1, 5)]
    coeff_values = [(0.3, -0.1), (-1.2, 0.4), (0.05, 0.9), (2.0, -2.0)]

    def step(p, m, schedule, coeffs, gap):
        cuda_ops.l1_fw_step_(p, m, [], schedule, coeffs, radii, global_ball, offsets, 3, GAUSSIAN, gap)

    eager_p, eager_m = [x.clone() for x in params], [x.clone() for x in moms]
    eager_gaps = []
    for schedule, coeffs in zip(schedules, coeff_values):
        gap = torch.empty((), dtype=torch.float64, device=CUDA)
        step(eager_p, eager_m, torch.tensor(schedule, dtype=torch.float64, device=CUDA),
             torch.tensor(coeffs, dtype=torch.float64, device=CUDA), gap)
        eager_gaps.append(gap.clone())

    graph_p, graph_m = [x.clone() for x in params], [x.clone() for x in moms]
    schedule = torch.zeros(3, dtype=torch.float64, device=CUDA)
    coeffs = torch.zeros(2, dtype=torch.float64, device=CUDA)
    gap = torch.empty((), dtype=torch.float64, device=CUDA)
    warm_p, warm_m = [x.clone() for x in params], [x.clone() for x in moms]  # warm-up must not touch graph_p
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(warm_p, warm_m, schedule, coeffs, gap)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_p, graph_m, schedule, coeffs, gap)
    for k, (values, c) in enumerate(zip(schedules, coeff_values)):
        schedule.copy_(torch.tensor(values, dtype=torch.float64))
        coeffs.copy_(torch.tensor(c, dtype=torch.float64))
        graph.replay()
        assert gap.item() == eager_gaps[k].item()
    assert_same_step((eager_p, eager_m, eager_gaps[-1]), (graph_p, graph_m, gap), EXACT, gap_rtol=0)


@pytest.mark.parametrize("grads", [False, True])
def test_step_never_synchronises(cuda_ops, grads):
    params, moms, grad_list = make_group(realistic_shapes(width=16, layers=2), torch.bfloat16, momentum=True,
                                         grads=grads, seed=12, device=CUDA)
    schedule = torch.tensor([3.0, 0.1, 0.5], dtype=torch.float64, device=CUDA)
    coeffs = torch.tensor([0.5, 0.25], dtype=torch.float64, device=CUDA)
    gap = torch.empty((), dtype=torch.float64, device=CUDA)
    radii = [1.0] * len(params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for global_ball in (False, True):
            cuda_ops.l1_fw_step_(params, moms, grad_list, schedule, coeffs, [1.0] if global_ball else radii,
                                 global_ball, flat_offsets(params), 1, GAUSSIAN, gap)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_nonfinite_agrees_with_the_definition(fgfw_ops, device):
    """fgfw::nonfinite, the finite check without a host read, against math.isfinite on every value: the dtypes'
    extremes, a bad value at chunk edges, views (only their own elements count), more tensors than one CUDA launch
    holds, views one element off the 16-byte alignment, dtypes and integers mixed in one call; the verdict is a
    0-dim bool tensor on the tensors' device."""
    cases = kernel_cases.nonfinite_cases(device)
    gen = torch.Generator().manual_seed(4)
    many = [torch.randn(5 + t % 9, generator=gen).to(device) for t in range(300)]  # two launches of 256 rows
    for at in (3, 290):
        bad = [t.clone() for t in many]
        bad[at][-1] = float("inf")
        cases += [(bad, False)]
    cases += [(many, True)]
    for dtype in (torch.float32, torch.float16, torch.float64):
        x = torch.randn(4 * 4099 + 2, generator=gen).to(dtype).to(device)
        for first, last in ((1, -1), (3, 4 * 4099 + 2)):  # unaligned starts: the kernel's scalar path
            view = x[first:last]
            cases += [([view], True)]
            poisoned = x.clone()
            poisoned[last - 1 if last > 0 else last - 1] = float("nan")
            cases += [([poisoned[first:last]], False)]
    cases += [([torch.arange(5, device=device), torch.ones(3, dtype=torch.bfloat16, device=device),
                torch.tensor([1.0, float("nan")], dtype=torch.float64, device=device)], False)]
    cases += [([torch.arange(5, device=device), torch.ones(3, dtype=torch.bfloat16, device=device)], True)]
    for tensors, expected in cases:
        by_definition = all(math.isfinite(v) for t in tensors for v in t.double().reshape(-1).tolist())
        assert by_definition == expected
        found = fgfw_ops.nonfinite(tensors)
        assert found.dtype == torch.bool and found.dim() == 0 and found.device == tensors[0].device
        assert bool(found) is not expected
    with pytest.raises(RuntimeError, match="no tensor arguments"):  # the dispatcher's own error: no device to go by
        fgfw_ops.nonfinite([])


def test_nonfinite_never_synchronises(cuda_ops):
    tensors = [torch.randn(1000, device=CUDA), torch.randn(7, dtype=torch.bfloat16, device=CUDA)]
    tensors[1][3] = float("nan")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        found = cuda_ops.nonfinite(tensors)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert bool(found)


def test_bad_arguments_are_named(fgfw_ops, device):
    params = [torch.zeros(4, device=device)]
    schedule = torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64, device=device)
    coeffs = torch.ones(1, dtype=torch.float64, device=device)
    gap = torch.zeros((), dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match=r"radii\[0\]"):
        fgfw_ops.l1_fw_step_(params, [], [], schedule, coeffs, [0.0], False, [0], 0, GAUSSIAN, gap)
    # on the GPU the momentum and schedule are on the wrong device; the CPU has no other device, so there they
    # have the wrong dtype (the same argument check names them)
    bad_momentum = torch.zeros(4) if device == CUDA else torch.zeros(4, dtype=torch.float64)
    bad_schedule = schedule.cpu() if device == CUDA else schedule.float()
    with pytest.raises(RuntimeError, match=r"momentum\[0\]"):
        fgfw_ops.l1_fw_step_(params, [bad_momentum], [], schedule, coeffs, [1.0], False, [0], 0, GAUSSIAN, gap)
    with pytest.raises(RuntimeError, match="schedule"):
        fgfw_ops.l1_fw_step_(params, [], [], bad_schedule, coeffs, [1.0], False, [0], 0, GAUSSIAN, gap)


@pytest.mark.parametrize("global_ball", [False, True])
def test_inf_and_nan_far_into_a_large_tensor(fgfw_ops, device, global_ball):
    params, _, grads = make_group([(70_001,), (9,)], torch.float32, momentum=False, grads=True, seed=13, device=device)
    grads[0][20_000] = float("inf")
    expected, got = run_both(fgfw_ops, params, [], grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)
    grads[0][50_001] = float("nan")
    grads[0][60_000] = float("nan")
    expected, got = run_both(fgfw_ops, params, [], grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT)


# ---- Row balls (L1Ball scope="row", the op's row_numel) ----------------------------------------------
# Balls of at most WARP_BALL elements (rows, and whole tensors that small) take the rows kernel, one
# warp per ball; longer ones take the chunks kernel and the finalize, a long row being a ball of its own.
# Radii that differ between the rows of a tensor are uploaded once and found again by their contents.

WARP_BALL = 4096  # kMaxWarpBall in csrc/cuda/l1_fw_step.cu


def num_row_balls(shapes, row_numel):
    return sum(1 if n == 0 else math.prod(s) // n for s, n in zip(shapes, row_numel))


@pytest.mark.parametrize("grads", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_row_balls_match_reference(fgfw_ops, device, dtype, distribution, momentum, grads):
    check_row_balls(fgfw_ops, device, dtype, distribution, momentum, grads)


def random_row_layout(rng, count):
    """count tensors: matrices with one ball per row, 3-D tensors with rows of two slices, whole tensors."""
    shapes, row_numel = [], []
    for _ in range(count):
        rows, width, kind = rng.randint(1, 4), rng.randint(1, 40), rng.random()
        if kind < 0.6:
            shapes.append((rows, width))
            row_numel.append(width)
        elif kind < 0.8:
            shapes.append((rows, 2, width))
            row_numel.append(2 * width)
        else:
            shapes.append((rows * width,))
            row_numel.append(0)
    return shapes, row_numel


@pytest.mark.timeout(300)  # thousands of reference balls one by one: 52 s on an H200 beside other tests
@pytest.mark.parametrize("per_row_radii", [False, True])
def test_many_row_balls_over_several_rows_launches(fgfw_ops, device, per_row_radii):
    # 600 tensors (about 1,300 balls) fill three tables of the rows kernel; tensors 100 and 400 have
    # balls longer than a warp's and take the chunks path in between. Streams start at every phase.
    rng = random.Random(3)
    shapes, row_numel = random_row_layout(rng, 600)
    shapes[100], row_numel[100] = (3, WARP_BALL + 3), WARP_BALL + 3
    shapes[400], row_numel[400] = (WARP_BALL + 1,), 0
    balls = num_row_balls(shapes, row_numel)
    radii = row_radii(shapes, row_numel) if per_row_radii else [1.5] * balls
    params, moms, grads = make_group(shapes, torch.float32, momentum=True, grads=True, seed=21, device=device)
    expected, got = run_both(fgfw_ops, params, moms, grads, radii=radii, offsets=[], row_numel=row_numel)
    assert_same_step(expected, got, EXACT, gap_rtol=1e-12)
    params, moms, _ = make_group(shapes, torch.bfloat16, momentum=False, grads=False, seed=22, device=device)
    expected, got = run_both(fgfw_ops, params, moms, [], radii=radii, distribution=RADEMACHER, row_numel=row_numel)
    assert_same_step(expected, got, EXACT, gap_rtol=1e-12)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_row_balls_at_the_warp_ball_limit(fgfw_ops, device, dtype, distribution):
    # rows and whole tensors of WARP_BALL elements take the rows kernel, one more element the chunks
    # path; every tensor's stream starts at another phase of a Philox call, so rows start mid-call
    shapes = [(3, WARP_BALL), (2, WARP_BALL + 1), (WARP_BALL,), (WARP_BALL + 1,), (5, 7)]
    row_numel = [WARP_BALL, WARP_BALL + 1, 0, 0, 7]
    offsets = [1, 3 * WARP_BALL + 6, 5 * WARP_BALL + 11, 6 * WARP_BALL + 13, 8 * WARP_BALL]
    params, moms, _ = make_group(shapes, dtype, momentum=True, grads=False, seed=23, device=device)
    expected, got = run_both(fgfw_ops, params, moms, [], coeffs=(0.6, -0.4), radii=row_radii(shapes, row_numel),
                             offsets=offsets, distribution=distribution, row_numel=row_numel)
    if distribution == RADEMACHER:
        assert_same_step(expected, got, EXACT, gap_rtol=1e-12)
    else:
        assert_same_step(expected, got, GAUSSIAN_TOL, gap_rtol=1e-5)


@pytest.mark.timeout(300)  # the reference's 3,075 balls one by one: over 60 s on an H200 beside other tests
def test_mlp_rows_match_reference(fgfw_ops, device):
    # three layers of the 12 x 1024 benchmark MLP: 3,075 balls of 1,024 elements, all on the rows kernel
    shapes = [s for _ in range(3) for s in ((1024, 1024), (1024,))]
    row_numel = [1024, 0] * 3
    params, moms, _ = make_group(shapes, torch.float32, momentum=True, grads=False, seed=24, device=device)
    offsets = flat_offsets(params)
    for distribution, tol, gap_rtol in ((RADEMACHER, EXACT, 1e-12), (GAUSSIAN, GAUSSIAN_TOL, 1e-5)):
        expected, got = run_both(fgfw_ops, params, moms, [], coeffs=(0.9,), radii=[1.0] * 3075, offsets=offsets,
                                 distribution=distribution, row_numel=row_numel)
        assert_same_step(expected, got, tol, gap_rtol=gap_rtol)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_balls_on_unaligned_views(fgfw_ops, device, dtype, distribution):
    # params and momentum are views at an odd element shift, grads at another: rows take the scalar
    # path, with streams starting at every phase
    shapes, row_numel = [(9, 33), (4, 100), (2, 5000), (70,)], [33, 100, 5000, 0]
    cdt = ref.compute_dtype(dtype)
    gen = torch.Generator().manual_seed(25)

    def views(out_dtype, shift, scale=1.0):
        out = []
        for s in shapes:
            n = math.prod(s)
            buffer = (scale * torch.randn(n + shift, generator=gen, dtype=torch.float64)).to(out_dtype).to(device)
            out.append(buffer[shift:].view(s))
        return out

    params, moms, grads = views(dtype, 1, scale=0.1), views(cdt, 1), views(dtype, 3)
    radii = row_radii(shapes, row_numel)
    offsets = [3, 400, 1001, 11_002]
    expected, got = run_both(fgfw_ops, params, moms, [], coeffs=(0.5, 0.25), radii=radii, offsets=offsets,
                             distribution=distribution, row_numel=row_numel)
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(expected, got, tol, gap_rtol=1e-12 if distribution == RADEMACHER else 1e-5)
    expected, got = run_both(fgfw_ops, params, moms, grads, radii=radii, offsets=[], row_numel=row_numel)
    assert_same_step(expected, got, EXACT, gap_rtol=1e-12)


def test_row_balls_tie_lowest_index_of_each_row(fgfw_ops, device):
    # ties within rows of 4 (one lane), and in rows of 300 between lanes: element 130 (lane 0) and 5
    # (lane 1) tie in row 0, elements 37 and 290 in row 1; the lowest index wins each time
    params = [torch.full((3, 4), 0.01, device=device), torch.zeros(2, 300, device=device)]
    wide = torch.zeros(2, 300)
    wide[0, 130], wide[0, 5], wide[0, 7] = 1.0, -1.0, 0.5
    wide[1, 290], wide[1, 37], wide[1, 36] = 2.0, 2.0, -1.0
    grads = [torch.tensor([[1.0, -1.0, 1.0, 1.0], [-2.0, 2.0, 2.0, -2.0], [0.5, 0.5, -0.5, 0.5]]), wide]
    expected, got = run_both(fgfw_ops, params, [], [g.to(device) for g in grads], schedule=(1, 0.5, 1.0),
                             radii=[1.0, 2.0, 3.0, 4.0, 5.0], offsets=[], row_numel=[4, 300])
    assert_same_step(expected, got, EXACT)
    assert got[0][0][:, 0].tolist() == pytest.approx([0.005 - 0.5, 0.005 + 1.0, 0.005 - 1.5], rel=1e-6)
    # the winners move to alpha (-r sign d), exactly: r = 4 and 5 for the two rows of the second tensor
    theta = got[0][1].cpu()
    assert theta[0].nonzero().flatten().tolist() == [5] and theta[0, 5] == 0.5 * 4.0
    assert theta[1].nonzero().flatten().tolist() == [37] and theta[1, 37] == 0.5 * -5.0


@pytest.mark.parametrize("momentum", [False, True])
def test_rademacher_rows_everywhere_tied_pick_each_rows_first_element(fgfw_ops, device, momentum):
    # |d| = |c gamma| everywhere: ties between the lanes of a warp, and between the chunks of long rows
    shapes, row_numel = [(40, 7), (3, 1000), (2, 9000), (33,)], [7, 1000, 9000, 0]
    params = [torch.zeros(s, device=device) for s in shapes]
    moms = [torch.zeros(s, device=device) for s in shapes] if momentum else []
    balls = num_row_balls(shapes, row_numel)
    expected, got = run_both(fgfw_ops, params, moms, [], schedule=(3, 1.0, 0.5), coeffs=(0.5,), radii=[1.0] * balls,
                             distribution=RADEMACHER, row_numel=row_numel)
    assert_same_step(expected, got, EXACT)
    for p, n in zip(got[0], row_numel):
        rows = p.reshape(-1, n if n else p.numel())
        assert (rows[:, 0] != 0).all() and rows[:, 1:].count_nonzero() == 0


def test_nan_and_inf_in_rows_match_reference(fgfw_ops, device):
    # NaN is the largest |d| of its row and has sign 0: that row is only scaled, the gap is NaN;
    # an inf wins its row; the other rows are untouched by either
    params, _, grads = make_group([(4, 50), (2, 5000), (9,)], torch.float32, momentum=False, grads=True, seed=26,
                                   device=device)
    grads[0][1, 10] = grads[0][1, 40] = float("nan")
    grads[0][2, 3] = float("inf")
    grads[1][0, 4500] = float("nan")
    expected, got = run_both(fgfw_ops, params, [], grads, radii=[1.0 + b for b in range(7)], offsets=[],
                             row_numel=[50, 5000, 0])
    assert_same_step(expected, got, EXACT)
    assert torch.isnan(got[2])
    params, _, grads = make_group([(4, 50)], torch.float32, momentum=False, grads=True, seed=27, device=device)
    grads[0][2, 3] = float("-inf")
    expected, got = run_both(fgfw_ops, params, [], grads, radii=[1.0, 2.0, 3.0, 4.0], offsets=[], row_numel=[50])
    assert_same_step(expected, got, EXACT)
    assert torch.isinf(got[2])


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_row_balls_cuda_equals_cpu_kernel(cuda_ops, dtype, distribution):
    shapes, row_numel = [(64, 33), (50_001,), (3, 10_000), (17,), (2, 3, 5)], [33, 0, 10_000, 0, 15]
    params, moms, _ = make_group(shapes, dtype, momentum=True, grads=False, seed=28, device="cpu")
    kwargs = dict(schedule=(12, 0.05, 0.2), coeffs=(0.8, 0.3), radii=row_radii(shapes, row_numel), global_ball=False,
                  offsets=[6, 2_200, 60_000, 90_003, 90_021], seed=-11, distribution=distribution,
                  row_numel=row_numel)
    on_cpu = run_step(cuda_ops.l1_fw_step_, params, moms, [], **kwargs)
    on_cuda = run_step(cuda_ops.l1_fw_step_, [p.to(CUDA) for p in params], [m.to(CUDA) for m in moms], [], **kwargs)
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(on_cpu, on_cuda, tol, gap_rtol=1e-12 if distribution == RADEMACHER else 1e-5)


def test_row_radii_are_found_again_by_their_contents(fgfw_ops, device):
    # twelve different radii arrays (more than the cache keeps per device), then the first ones
    # again: every step uses its own radii, whatever was uploaded before
    shapes, row_numel = [(30, 20), (20,), (5, 9)], [20, 0, 9]
    balls = num_row_balls(shapes, row_numel)
    params, moms, grads = make_group(shapes, torch.float32, momentum=True, grads=True, seed=29, device=device)
    for k in list(range(12)) + [0, 1, 11]:
        radii = [0.5 + 0.1 * k + 0.01 * b for b in range(balls)]
        expected, got = run_both(fgfw_ops, params, moms, grads, radii=radii, offsets=[], row_numel=row_numel)
        assert_same_step(expected, got, EXACT, gap_rtol=1e-12)


def test_row_radii_uploaded_on_one_stream_are_waited_for_on_another(cuda_ops):
    # Stream a uploads a radii array behind 0.1 s of spinning; stream b, not ordered after a, steps with the
    # same radii at once and finds the array in the cache: it must wait for the upload, not read the array
    # before it lands (the cache records an event after each upload).
    shapes, row_numel = [(30, 20), (20,), (5, 9)], [20, 0, 9]
    radii = [0.731 + 0.013 * b for b in range(num_row_balls(shapes, row_numel))]  # uploaded by no other test
    params, moms, grads = make_group(shapes, torch.float32, momentum=True, grads=True, seed=31, device=CUDA)
    kwargs = dict(schedule=(7, 0.1, 0.3), coeffs=(0.7,), radii=radii, global_ball=False, offsets=[], seed=5,
                  distribution=GAUSSIAN, row_numel=row_numel)
    expected = run_step(ref.l1_fw_step_, params, moms, grads, **kwargs)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(200_000_000)
        run_step(cuda_ops.l1_fw_step_, params, moms, grads, **kwargs)
    with torch.cuda.stream(b):
        got = run_step(cuda_ops.l1_fw_step_, params, moms, grads, **kwargs)
    torch.cuda.synchronize()
    assert_same_step(expected, got, EXACT, gap_rtol=1e-12)


ROW_GRAPH_LAYOUTS = {
    # rows kernel and the one-block gap sum only
    "short": ([(48, 32), (48,), (10, 48), (10,), (3, 5, 7)], [32, 0, 48, 0, 35]),
    # chunks kernel, rows kernel and the finalize
    "mixed": ([(48, 32), (48,), (5, 6000), (10, 48), (10_000,)], [32, 0, 6000, 48, 0]),
}


@pytest.mark.parametrize("per_row_radii", [False, True])
@pytest.mark.parametrize("layout", sorted(ROW_GRAPH_LAYOUTS))
def test_row_ball_graph_replay_equals_eager(cuda_ops, layout, per_row_radii):
    shapes, row_numel = ROW_GRAPH_LAYOUTS[layout]
    params, moms, _ = make_group(shapes, torch.float32, momentum=True, grads=False, seed=30, device=CUDA)
    offsets = flat_offsets(params)
    balls = num_row_balls(shapes, row_numel)
    # per-row radii that no other test uses: the warm-up step is the one that uploads them
    radii = [0.75 + 0.125 * b + 0.5 * (b % 3) for b in range(balls)] if per_row_radii else [2.5] * balls
    schedules = [(k, 2.0 / (k + 2), min(1.0, 4.0 / (k + 3))) for k in range(1, 5)]
    coeff_values = [(0.3, -0.1), (-1.2, 0.4), (0.05, 0.9), (2.0, -2.0)]

    def step(p, m, schedule, coeffs, gap, step_radii=radii):
        cuda_ops.l1_fw_step_(p, m, [], schedule, coeffs, step_radii, False, offsets, 3, GAUSSIAN, gap, row_numel)

    graph_p, graph_m = [x.clone() for x in params], [x.clone() for x in moms]
    schedule = torch.zeros(3, dtype=torch.float64, device=CUDA)
    coeffs = torch.zeros(2, dtype=torch.float64, device=CUDA)
    gap = torch.empty((), dtype=torch.float64, device=CUDA)
    warm_p, warm_m = [x.clone() for x in params], [x.clone() for x in moms]  # warm-up must not touch graph_p
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(warm_p, warm_m, schedule, coeffs, gap)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_p, graph_m, schedule, coeffs, gap)

    # other radii uploaded after the capture (more than the cache keeps) must not evict the graph's
    scratch_p, scratch_m = [x.clone() for x in params], [x.clone() for x in moms]
    scratch_gap = torch.empty((), dtype=torch.float64, device=CUDA)
    for k in range(10):
        step(scratch_p, scratch_m, schedule, coeffs, scratch_gap, step_radii=[r + 0.001 * (k + 1) for r in radii])
    torch.cuda.synchronize()

    eager_p, eager_m = [x.clone() for x in params], [x.clone() for x in moms]
    eager_gaps = []
    for values, c in zip(schedules, coeff_values):
        eager_gap = torch.empty((), dtype=torch.float64, device=CUDA)
        step(eager_p, eager_m, torch.tensor(values, dtype=torch.float64, device=CUDA),
             torch.tensor(c, dtype=torch.float64, device=CUDA), eager_gap)
        eager_gaps.append(eager_gap)
    for k, (values, c) in enumerate(zip(schedules, coeff_values)):
        schedule.copy_(torch.tensor(values, dtype=torch.float64))
        coeffs.copy_(torch.tensor(c, dtype=torch.float64))
        graph.replay()
        assert gap.item() == eager_gaps[k].item()
    assert_same_step((eager_p, eager_m, eager_gaps[-1]), (graph_p, graph_m, gap), EXACT, gap_rtol=0)


@pytest.mark.parametrize("grads", [False, True])
@pytest.mark.parametrize("per_row_radii", [False, True])
@pytest.mark.parametrize("layout", sorted(ROW_GRAPH_LAYOUTS))
def test_row_ball_step_never_synchronises(cuda_ops, layout, per_row_radii, grads):
    shapes, row_numel = ROW_GRAPH_LAYOUTS[layout]
    params, moms, grad_list = make_group(shapes, torch.bfloat16, momentum=True, grads=grads, seed=31, device=CUDA)
    schedule = torch.tensor([3.0, 0.1, 0.5], dtype=torch.float64, device=CUDA)
    coeffs = torch.tensor([0.5, 0.25], dtype=torch.float64, device=CUDA)
    gap = torch.empty((), dtype=torch.float64, device=CUDA)
    balls = num_row_balls(shapes, row_numel)
    radii = [1.0 + 0.0625 * b for b in range(balls)] if per_row_radii else [1.0] * balls

    def step():
        cuda_ops.l1_fw_step_(params, moms, grad_list, schedule, coeffs, radii, False, flat_offsets(params), 1,
                             GAUSSIAN, gap, row_numel)

    step()  # warm-up: uploads per-row radii
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
