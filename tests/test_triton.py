"""The Triton backend (fgfw.triton) against the spec, fgfw.reference, on the same inputs.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; with one, the same tests run
compiled on CUDA tensors. Sizes are small because the interpreter is slow.
"""
import math
import os

import pytest
import torch

# Triton chooses between compiling and interpreting a kernel when the kernel is defined, i.e. when
# fgfw.triton is imported, so the variable must be set before that import. It is set only without a
# GPU (with one, the tests should exercise the compiled kernels) and stays set for the rest of the
# session, which other modules that import Triton kernels later need on this machine too. If some
# earlier module already imported fgfw.triton without it, is_available() is False and this module skips.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fgfw import reference  # noqa: E402
from fgfw import triton as fgfw_triton  # noqa: E402
from fgfw.triton import l1_fw_step, tangent  # noqa: E402
from fgfw.triton.tangent import _philox4x32_10  # noqa: E402

if not fgfw_triton.is_available():
    pytest.skip("Triton kernels cannot run here: no CUDA device, and fgfw.triton was imported before "
                "TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GAUSSIAN, RADEMACHER = reference.GAUSSIAN, reference.RADEMACHER
# Gaussian tangents go through log/sqrt/sin/cos, whose last bits differ between torch, numpy (the
# interpreter) and libdevice; everything else is plain IEEE arithmetic done in the reference's order.
GAUSSIAN_TOL = dict(rtol=1e-5, atol=1e-5)
# A Gaussian tangent value: each side is within about 2.5 float32 ulps of the exact r cos(angle) (<= 1-ulp
# log and cos/sin, correctly rounded sqrt and product), so within 5 of each other (4 measured, on 1e6
# interpreted values); near a zero of cos or sin the error is the angle's, absolute: the ulps are taken at
# |u| >= 2^-4. (tests/test_properties.py checks the same bound on random layouts, seeds and offsets.)
TANGENT_ULPS, TANGENT_ULP_FLOOR = 8, 2.0**-4


def _ulp(x, dtype):
    """The ulp of ``dtype`` at |x| (float64; the subnormal spacing below the normal range)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.double().abs())
    binade = torch.clamp(exponent - 1, min=round(math.log2(info.tiny)))
    return torch.ldexp(torch.full_like(binade, info.eps, dtype=torch.float64), binade)


def _assert_tangent_close(out, u_ref):
    """``out`` (any dtype) holds the float32 Gaussian tangent ``u_ref`` to within TANGENT_ULPS float32 ulps
    (float64 holds a float32 value exactly), plus for float16/bfloat16 one ulp of their own: two float32
    values that close may round to neighbouring values."""
    bound = TANGENT_ULPS * _ulp(torch.clamp(u_ref.double().abs(), min=TANGENT_ULP_FLOOR), torch.float32)
    if out.dtype in (torch.float16, torch.bfloat16):
        bound = bound + _ulp(u_ref, out.dtype)
    error = (out.double() - u_ref.to(out.dtype).double()).abs()
    assert bool((error <= bound).all()), f"max error / bound: {float((error / bound).max())}"


@triton.jit
def _philox_words_kernel(counter, key, out):
    # Two identical lanes: the rounds must work on tensors, not only on scalars.
    lane = tl.arange(0, 2)
    zero = tl.zeros([2], tl.uint32)
    c0 = tl.load(counter).to(tl.uint32, bitcast=True) + zero
    c1 = tl.load(counter + 1).to(tl.uint32, bitcast=True) + zero
    c2 = tl.load(counter + 2).to(tl.uint32, bitcast=True) + zero
    c3 = tl.load(counter + 3).to(tl.uint32, bitcast=True) + zero
    w0, w1, w2, w3 = _philox4x32_10(c0, c1, c2, c3, tl.load(key).to(tl.uint32, bitcast=True),
                                    tl.load(key + 1).to(tl.uint32, bitcast=True))
    tl.store(out + 4 * lane, w0.to(tl.int32, bitcast=True))
    tl.store(out + 4 * lane + 1, w1.to(tl.int32, bitcast=True))
    tl.store(out + 4 * lane + 2, w2.to(tl.int32, bitcast=True))
    tl.store(out + 4 * lane + 3, w3.to(tl.int32, bitcast=True))


@pytest.mark.parametrize("counter, key, expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    """The Triton rounds give Random123's Philox4x32-10 words."""
    as_i32 = lambda words: torch.tensor([tangent.as_int32(w) for w in words], dtype=torch.int32, device=DEVICE)
    out = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    _philox_words_kernel[(1,)](as_i32(counter), as_i32(key), out)
    assert [w & 0xFFFFFFFF for w in out.tolist()] == list(expected) * 2


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("numel, offset", [(1, 0), (7, 3), (4097, 0), (4097, 5), (33, (1 << 34) + 2)])
def test_fill_tangent_matches_reference(distribution, numel, offset):
    seed, step, tangent_id = -123456789, (1 << 31) + 5, 3  # negative seed, step above int32
    out = torch.full((numel,), float("nan"), device=DEVICE)
    fgfw_triton.fill_tangent_(out, seed, step, tangent_id, offset, distribution)
    expected = reference.tangent(numel, seed, step, tangent_id, offset, distribution, device=DEVICE)
    if distribution == RADEMACHER:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, **GAUSSIAN_TOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_fill_tangent_other_dtypes_and_layouts(dtype):
    """Values are the float32 tangent rounded to out's dtype; a non-contiguous out is filled in flat order."""
    out = torch.empty(9, 5, dtype=dtype, device=DEVICE).t()
    fgfw_triton.fill_tangent_(out, 7, 2, 1, 6, RADEMACHER)
    expected = torch.empty_like(out)
    reference.fill_tangent_(expected, 7, 2, 1, 6, RADEMACHER)
    assert torch.equal(out, expected)
    out = torch.empty(45, dtype=dtype, device=DEVICE)
    fgfw_triton.fill_tangent_(out, 7, 2, 1, 6, GAUSSIAN)
    _assert_tangent_close(out, reference.tangent(45, 7, 2, 1, 6, GAUSSIAN, device=DEVICE))


def test_fill_tangent_rejects_bad_distribution():
    with pytest.raises(ValueError, match="distribution"):
        fgfw_triton.fill_tangent_(torch.empty(3, device=DEVICE), 0, 0, 0, 0, 2)


# ---------------------------------------------------------------------------------------------------
# l1_fw_step_


def _make_step_inputs(sizes, dtype, *, momentum, grads, n_tangents=1, offsets=None, step=3, alpha=0.25,
                      gamma=0.4, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    rand = lambda n, dt: torch.randn(n, generator=gen, dtype=torch.float64).to(dt).to(DEVICE)
    compute = reference.compute_dtype(dtype)
    if offsets is None:  # consecutive, as an optimizer lays out its group: most not multiples of 4
        offsets = [sum(sizes[:t]) + 1 for t in range(len(sizes))]
    return dict(
        params=[rand(n, dtype) for n in sizes],
        momentum=[rand(n, compute) for n in sizes] if momentum else [],
        grads=[rand(n, dtype) for n in sizes] if grads else [],
        schedule=torch.tensor([step, alpha, gamma], dtype=torch.float64, device=DEVICE),
        tangent_coeffs=torch.randn(n_tangents, generator=gen, dtype=torch.float64).to(DEVICE),
        offsets=offsets)


def _run_both(inputs, radii, global_ball, distribution=RADEMACHER, seed=2024):
    """Runs reference and Triton on copies of ``inputs``; returns both (params, momentum, gap)."""
    results = []
    for step_fn in (reference.l1_fw_step_, fgfw_triton.l1_fw_step_):
        params = [p.clone() for p in inputs["params"]]
        momentum = [v.clone() for v in inputs["momentum"]]
        gap = torch.full((), float("nan"), dtype=torch.float64, device=DEVICE)
        # the global ball takes one radius, as every backend's checks require
        step_fn(params, momentum, inputs["grads"], inputs["schedule"], inputs["tangent_coeffs"],
                radii[:1] if global_ball else radii, global_ball, inputs["offsets"], seed, distribution, gap)
        results.append((params, momentum, gap))
    return results


def _assert_same_step(ref, got, exact):
    (ref_params, ref_momentum, ref_gap), (params, momentum, gap) = ref, got
    # Parameters bit for bit in every dtype, Gaussian tangents included: a step sees the direction d only
    # through its argmax and sign (theta <- keep theta rounded to its dtype, then the vertex element from
    # -r sign d_i* and the ball's norm sums, rounded again), so an ulp of d changes no bit of theta unless it moves the
    # argmax, and that is a step to another vertex, which no tolerance would absorb.
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, equal_nan=True, rtol=0, atol=0)
    for v, w in zip(momentum, ref_momentum):
        torch.testing.assert_close(v, w, equal_nan=True, **(dict(rtol=0, atol=0) if exact else GAUSSIAN_TOL))
    # block partial sums are added in another order than the reference's
    torch.testing.assert_close(gap, ref_gap, rtol=1e-10 if exact else 1e-5, atol=1e-10, equal_nan=True)


def _scaled(p0, alpha):
    """p0 as every element not moved to a vertex ends a step: keep p0 (reference.step_factors), rounded."""
    cdt = reference.compute_dtype(p0.dtype)
    keep, _ = reference.step_factors(alpha, cdt)
    return (keep * p0.to(cdt)).to(p0.dtype)


def _moved(p, p0, alpha):
    """Where the step moved p0 towards a vertex: beyond the scaling, and beyond the few ulps of rounding that the
    vertex element takes back when its sign(d) is 0 (reference.l1_vertex_value)."""
    scaled = _scaled(p0, alpha)
    return ~torch.isclose(p.double(), scaled.double(), rtol=1e-5, atol=1e-6, equal_nan=True)


def _assert_vertex_moved(ref_params, inputs):
    """Guards the other tests against vacuous passes: the reference's step did touch a vertex."""
    alpha = float(inputs["schedule"][1])
    assert any(not torch.equal(p, _scaled(p0, alpha)) for p, p0 in zip(ref_params, inputs["params"]))


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("n_tangents", [1, 2])
@pytest.mark.parametrize("momentum", [False, True])
def test_step_forward_gradient(distribution, n_tangents, momentum):
    """FGFW (no momentum) and AFGFW (momentum): u regenerated in the kernel from (seed, step, k, offset + j)."""
    inputs = _make_step_inputs([5, 2100, 1, 33], torch.float32, momentum=momentum, grads=False,
                               n_tangents=n_tangents, gen_seed=n_tangents)
    ref, got = _run_both(inputs, [1.0, 2.0, 0.5, 3.0], False, distribution)
    _assert_vertex_moved(ref[0], inputs)
    _assert_same_step(ref, got, exact=distribution == RADEMACHER)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_step_forward_gradient_global_ball_aligned_offsets(distribution):
    """Offsets on Philox call boundaries take the aligned, unmasked path for full blocks."""
    inputs = _make_step_inputs([8, 4096, 3], torch.float32, momentum=True, grads=False, n_tangents=2,
                               offsets=[0, 8, 4104])
    ref, got = _run_both(inputs, [2.5], True, distribution)
    _assert_same_step(ref, got, exact=distribution == RADEMACHER)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("global_ball", [False, True])
def test_step_backprop_gradient(dtype, momentum, global_ball):
    """FrankWolfe on given gradients: plain IEEE arithmetic in the reference's order, so bit-exact."""
    inputs = _make_step_inputs([4100, 3, 1], dtype, momentum=momentum, grads=True, gen_seed=7)
    ref, got = _run_both(inputs, [1.5, 0.5, 2.0], global_ball)
    _assert_vertex_moved(ref[0], inputs)
    _assert_same_step(ref, got, exact=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_step_forward_gradient_other_dtypes(dtype):
    inputs = _make_step_inputs([7, 2050], dtype, momentum=True, grads=False, n_tangents=2, gen_seed=3)
    ref, got = _run_both(inputs, [1.0, 4.0], False, GAUSSIAN)
    _assert_same_step(ref, got, exact=False)


def _tie_inputs(values, **kw):
    inputs = _make_step_inputs([len(v) for v in values], torch.float32, momentum=False, grads=True, **kw)
    inputs["grads"] = [torch.tensor(v, dtype=torch.float32, device=DEVICE) for v in values]
    return inputs


@pytest.mark.parametrize("global_ball", [False, True])
def test_step_ties_lowest_index_wins(global_ball):
    """Equal |d| (either sign): the lowest flat index wins; in the global ball the earlier tensor wins."""
    big = [0.0] * 2500
    big[2300], big[100], big[2000] = -3.0, 3.0, 3.0  # across blocks of one tensor: index 100
    inputs = _tie_inputs([[0.0, -3.0, 3.0, 1.0], big, [3.0, -3.0]])
    ref, got = _run_both(inputs, [1.0, 2.0, 3.0], global_ball)
    _assert_same_step(ref, got, exact=True)
    alpha = float(inputs["schedule"][1])
    winners = [torch.nonzero(_moved(p, p0, alpha)).flatten().tolist()
               for p, p0 in zip(got[0], inputs["params"])]
    assert winners == ([[1], [], []] if global_ball else [[1], [100], [0]])


def test_step_tie_across_tensors_prefers_later_larger():
    inputs = _tie_inputs([[2.0, -5.0], [5.0, 0.0], [0.0, -5.5]])
    ref, got = _run_both(inputs, [1.0], True)
    _assert_same_step(ref, got, exact=True)


def test_step_finalize_over_many_chunks(monkeypatch):
    """Balls with more slots than one finalize iteration, and more balls than one gap-sum iteration."""
    monkeypatch.setattr(l1_fw_step, "_RBLOCK", 2)
    values = [[0.0] * 5000 for _ in range(3)]
    values[0][4999], values[1][10], values[1][4500], values[2][4000] = 7.0, -7.0, 7.0, 6.0
    inputs = _tie_inputs(values)
    for global_ball in (False, True):
        ref, got = _run_both(inputs, [1.0, 2.0, 3.0], global_ball)
        _assert_same_step(ref, got, exact=True)


def test_step_single_element_and_zero_direction():
    """A one-element tensor is its own argmax; d = 0 leaves it at keep theta (sign(0) = 0)."""
    inputs = _tie_inputs([[0.0]])
    ref, got = _run_both(inputs, [1.0], False)
    _assert_same_step(ref, got, exact=True)
    inputs = _make_step_inputs([1], torch.float32, momentum=True, grads=False)
    for global_ball in (False, True):
        _assert_same_step(*_run_both(inputs, [1.0], global_ball), exact=True)


def test_step_several_small_tensors_and_an_empty_one():
    sizes = [1, 2, 3, 0, 5, 8, 13]
    inputs = _make_step_inputs(sizes, torch.float32, momentum=True, grads=False, n_tangents=2, gen_seed=11)
    for global_ball in (False, True):
        _assert_same_step(*_run_both(inputs, [0.5 + t for t in range(len(sizes))], global_ball), exact=True)


def test_step_nan_wins_like_torch_argmax():
    """NaN counts as the largest |d| (torch.argmax), above an earlier inf; sign(NaN) = 0, gap NaN."""
    inputs = _tie_inputs([[1.0, float("inf"), 2.0, float("nan"), 1.0]])
    _assert_same_step(*_run_both(inputs, [1.0], False), exact=True)


def test_step_no_params_and_no_elements():
    for params in ([], [torch.empty(0, device=DEVICE)]):
        gap = torch.full((), float("nan"), dtype=torch.float64, device=DEVICE)
        schedule = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64, device=DEVICE)
        fgfw_triton.l1_fw_step_(params, [], [], schedule, torch.ones(1, dtype=torch.float64, device=DEVICE),
                                [1.0] * len(params), False, [0] * len(params), 0, RADEMACHER, gap)
        assert gap.item() == 0.0


def test_step_repeated_steps_track_reference():
    """Three AFGFW steps in a row (the momentum and the table cache carry over) stay on the reference."""
    inputs = _make_step_inputs([6, 2049], torch.float32, momentum=True, grads=False, n_tangents=2)
    states = [([p.clone() for p in inputs["params"]], [v.clone() for v in inputs["momentum"]]) for _ in range(2)]
    for step in range(3):
        schedule = torch.tensor([step, 2 / (step + 2), 1 / (step + 1)], dtype=torch.float64, device=DEVICE)
        gaps = []
        for step_fn, (params, momentum) in zip((reference.l1_fw_step_, fgfw_triton.l1_fw_step_), states):
            gaps.append(torch.zeros((), dtype=torch.float64, device=DEVICE))
            step_fn(params, momentum, [], schedule, inputs["tangent_coeffs"], [1.0, 2.0], False, inputs["offsets"],
                    99, RADEMACHER, gaps[-1])
        torch.testing.assert_close(gaps[1], gaps[0], rtol=1e-10, atol=1e-10)
    for ref, got in zip(states[0], states[1]):
        for a, b in zip(ref, got):
            assert torch.equal(a, b)


def test_step_rejects_mixed_dtypes_wrong_momentum_and_missing_offsets():
    schedule = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64, device=DEVICE)
    coeffs = torch.ones(1, dtype=torch.float64, device=DEVICE)
    gap = torch.zeros((), dtype=torch.float64, device=DEVICE)
    params = [torch.ones(3, device=DEVICE), torch.ones(3, dtype=torch.float64, device=DEVICE)]
    with pytest.raises(ValueError, match=r"params\[1\]"):
        fgfw_triton.l1_fw_step_(params, [], [], schedule, coeffs, [1.0, 1.0], False, [0, 3], 0, GAUSSIAN, gap)
    params = [torch.ones(3, dtype=torch.bfloat16, device=DEVICE)]
    with pytest.raises(TypeError, match="momentum"):
        fgfw_triton.l1_fw_step_(params, [torch.zeros(3, dtype=torch.bfloat16, device=DEVICE)], [], schedule,
                                coeffs, [1.0], False, [0], 0, GAUSSIAN, gap)
    # the forward gradient needs one stream offset per tensor, as in the reference
    with pytest.raises(ValueError, match="offsets"):
        fgfw_triton.l1_fw_step_(params, [], [], schedule, coeffs, [1.0], False, [], 0, GAUSSIAN, gap)


