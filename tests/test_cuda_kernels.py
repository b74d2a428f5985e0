"""The compiled CUDA l1_fw_step_ against fgfw.reference.l1_fw_step_ (and the CPU kernel) on identical inputs.

The kernel rounds every operation as the reference does, so wherever no transcendental function is
involved (backprop gradients, Rademacher tangents) parameters and momentum must agree bit for bit;
Gaussian tangents use the GPU's log/sin/cos and are compared with a tolerance. The gap is a float64
sum in another order, hence a relative tolerance. Skips without a GPU or without the CUDA kernels.
"""
import random

import pytest
import torch

from fgfw import reference as ref

import kernel_cases
from kernel_cases import (EXACT, GAUSSIAN, GAUSSIAN_TOL, PARAM_DTYPES, RADEMACHER, assert_same_step,
                          check_backprop_gradient, check_forward_gradient, flat_offsets, run_both, run_step)

CUDA = "cuda"


def make_group(shapes, dtype, *, device=CUDA, **kwargs):
    return kernel_cases.make_group(shapes, dtype, device=device, **kwargs)


@pytest.fixture(scope="session")
def cuda_ops(fgfw_cuda_ops):
    """torch.ops.fgfw with a CUDA l1_fw_step_; skips where the extension was built without it."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::l1_fw_step_", "CUDA"):
        pytest.skip("fgfw._C has no CUDA l1_fw_step_ (built without csrc/cuda/fw_step.cu)")
    return fgfw_cuda_ops


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
def test_forward_gradient_matches_reference(cuda_ops, dtype, distribution, coeffs, momentum, global_ball):
    check_forward_gradient(cuda_ops, CUDA, dtype, distribution, coeffs, momentum, global_ball)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_backprop_gradient_matches_reference(cuda_ops, dtype, momentum, global_ball):
    check_backprop_gradient(cuda_ops, CUDA, dtype, momentum, global_ball)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
@pytest.mark.parametrize("numel", [1, 7, 4096, 1_000_003])
def test_sizes_match_reference(cuda_ops, numel, dtype, distribution, global_ball):
    # a second tensor whose stream starts mid-call (offset % 4 == numel % 4) follows the first
    params, moms, _ = make_group([(numel,), (37,)], dtype, momentum=True, grads=False, seed=numel)
    expected, got = run_both(cuda_ops, params, moms, [], coeffs=(0.9, -0.2), global_ball=global_ball,
                             distribution=distribution)
    if distribution == RADEMACHER:
        assert_same_step(expected, got, EXACT, gap_rtol=1e-7)
    else:
        assert_same_step(expected, got, GAUSSIAN_TOL, gap_rtol=1e-5)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_realistic_model_shapes(cuda_ops, distribution, global_ball):
    params, moms, _ = make_group(realistic_shapes(), torch.float32, momentum=True, grads=False, seed=4)
    expected, got = run_both(cuda_ops, params, moms, [], coeffs=(1.1, -0.4), global_ball=global_ball,
                             distribution=distribution)
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(expected, got, tol, gap_rtol=1e-7 if distribution == RADEMACHER else 1e-5)


@pytest.mark.parametrize("global_ball", [False, True])
def test_more_tensors_than_one_launch_holds(cuda_ops, global_ball):
    # 600 tensors take three chunk launches (256 rows each) and one finalize
    rng = random.Random(1)
    shapes = [(rng.randint(1, 300),) for _ in range(600)]
    params, moms, grads = make_group(shapes, torch.float32, momentum=True, grads=True, seed=5)
    expected, got = run_both(cuda_ops, params, moms, grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)
    params, moms, _ = make_group(shapes, torch.bfloat16, momentum=False, grads=False, seed=6)
    expected, got = run_both(cuda_ops, params, moms, [], global_ball=global_ball, distribution=RADEMACHER)
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)


def test_one_huge_tensor(cuda_ops):
    params, moms, _ = make_group([(2**26 + 5,)], torch.float32, momentum=True, grads=False, seed=7)
    expected, got = run_both(cuda_ops, params, moms, [], coeffs=(0.3,), distribution=RADEMACHER, offsets=[2])
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", PARAM_DTYPES)
def test_unaligned_views_and_stream_offsets(cuda_ops, dtype, distribution):
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
        buffer = (scale * buffer).to(out_dtype).to(CUDA)
        out, start = [], shift
        for s in sizes:
            out.append(buffer[start:start + s])
            start += s + 1
        return out

    params = views(buffers[0], dtype, 1, scale=0.1)
    moms = views(buffers[1], cdt, 1)
    offsets = [1, 5002, 10_003, 20_000, 31_001]
    expected, got = run_both(cuda_ops, params, moms, [], coeffs=(0.5, 0.25), offsets=offsets,
                             distribution=distribution)
    tol = EXACT if distribution == RADEMACHER else GAUSSIAN_TOL
    assert_same_step(expected, got, tol, gap_rtol=1e-7 if distribution == RADEMACHER else 1e-5)
    grads = views(buffers[2], dtype, 3)
    expected, got = run_both(cuda_ops, params, moms, grads, offsets=offsets)
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)


def test_ties_lowest_index_wins_per_tensor(cuda_ops):
    params = [torch.full((6,), 0.5, device=CUDA), torch.full((4,), -0.25, device=CUDA)]
    grads = [torch.tensor([0.1, -0.5, 0.2, 0.5, -0.5, 0.0], device=CUDA),
             torch.tensor([0.0, 0.3, -0.3, 0.3], device=CUDA)]
    expected, got = run_both(cuda_ops, params, [], grads, schedule=(1, 0.5, 1.0), radii=[1.0, 2.0], offsets=[])
    assert_same_step(expected, got, EXACT)
    theta = [p.cpu() for p in got[0]]
    assert torch.equal(theta[0], torch.tensor([0.25, 0.25 + 0.5, 0.25, 0.25, 0.25, 0.25]))
    assert torch.equal(theta[1], torch.tensor([-0.125, -0.125 - 1.0, -0.125, -0.125]))


def test_ties_across_tensors_first_tensor_wins_in_global_ball(cuda_ops):
    params = [torch.zeros(3, device=CUDA), torch.zeros(2, 2, device=CUDA), torch.zeros(3, device=CUDA)]
    grads = [torch.tensor([0.1, 0.2, 0.5]), torch.tensor([[-0.5, 0.5], [0.0, 0.5]]), torch.tensor([0.5, 0.0, 0.0])]
    expected, got = run_both(cuda_ops, params, [], [g.to(CUDA) for g in grads], schedule=(1, 1.0, 1.0),
                             global_ball=True, radii=[3.0], offsets=[])
    assert_same_step(expected, got, EXACT)
    theta = [p.cpu() for p in got[0]]
    assert torch.equal(theta[0], torch.tensor([0.0, 0.0, -3.0]))
    assert not theta[1].any() and not theta[2].any()


@pytest.mark.parametrize("global_ball", [False, True])
def test_rademacher_everywhere_tied_picks_first_element(cuda_ops, global_ball):
    # |d| = |c| everywhere: ties between threads, blocks, chunks, tensors and launches
    params = [torch.zeros(3_000_001, device=CUDA), torch.zeros(17, device=CUDA)] + \
             [torch.zeros(5, device=CUDA) for _ in range(300)]
    radii = [1.0] if global_ball else [1.0] * len(params)
    expected, got = run_both(cuda_ops, params, [], [], schedule=(3, 1.0, 1.0), coeffs=(0.5,), radii=radii,
                             global_ball=global_ball, distribution=RADEMACHER)
    assert_same_step(expected, got, EXACT)
    theta = got[0]
    assert theta[0][0] != 0 and theta[0][1:].count_nonzero() == 0
    for p in theta[1:]:
        assert p.count_nonzero() == (0 if global_ball else 1) and (global_ball or p[0] != 0)


def test_nan_direction_matches_reference(cuda_ops):
    # NaN is the largest |d| (torch.argmax's rule) and has sign 0 (torch.sign's): theta is only scaled
    params = [torch.tensor([0.1, 0.2, 0.3], device=CUDA), torch.tensor([0.4, 0.5], device=CUDA)]
    grads = [torch.tensor([1.0, float("nan"), 2.0], device=CUDA), torch.tensor([float("nan"), 9.0], device=CUDA)]
    for global_ball in (False, True):
        expected, got = run_both(cuda_ops, params, [], grads, global_ball=global_ball, offsets=[])
        assert_same_step(expected, got, EXACT)
        assert torch.isnan(got[2])


def test_single_element_and_empty_tensors(cuda_ops):
    params = [torch.tensor([0.3], device=CUDA), torch.empty(0, device=CUDA), torch.tensor([[-0.2]], device=CUDA)]
    moms = [torch.tensor([0.1], device=CUDA), torch.empty(0, device=CUDA), torch.tensor([[0.0]], device=CUDA)]
    for global_ball in (False, True):
        expected, got = run_both(cuda_ops, params, moms, [], global_ball=global_ball, distribution=RADEMACHER)
        assert_same_step(expected, got, EXACT)
    empty = [torch.empty(0, device=CUDA), torch.empty(0, 3, device=CUDA)]
    for global_ball in (False, True):
        expected, got = run_both(cuda_ops, empty, [], [], global_ball=global_ball)
        assert got[2].item() == 0.0


def test_empty_group_writes_zero_gap(cuda_ops):
    gap = torch.full((), float("nan"), dtype=torch.float64, device=CUDA)
    cuda_ops.l1_fw_step_([], [], [], torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64, device=CUDA),
                         torch.tensor([1.0], dtype=torch.float64, device=CUDA), [], False, [], 0, GAUSSIAN, gap)
    assert gap.item() == 0.0


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
def test_regenerated_tangents_equal_materialised_ones(cuda_ops, dtype, distribution, momentum):
    # The update kernel regenerates u in registers; fill_tangent_ (CUDA) writes it to memory for the
    # JVP. Feeding g = sum_k c_k u_k, built from the materialised u with the kernel's roundings, to
    # the backprop path must give the very same step, bit for bit, Gaussian tangents included.
    shapes = [(10_007,), (33, 3), (2,)]
    params, moms, _ = make_group(shapes, dtype, momentum=momentum, grads=False, seed=10)
    offsets, seed, step, coeffs = [3, 10_011, 20_000], 77, 5, (0.6, -1.7)
    cdt = ref.compute_dtype(dtype)
    grads = []
    for p, offset in zip(params, offsets):
        g = None
        for k, c in enumerate(coeffs):
            u = torch.empty(p.shape, dtype=torch.float32, device=CUDA)
            cuda_ops.fill_tangent_(u, seed, step, k, offset, distribution)
            term = torch.tensor(c, dtype=torch.float64).to(cdt).to(CUDA) * u.to(cdt)
            g = term if g is None else g + term
        grads.append(g.to(dtype))
    kwargs = dict(schedule=(step, 0.1, 0.4), coeffs=coeffs, radii=[1.0, 2.0, 3.0], global_ball=False, offsets=offsets,
                  seed=seed, distribution=distribution)
    regenerated = run_step(cuda_ops.l1_fw_step_, params, moms, [], **kwargs)
    materialised = run_step(cuda_ops.l1_fw_step_, params, moms, grads, **kwargs)
    assert_same_step(materialised, regenerated, EXACT, gap_rtol=0)
    assert_same_step(run_step(ref.l1_fw_step_, params, moms, grads, **kwargs), regenerated, EXACT)


@pytest.mark.parametrize("global_ball", [False, True])
def test_cuda_graph_replay_equals_eager(cuda_ops, global_ball):
    params, moms, _ = make_group(realistic_shapes(width=32, layers=4), torch.float32, momentum=True, grads=False,
                                 seed=11)
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
                                         grads=grads, seed=12)
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


def test_bad_arguments_are_named(cuda_ops):
    params = [torch.zeros(4, device=CUDA)]
    schedule = torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64, device=CUDA)
    coeffs = torch.ones(1, dtype=torch.float64, device=CUDA)
    gap = torch.zeros((), dtype=torch.float64, device=CUDA)
    with pytest.raises(RuntimeError, match=r"radii\[0\]"):
        cuda_ops.l1_fw_step_(params, [], [], schedule, coeffs, [0.0], False, [0], 0, GAUSSIAN, gap)
    with pytest.raises(RuntimeError, match=r"momentum\[0\]"):
        cuda_ops.l1_fw_step_(params, [torch.zeros(4)], [], schedule, coeffs, [1.0], False, [0], 0, GAUSSIAN, gap)
    with pytest.raises(RuntimeError, match="schedule"):
        cuda_ops.l1_fw_step_(params, [], [], schedule.cpu(), coeffs, [1.0], False, [0], 0, GAUSSIAN, gap)


@pytest.mark.parametrize("global_ball", [False, True])
def test_inf_and_nan_far_into_a_large_tensor(cuda_ops, global_ball):
    params, _, grads = make_group([(70_001,), (9,)], torch.float32, momentum=False, grads=True, seed=13)
    grads[0][20_000] = float("inf")
    expected, got = run_both(cuda_ops, params, [], grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT, gap_rtol=1e-7)
    grads[0][50_001] = float("nan")
    grads[0][60_000] = float("nan")
    expected, got = run_both(cuda_ops, params, [], grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT)