@pytest.mark.parametrize("radius", [0.0, -1.0, float("inf"), float("nan")])
def test_step_rejects_radii_that_are_not_positive_and_finite(radius):
    schedule = torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64, device=DEVICE)
    params = [torch.ones(3, device=DEVICE)]
    gap = torch.zeros((), dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=r"radii\[0\]"):
        fgfw_triton.l1_fw_step_(params, [], [torch.ones(3, device=DEVICE)], schedule,
                                torch.zeros(0, dtype=torch.float64, device=DEVICE), [radius], False, [0], 0, GAUSSIAN,
                                gap)
    assert torch.equal(params[0], torch.ones(3, device=DEVICE))


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_fill_tangent_at_a_step_tensor_equals_the_int_step(distribution):
    # the counter is taken modulo 2^32 like the int step, wherever the kernel reads it
    step = (1 << 33) + 17
    expected = torch.empty(37, device=DEVICE)
    fgfw_triton.fill_tangent_(expected, 9, step, 1, 6, distribution)
    for where in {DEVICE, torch.device("cpu")}:
        out = torch.full((37,), float("nan"), device=DEVICE)
        fgfw_triton.fill_tangent_at_step_(out, 9, torch.tensor(step, device=where), 1, 6, distribution)
        assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------
# l1_fw_step_ with row balls (row_numel, L1Ball(scope="row"))


def _make_shaped_inputs(shapes, dtype, **kw):
    """_make_step_inputs over tensors of the given shapes (the stream layout only sees their numel)."""
    inputs = _make_step_inputs([math.prod(s) for s in shapes], dtype, **kw)
    for key in ("params", "momentum", "grads"):
        inputs[key] = [x.view(s) for x, s in zip(inputs[key], shapes)]
    return inputs


def _row_radii(shapes, row_numel):
    """A different radius for every ball, so that a ball given another's radius shows."""
    count = sum(1 if n == 0 else math.prod(s) // n for s, n in zip(shapes, row_numel))
    return [0.5 + 0.25 * b for b in range(count)]


def _run_both_rows(inputs, radii, row_numel, distribution=RADEMACHER, seed=2024):
    """_run_both with row balls."""
    results = []
    for step_fn in (reference.l1_fw_step_, fgfw_triton.l1_fw_step_):
        params = [p.clone() for p in inputs["params"]]
        momentum = [v.clone() for v in inputs["momentum"]]
        gap = torch.full((), float("nan"), dtype=torch.float64, device=DEVICE)
        step_fn(params, momentum, inputs["grads"], inputs["schedule"], inputs["tangent_coeffs"], radii, False,
                inputs["offsets"], seed, distribution, gap, row_numel)
        results.append((params, momentum, gap))
    return results


def _layout_of(inputs, radii, row_numel):
    """The Triton step's layout of these inputs (which balls take which path)."""
    params, grads = inputs["params"], inputs["grads"]
    streams = (0,) * len(params) if grads else tuple(inputs["offsets"])
    return l1_fw_step._layout(params[0].device, tuple(p.numel() for p in params), tuple(row_numel), streams,
                              l1_fw_step._radii_token(radii), False, bool(grads))


def _winners(params, inputs, row_numel):
    """Per tensor, per ball, the indices within the ball that moved to a vertex (not just scaled)."""
    alpha = float(inputs["schedule"][1])
    out = []
    for p, p0, n in zip(params, inputs["params"], row_numel):
        moved = _moved(p, p0, alpha).reshape(-1, n or max(p.numel(), 1))
        out.append([torch.nonzero(row).flatten().tolist() for row in moved])
    return out


# Short rows, a 1-D tensor as one ball, a 3-D tensor with rows of 8, rows longer than one program holds
# (the blocks and finalize path), an empty tensor with rows, rows of exactly one program's width with a
# partly filled last program, and rows whose stream offsets are not multiples of 4 (the default offsets).
ROW_SHAPES = [(6, 5), (13,), (3, 4, 2), (2, l1_fw_step._MAX_ROW_SEG + 3), (0, 3), (3, 1024), (7, 3)]
ROW_NUMEL = [5, 0, 8, l1_fw_step._MAX_ROW_SEG + 3, 3, 1024, 3]


def test_row_layout_takes_both_paths():
    """Guards the row tests against vacuous passes: the long rows take the blocks path, the rest the rows kernel."""
    inputs = _make_shaped_inputs(ROW_SHAPES, torch.float32, momentum=True, grads=False)
    radii = _row_radii(ROW_SHAPES, ROW_NUMEL)
    layout = _layout_of(inputs, radii, ROW_NUMEL)
    assert layout.n_long_balls == 2 and layout.slots == 2 * 2  # two blocks per long row
    assert layout.n_balls == len(radii) and layout.row_launches


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("momentum", [False, True])
def test_step_row_balls_forward_gradient(distribution, momentum):
    inputs = _make_shaped_inputs(ROW_SHAPES, torch.float32, momentum=momentum, grads=False, n_tangents=2, gen_seed=5)
    radii = _row_radii(ROW_SHAPES, ROW_NUMEL)
    ref, got = _run_both_rows(inputs, radii, ROW_NUMEL, distribution)
    # every non-empty ball moved one element to its vertex
    assert all(len(ball) == 1 for balls in _winners(ref[0], inputs, ROW_NUMEL) for ball in balls)
    _assert_same_step(ref, got, exact=distribution == RADEMACHER)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("momentum", [False, True])
def test_step_row_balls_backprop_gradient(dtype, momentum):
    inputs = _make_shaped_inputs(ROW_SHAPES, dtype, momentum=momentum, grads=True, gen_seed=6)
    radii = _row_radii(ROW_SHAPES, ROW_NUMEL)
    ref, got = _run_both_rows(inputs, radii, ROW_NUMEL)
    _assert_vertex_moved(ref[0], inputs)
    _assert_same_step(ref, got, exact=True)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_row_balls_aligned(distribution, dtype):
    """Offsets and row lengths that are multiples of 4: the vectorised path, unmasked for full programs
    (rows of 1024, 64 and 2048), masked for a partly filled one (3 rows of 1024) and short rows (12 of 16)."""
    shapes = [(8, 64), (3, 1024), (64,), (5, 12), (2, 2048)]
    row_numel = [64, 1024, 0, 12, 2048]
    numels = [math.prod(s) for s in shapes]
    offsets = [sum(numels[:t]) for t in range(len(shapes))]
    inputs = _make_shaped_inputs(shapes, dtype, momentum=True, grads=False, n_tangents=2, offsets=offsets, gen_seed=8)
    radii = _row_radii(shapes, row_numel)
    layout = _layout_of(inputs, radii, row_numel)
    assert layout.slots == 0 and all(launch.aligned for launch in layout.row_launches)
    ref, got = _run_both_rows(inputs, radii, row_numel, distribution)
    _assert_same_step(ref, got, exact=distribution == RADEMACHER)


def test_step_row_ties_lowest_index_within_each_row_wins():
    """Per row: equal |d| of either sign -> the lowest index; NaN beats everything (torch.argmax); d = 0 ->
    index 0 with sign 0 (nothing moves); long rows (blocks path) and short rows alike."""
    short = [[0.0, -3.0, 3.0, -3.0],  # index 1
             [2.0, 2.0, -2.0, 1.0],  # index 0
             [1.0, float("inf"), float("nan"), -5.0],  # index 2 (NaN)
             [0.0, 0.0, 0.0, 0.0],  # index 0, sign 0: unchanged
             [-1.0, 4.0, 0.5, -4.0]]  # index 1
    n_long = l1_fw_step._MAX_ROW_SEG + 100
    long = [[0.0] * n_long for _ in range(2)]
    long[0][n_long - 1], long[0][5], long[0][n_long - 50] = 9.0, -9.0, 9.0  # index 5: a tie across blocks
    long[1][10], long[1][n_long - 10], long[1][n_long - 8] = 1.5, -2.0, 2.0  # index n_long - 10, in the last block
    values = [sum(short, []), sum(long, []), [5.0, -5.0, 5.0]]
    inputs = _tie_inputs(values)
    row_numel = [4, n_long, 0]
    radii = [1.0 + b for b in range(len(short) + 2 + 1)]
    ref, got = _run_both_rows(inputs, radii, row_numel)
    _assert_same_step(ref, got, exact=True)
    assert _winners(got[0], inputs, row_numel) == [[[1], [0], [], [], [1]], [[5], [n_long - 10]], [[0]]]


def test_step_row_balls_small_mlp_layout():
    """The 12 x 1024 MLP benchmark's layout, scaled down: square weights with rows as balls and biases of
    one row's length as whole balls, offsets as the optimizer lays them out (multiples of 4). One rows
    launch (every ball fits a program, one size class) and no blocks: three AFGFW steps track the reference."""
    width, layers = 64, 3
    shapes = [(width, width), (width,)] * layers
    row_numel = [width, 0] * layers
    numels = [math.prod(s) for s in shapes]
    offsets = [sum(numels[:t]) for t in range(len(shapes))]
    inputs = _make_shaped_inputs(shapes, torch.float32, momentum=True, grads=False, n_tangents=2, offsets=offsets)
    radii = _row_radii(shapes, row_numel)
    assert len(radii) == layers * (width + 1)
    layout = _layout_of(inputs, radii, row_numel)
    assert layout.slots == 0 and len(layout.row_launches) == 1 and layout.row_launches[0].aligned
    states = [([p.clone() for p in inputs["params"]], [v.clone() for v in inputs["momentum"]]) for _ in range(2)]
    for step in range(3):
        schedule = torch.tensor([step, 2 / (step + 2), 1 / (step + 1)], dtype=torch.float64, device=DEVICE)
        gaps = []
        for step_fn, (params, momentum) in zip((reference.l1_fw_step_, fgfw_triton.l1_fw_step_), states):
            gaps.append(torch.zeros((), dtype=torch.float64, device=DEVICE))
            step_fn(params, momentum, [], schedule, inputs["tangent_coeffs"], radii, False, offsets, 99, RADEMACHER,
                    gaps[-1], row_numel)
        torch.testing.assert_close(gaps[1], gaps[0], rtol=1e-10, atol=1e-10)
    for ref, got in zip(states[0], states[1]):
        for a, b in zip(ref, got):
            assert torch.equal(a, b)
    # Gaussian tangents, to a tolerance
    ref, got = _run_both_rows(inputs, radii, row_numel, GAUSSIAN)
    _assert_same_step(ref, got, exact=False)


def test_step_row_balls_gap_sums_over_many_chunks(monkeypatch):
    """More balls than one gap-sum iteration: every ball's share is summed, in order."""
    monkeypatch.setattr(l1_fw_step, "_RBLOCK", 4)
    shapes, row_numel = [(9, 3), (5,), (2, l1_fw_step._MAX_ROW_SEG + 1)], [3, 0, l1_fw_step._MAX_ROW_SEG + 1]
    inputs = _make_shaped_inputs(shapes, torch.float32, momentum=True, grads=True, gen_seed=9)
    ref, got = _run_both_rows(inputs, _row_radii(shapes, row_numel), row_numel)
    _assert_same_step(ref, got, exact=True)


def test_step_row_balls_of_empty_tensors_only():
    """Rows of an empty tensor are no balls: no radius, nothing to do, gap 0."""
    inputs = _make_shaped_inputs([(0, 4), (0, 2)], torch.float32, momentum=True, grads=False)
    ref, got = _run_both_rows(inputs, [], [4, 2])
    assert got[2].item() == 0.0
    _assert_same_step(ref, got, exact=True)


def test_step_rejects_bad_row_numel():
    schedule = torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64, device=DEVICE)
    coeffs = torch.ones(1, dtype=torch.float64, device=DEVICE)
    gap = torch.zeros((), dtype=torch.float64, device=DEVICE)
    params = [torch.ones(2, 6, device=DEVICE), torch.ones(3, device=DEVICE)]

    def step(radii, row_numel, global_ball=False):
        fgfw_triton.l1_fw_step_(params, [], [], schedule, coeffs, radii, global_ball, [0, 12], 0, RADEMACHER, gap,
                                row_numel)

    for radii, row_numel, message in [
            ([1.0] * 3, [6], "row_numel must be empty or hold one row length per parameter"),
            ([1.0] * 3, [5, 0], r"row_numel\[0\] must be 0 \(one ball\) or a row length that divides the 12"),
            ([1.0] * 3, [-6, 0], r"row_numel\[0\]"),
            ([1.0] * 2, [6, 0], r"radii must hold one radius per ball \(3"),
            ([1.0] * 4, [6, 0], r"radii must hold one radius per ball \(3"),
            ([1.0, 2.0, -1.0], [6, 0], r"radii\[2\] must be a finite radius > 0")]:
        with pytest.raises(ValueError, match=message):
            step(radii, row_numel)
    with pytest.raises(ValueError, match="row_numel must be all 0 for the global ball"):
        step([1.0], [6, 0], global_ball=True)
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)


def test_no_kernel_global_is_a_nan():
    """Compiled Triton (3.6) compares every global a kernel reads with its value at compile time before it reuses
    the kernel, and NaN never equals itself: a NaN global constexpr made every launch after the first raise
    "Global variable ... has changed" (the set steps' _NAN, seen on an H200; the interpreter never checks).
    Every module-level constexpr of fgfw.triton must equal itself."""
    from fgfw.triton import ksparse_fw_step, linf_fw_step, lp_fw_step, ops, set_step
    for module in (l1_fw_step, set_step, linf_fw_step, lp_fw_step, ksparse_fw_step, tangent, ops):
        for name, value in vars(module).items():
            if isinstance(value, tl.constexpr):
                assert value.value == value.value, f"{module.__name__}.{name} = {value.value!r} never equals itself"


# ---------------------------------------------------------------------------------------------------
# A skipped step: a schedule (step, alpha, gamma, skip) with skip != 0, read by every kernel on the device, writes
# no bit of the params or momentum and NaN into the gap (reference.schedule_values); skip = 0 is the 3-element step.

_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
           torch.float16: torch.int16}


def _bits(tensors):
    """The tensors' bits (-0.0 differs from +0.0, a NaN's payload counts)."""
    return [t.detach().contiguous().view(_INT_OF[t.dtype]).clone() for t in tensors]


def _same_bits(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# (shapes, row_numel, global_ball): rows of every path (short rows, long rows through the blocks and the finalize,
# an empty tensor); tensor balls (short ones, a long one, the gap sum); the global ball (blocks, its finalize writing
# the gap itself); one short ball (the rows kernel writing the gap itself).
SKIP_CASES = {
    "rows": (ROW_SHAPES, ROW_NUMEL, False),
    "tensors": ([(5,), (2100,), (1,), (3, 11)], [0, 0, 0, 0], False),
    "global": ([(5,), (2100,), (0,), (33,)], [0, 0, 0, 0], True),
    "one_ball": ([(13,)], [0], False),
}


def _skip_step(case, dtype, momentum, source, schedule, *, poison=False):
    """The Triton L1 step of a SKIP_CASES case with this schedule: (bits of params + momentum, gap). ``poison``: a
    -0.0 parameter and a non-finite direction (what a skipped step is for)."""
    shapes, row_numel, global_ball = SKIP_CASES[case]
    inputs = _make_shaped_inputs(shapes, dtype, momentum=momentum, grads=source == "grad", n_tangents=2, gen_seed=4)
    params, moms = inputs["params"], inputs["momentum"]
    coeffs = inputs["tangent_coeffs"]
    if poison:
        params[0].view(-1)[0] = -0.0
        if source == "grad":
            inputs["grads"][0].view(-1)[1] = float("nan")
            inputs["grads"][-1].view(-1)[-1] = -float("inf")
        else:
            coeffs = torch.tensor([float("nan"), 1.0], dtype=torch.float64, device=DEVICE)
    before = _bits(params + moms)
    radii = [1.5] if global_ball else _row_radii(shapes, row_numel)
    gap = torch.zeros((), dtype=torch.float64, device=DEVICE)
    fgfw_triton.l1_fw_step_(params, moms, inputs["grads"], torch.tensor(schedule, dtype=torch.float64, device=DEVICE),
                            coeffs, radii, global_ball, inputs["offsets"], 2024, RADEMACHER, gap, row_numel)
    return before, _bits(params + moms), float(gap)


@pytest.mark.parametrize("source", ["grad", "rademacher"])
@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_a_skipped_step_writes_no_bit_and_a_nan_gap(case, source):
    for skip in (1.0, float("nan"), -2.0):
        before, after, gap = _skip_step(case, torch.float32, True, source, [3.0, 0.25, 0.4, skip], poison=True)
        assert _same_bits(before, after) and math.isnan(gap), f"skip={skip}"
    # without momentum, and a float64 and a bfloat16 step
    for dtype, momentum in ((torch.float32, False), (torch.float64, True), (torch.bfloat16, False)):
        before, after, gap = _skip_step(case, dtype, momentum, source, [3.0, 0.25, 0.4, 1.0], poison=True)
        assert _same_bits(before, after) and math.isnan(gap), (dtype, momentum)


@pytest.mark.parametrize("source", ["grad", "rademacher"])
@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_skip_zero_is_the_three_element_step(case, source):
    _, three, gap_three = _skip_step(case, torch.float32, True, source, [3.0, 0.25, 0.4])
    before, four, gap_four = _skip_step(case, torch.float32, True, source, [3.0, 0.25, 0.4, 0.0])
    assert _same_bits(three, four) and not _same_bits(before, four)
    assert gap_three == gap_four and math.isfinite(gap_three)


def test_a_skipped_step_without_elements_writes_a_nan_gap():
    """As the reference: no params, or only empty tensors, still give a NaN gap when skipped (0 when not)."""
    coeffs = torch.ones(1, dtype=torch.float64, device=DEVICE)
    for params in ([], [torch.empty(0, device=DEVICE)]):
        for schedule, expected in (([0.0, 0.5, 0.5, 1.0], math.nan), ([0.0, 0.5, 0.5, 0.0], 0.0)):
            gaps = []
            for step in (reference.l1_fw_step_, fgfw_triton.l1_fw_step_):
                gaps.append(torch.full((), 7.0, dtype=torch.float64, device=DEVICE))
                step(params, [], [], torch.tensor(schedule, dtype=torch.float64, device=DEVICE), coeffs,
                     [1.0] * len(params), False, [0] * len(params), 0, RADEMACHER, gaps[-1])
            for gap in gaps:
                assert math.isnan(float(gap)) if math.isnan(expected) else float(gap) == expected


def test_step_schedule_of_three_or_four_elements_only():
    params = [torch.ones(3, device=DEVICE)]
    gap = torch.zeros((), dtype=torch.float64, device=DEVICE)
    # made on DEVICE: .to(cuda) of the strided view would copy it into a contiguous tensor
    for numel, dtype, stride in ((5, torch.float64, 1), (2, torch.float64, 1), (4, torch.float32, 1),
                                 (4, torch.float64, 2)):
        schedule = torch.zeros(numel * stride, dtype=dtype, device=DEVICE)[::stride]
        assert schedule.numel() != 4 or schedule.dtype != torch.float64 or not schedule.is_contiguous()
        with pytest.raises(ValueError, match=r"schedule must be .*\(step, alpha, gamma\) or \(step, alpha, gamma, "
                                             r"skip\)"):
            fgfw_triton.l1_fw_step_(params, [], [torch.ones(3, device=DEVICE)], schedule,
                                    torch.zeros(0, dtype=torch.float64), [1.0], False, [0], 0, RADEMACHER, gap)
    assert torch.equal(params[0], torch.ones(3, device=DEVICE))


# ---------------------------------------------------------------------------------------------------
# gradient_step_: an unconstrained group's step (reference.gradient_step_ with given directions)

from fgfw.triton import gradient_step  # noqa: E402

GRADIENT_SHAPES = [(7, 33), (5,), (0,), (3, 4, 5), (2 * gradient_step._BLOCK + 3,), (1,)]


def _gradient_inputs(dtype, momentum, *, seed=0, shapes=GRADIENT_SHAPES, unaligned=False):
    """(params, momentum, grads) of ``shapes``; ``unaligned``: each a view one element into a buffer (no 16-byte
    alignment: the unvectorised path)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(shape):
        n = math.prod(shape)
        x = torch.randn(n + unaligned, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
        return x[1:].view(shape) if unaligned else x.view(shape)

    return ([draw(s) for s in shapes], [draw(s) for s in shapes] if momentum else [], [draw(s) for s in shapes])


def _gradient_schedule(values):
    return torch.tensor(values, dtype=torch.float64, device=DEVICE)


@pytest.mark.parametrize("unaligned", [False, True])
@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_step_is_the_reference_bit_for_bit(dtype, momentum, unaligned):
    # alpha and gamma that round differently in float32 and float64, and a schedule that skips nothing (0.0)
    for values in ([4.0, 0.1, 1 / 3], [9.0, 0.0123, 0.7, 0.0], [2.0, 1.0 + 2.0**-30, 0.3]):
        runs = []
        for step in (reference.gradient_step_, fgfw_triton.gradient_step_):
            params, moms, grads = _gradient_inputs(dtype, momentum, unaligned=unaligned)
            before = _bits(params + moms)
            step(params, moms, grads, _gradient_schedule(values))
            runs.append(_bits(params + moms))
        assert _same_bits(*runs)
        assert not _same_bits(before, runs[1])  # guards against a vacuous pass


def test_gradient_step_repeated_steps_track_the_reference():
    """Three steps with momentum on the same tensors (the cached table reused) stay on the reference's bits."""
    states = [_gradient_inputs(torch.float32, True, seed=3) for _ in range(2)]
    for k in range(3):
        schedule = _gradient_schedule([k, 0.5 / (k + 1), 1 / (k + 1)])
        for step, (params, moms, grads) in zip((reference.gradient_step_, fgfw_triton.gradient_step_), states):
            step(params, moms, grads, schedule)
    assert _same_bits(_bits(states[0][0] + states[0][1]), _bits(states[1][0] + states[1][1]))
    assert gradient_step._table.cache_info().hits >= 2


@pytest.mark.parametrize("momentum", [False, True])
def test_a_skipped_gradient_step_writes_no_bit(momentum):
    for dtype in (torch.float32, torch.float64):
        params, moms, grads = _gradient_inputs(dtype, momentum, seed=1)
        params[1][0] = -0.0
        grads[0][0, 0] = float("nan")
        grads[3][1, 2, 3] = float("inf")
        before = _bits(params + moms)
        for skip in (1.0, -1.0, float("nan")):
            fgfw_triton.gradient_step_(params, moms, grads, _gradient_schedule([2.0, 0.5, 0.5, skip]))
            assert _same_bits(before, _bits(params + moms)), (dtype, skip)
    # the reference agrees (nothing written)
    ref_params = [p.clone() for p in params]
    reference.gradient_step_(ref_params, [m.clone() for m in moms], grads, _gradient_schedule([2.0, 0.5, 0.5, 1.0]))
    assert _same_bits(_bits(ref_params), _bits(params))


def test_gradient_step_is_one_launch_over_every_tensor(monkeypatch):
    """One kernel launch whatever the number of tensors (a table of their addresses, not a launch per tensor)."""
    launches = []
    kernel = gradient_step._gradient_step_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(gradient_step, "_gradient_step_kernel", Counting())
    shapes = [(3,)] * 40 + [(gradient_step._BLOCK + 1,), (0,)]
    params, moms, grads = _gradient_inputs(torch.float32, True, shapes=shapes)
    fgfw_triton.gradient_step_(params, moms, grads, _gradient_schedule([1.0, 0.25, 0.5, 0.0]))
    assert launches == [(40 + 2,)]  # a block per small tensor, two for the long one, none for the empty one
    fgfw_triton.gradient_step_([], [], [], _gradient_schedule([1.0, 0.25, 0.5]))
    fgfw_triton.gradient_step_([torch.empty(0, device=DEVICE)], [], [torch.empty(0, device=DEVICE)],
                               _gradient_schedule([1.0, 0.25, 0.5]))
    assert len(launches) == 1  # nothing to step: no launch


def test_gradient_step_custom_op_and_the_optimizers_entry():
    """torch.ops.fgfw_triton.gradient_step_ is what fgfw._ops.gradient_step_ calls for the 'triton' backend."""
    from fgfw import _ops

    assert _ops.gradient_step_available("triton")
    results = []
    for call in ("launcher", "op", "entry"):
        params, moms, grads = _gradient_inputs(torch.float32, True, seed=2)
        args = (params, moms, grads, _gradient_schedule([5.0, 0.125, 0.25, 0.0]))
        if call == "launcher":
            gradient_step.gradient_step_(*args)
        elif call == "op":
            torch.ops.fgfw_triton.gradient_step_(*args)
        else:
            _ops.gradient_step_(*args, "triton")
        results.append(_bits(params + moms))
    assert _same_bits(results[0], results[1]) and _same_bits(results[0], results[2])


def test_gradient_step_rejects_bad_arguments():
    params, moms, grads = _gradient_inputs(torch.float32, True, shapes=[(4, 3), (5,)])
    schedule = _gradient_schedule([1.0, 0.1, 0.5])
    before = _bits(params + moms)
    step = fgfw_triton.gradient_step_
    for args, message in [
            ((params, moms, grads[:1], schedule), r"grads must hold one direction per parameter \(2\), got 1"),
            ((params, moms[:1], grads, schedule), r"momentum must be empty \(no momentum\) or hold one tensor per "
                                                  r"parameter \(2\), got 1"),
            (([p.half() for p in params], [], [g.half() for g in grads], schedule),
             "params must be float32 or float64"),
            (([params[0], params[1].double()], [], grads, schedule),
             r"params\[1\] must be a contiguous torch.float32"),
            (([params[0].t(), params[1]], [], grads, schedule), r"params\[0\] must be a contiguous"),
            ((params, [moms[0], moms[1].double()], grads, schedule),
             r"momentum\[1\] must be a contiguous torch.float32"),
            ((params, moms, [grads[0], grads[1][:4]], schedule),
             r"grads\[1\] must be a contiguous torch.float32 tensor of 5 elements"),
            ((params, moms, [grads[0].t(), grads[1]], schedule), r"grads\[0\] must be a contiguous"),
            ((params, moms, grads, schedule.float()), r"schedule must be a contiguous float64 tensor \(step, alpha, "
                                                      r"gamma\) or \(step, alpha, gamma, skip\)"),
            ((params, moms, grads, _gradient_schedule([1.0, 0.1, 0.5, 0.0, 0.0])), "schedule must be"),
            (([], [], [], torch.zeros(2, dtype=torch.float64)), "schedule must be")]:
        with pytest.raises(ValueError, match=message):
            step(*args)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="grads"):
            step(params, moms, [grads[0], grads[1].to("meta")], schedule)
    assert _same_bits(before, _bits(params + moms))


def test_gradient_step_and_skippable_steps_pass_opcheck():
    """torch.library.opcheck on the custom ops with 4-element schedules: the fake, the schema's mutations (params,
    momentum; and gap for the steps), on a step that runs (skip 0) and one that is skipped."""
    f64 = dict(dtype=torch.float64, device=DEVICE)
    for skip in (0.0, 1.0):
        params, moms, grads = _gradient_inputs(torch.float32, True, shapes=[(3, 5), (7,)])
        torch.library.opcheck(torch.ops.fgfw_triton.gradient_step_.default,
                              (params, moms, grads, torch.tensor([2.0, 0.5, 0.25, skip], **f64)))
        args = ([torch.randn(5, device=DEVICE)], [torch.zeros(5, device=DEVICE)], [],
                torch.tensor([2.0, 0.5, 0.25, skip], **f64), torch.tensor([0.3], **f64), [1.0], True, [0], 5, 1,
                torch.zeros((), **f64), [])
        torch.library.opcheck(torch.ops.fgfw_triton.l1_fw_step_.default, args)
        torch.library.opcheck(torch.ops.fgfw_triton.linf_fw_step_.default, args)


def test_tangents_at_step_are_one_fill_each():
    """The Triton backend's tangents_at_step (one custom op for a layer's tangents) against its own fill_tangent_ and
    the reference (test_tangent_stream's check)."""
    from test_tangent_stream import _assert_tangents_are_one_fill_each
    _assert_tangents_are_one_fill_each("triton", DEVICE)
