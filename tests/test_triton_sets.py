"""The Triton set steps (fgfw.triton.linf_fw_step, lp_fw_step, ksparse_fw_step: L-infinity balls, Lp balls,
k-sparse polytopes) against the spec, fgfw.reference, through the checker that every backend shares
(tests/set_cases.py); then what that checker does not reach: stream offsets off the Philox call boundaries, balls of
many chunks, NaN and zero directions, the custom ops. The kernels compiled for sm_90 without a GPU:
tests/test_triton_compile.py (fgfw.triton.aot).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (as tests/test_triton.py), so the shared
cases are covered on a subset of their product: every set and scope with one source, the other sources and
dtypes on fewer combinations.
"""
import math
import os

import pytest
import torch

# Before fgfw.triton is imported: see tests/test_triton.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

import set_cases  # noqa: E402
from fgfw import reference  # noqa: E402
from fgfw import triton as fgfw_triton  # noqa: E402

if not fgfw_triton.is_available():
    pytest.skip("Triton kernels cannot run here: no CUDA device, and fgfw.triton was imported before "
                "TRITON_INTERPRET=1 was set", allow_module_level=True)

from fgfw.triton import ksparse_fw_step, linf_fw_step, lp_fw_step, set_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GAUSSIAN, RADEMACHER = reference.GAUSSIAN, reference.RADEMACHER
STEPS = {"linf": linf_fw_step.linf_fw_step_, "lp": lp_fw_step.lp_fw_step_, "ksparse": ksparse_fw_step.ksparse_fw_step_}
# One parameter of each set for the tests that sweep something else.
ONE_OF_EACH = [("linf", None), ("lp", 1.5), ("ksparse", 3)]


def _check(kind, param, dtype, momentum, source, scope):
    runs = set_cases.run_set_step(STEPS[kind], kind, param, dtype, momentum, source, scope, DEVICE, backend="triton")
    set_cases.assert_set_step_matches(runs, kind, dtype, source, own_tangents=True)


@pytest.mark.parametrize("scope", set_cases.SCOPES)
@pytest.mark.parametrize("kind,param", set_cases.CASES)
def test_every_set_and_scope_matches_reference(kind, param, scope):
    _check(kind, param, torch.float32, True, "grad", scope)


@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("source", ["rademacher", "gaussian"])
@pytest.mark.parametrize("kind,param", ONE_OF_EACH)
def test_forward_gradient_matches_reference(kind, param, source, momentum):
    # rows of 33: most balls start off a Philox call boundary
    _check(kind, param, torch.float32, momentum, source, "row")


@pytest.mark.parametrize("source", ["rademacher", "gaussian"])
@pytest.mark.parametrize("kind,param", ONE_OF_EACH)
def test_forward_gradient_global_ball_matches_reference(kind, param, source):
    _check(kind, param, torch.float32, False, source, "global")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,param", [("linf", None), ("lp", 2.0), ("lp", 1.01), ("ksparse", 40)])
def test_other_dtypes_match_reference(kind, param, dtype):
    _check(kind, param, dtype, True, "rademacher", "row")


@pytest.mark.parametrize("kind,param", [("lp", 3.0), ("ksparse", 10_000)])
def test_float64_global_ball_matches_reference(kind, param):
    _check(kind, param, torch.float64, False, "grad", "global")


def test_ksparse_breaks_ties_by_index_as_the_reference():
    set_cases.check_ksparse_selection_exact(ksparse_fw_step.ksparse_fw_step_, DEVICE)


# inf / inf in the interpreter's numpy: the spec's NaN
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kind,param", ONE_OF_EACH)
def test_nonfinite_directions_as_the_reference(kind, param):
    set_cases.check_nonfinite_directions(STEPS[kind], DEVICE, kind, param)


# ---------------------------------------------------------------------------------------------------
# Beyond the shared cases: own inputs, the same comparison.


def _run_both(kind, param, params, grads=(), momentum=(), *, radii, global_ball=False, offsets=None, row_numel=(),
              distribution=RADEMACHER, coeffs=(0.7, -1.1), schedule=(3.0, 0.2, 0.4)):
    """The reference and the Triton step on copies of the same inputs: [(params, momentum, gap)] for each."""
    keyword = set_cases.SETS[kind][1]
    extra = set_cases.set_extra(kind, param)
    offsets = offsets if offsets is not None else [0] * len(params)
    runs = []
    for step in (set_cases.SETS[kind][0], STEPS[kind]):
        ps, ms = [p.clone() for p in params], [m.clone() for m in momentum]
        gap = torch.full((), float("nan"), dtype=torch.float64, device=DEVICE)
        step(ps, ms, [g.clone() for g in grads], torch.tensor(schedule, dtype=torch.float64, device=DEVICE),
             torch.tensor(coeffs, dtype=torch.float64, device=DEVICE), radii, global_ball, offsets, 11, distribution,
             gap, list(row_numel), **extra)
        runs.append(([p.cpu() for p in ps], [m.cpu() for m in ms], float(gap)))
    return runs


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype).to(DEVICE)


@pytest.mark.parametrize("global_ball", [False, True])
@pytest.mark.parametrize("kind,param", ONE_OF_EACH)
def test_stream_offsets_off_call_boundaries_and_balls_of_many_chunks(kind, param, global_ball):
    """Offsets that are not multiples of 4 put every tile row's first element at a lead; a 5000-element tensor
    spans three tiles, whose partials (Lp norm, gap) the finalize combines."""
    sizes = [5000, 7, 130]
    params = [_randn(n, seed=n) * 1e-2 for n in sizes]
    momentum = [_randn(n, seed=n + 1) for n in sizes]
    radii = [0.3] if global_ball else [0.3, 0.2, 0.4]
    runs = _run_both(kind, param, params, momentum=momentum, radii=radii, global_ball=global_ball,
                     offsets=[1, 5003, 5013])
    set_cases.assert_set_step_matches(runs, kind, torch.float32, "rademacher")


@pytest.mark.parametrize("kind,param", ONE_OF_EACH)
def test_thousands_of_short_row_balls(kind, param):
    """3000 rows of 6 (leads 0 and 2 in turn) and 40 rows of 50: many balls to a program, one slot each."""
    params = [_randn(3000, 6, seed=1) * 1e-2, _randn(40, 50, seed=2) * 1e-2]
    grads = [_randn(3000, 6, seed=3), _randn(40, 50, seed=4)]
    radii = [0.5] * 3000 + [0.25] * 40
    for source_grads, distribution in ((grads, RADEMACHER), ((), RADEMACHER)):
        runs = _run_both(kind, param, params, source_grads, radii=radii, offsets=[0, 18000], row_numel=[6, 50],
                         distribution=distribution)
        set_cases.assert_set_step_matches(runs, kind, torch.float32, "grad" if source_grads else "rademacher")


def test_lp_norm_neither_overflows_nor_underflows_across_chunks():
    """p = 1.01 (q = 101): |d|^q overflows float64 for |d| > 1e3 and underflows for |d| < 1e-3. One ball of
    three tiles whose largest |d| differ by 1e40: each tile's sum is scaled by its own max, then by max / M."""
    grad = torch.cat([_randn(2048, seed=5, dtype=torch.float64) * 1e20, _randn(2048, seed=6, dtype=torch.float64),
                      _randn(2048, seed=7, dtype=torch.float64) * 1e-20])
    params = [torch.zeros(grad.numel(), dtype=torch.float64, device=DEVICE)]
    for p in (1.01, 2.0, 1.5):
        runs = _run_both("lp", p, params, [grad], radii=[1.0])
        set_cases.assert_set_step_matches(runs, "lp", torch.float64, "grad")
        assert all(bool(torch.isfinite(x).all()) for x in runs[1][0])


def test_lp_step_of_directions_near_the_dtype_limits():
    set_cases.check_lp_directions_near_the_limits(lp_fw_step.lp_fw_step_, DEVICE)


def test_zero_and_nan_directions_as_the_reference():
    """An all-zero ball: the Lp vertex is 0 (theta only shrinks), the k-sparse one takes the first k elements
    (every |d| ties) with sign 0. A NaN: the Lp ball's vertex is NaN everywhere; the k-sparse and L-infinity
    vertices treat it as the largest |d| with sign 0. The other balls are untouched by it."""
    grads = [torch.zeros(3, 40, device=DEVICE), torch.zeros(10, device=DEVICE)]
    grads[0][1] = _randn(40, seed=8)
    grads[0][2] = _randn(40, seed=9)
    grads[0][2, 7] = float("nan")
    grads[1][4] = float("nan")
    params = [_randn(3, 40, seed=10) * 1e-2, _randn(10, seed=11) * 1e-2]
    for kind, param in ONE_OF_EACH + [("lp", 2.0), ("ksparse", 45)]:
        expected, got = _run_both(kind, param, params, grads, radii=[0.5, 0.5, 0.5, 1.0], row_numel=[40, 0])
        for a, b in zip(got[0], expected[0]):
            torch.testing.assert_close(a, b, equal_nan=True, rtol=4e-7, atol=1e-8)
        assert got[2] != got[2] and expected[2] != expected[2]  # the gap is NaN, as the reference's
        if kind == "lp":
            assert bool(torch.isnan(got[0][0][2]).all()) and not bool(torch.isnan(got[0][0][:2]).any())


def test_ksparse_ties_across_tensors_and_tiles_take_the_lowest_positions():
    """Every |d| equal in a global ball over three tensors, two of them longer than a tile: the first k
    positions, in (tensor, index) order, move to the vertex."""
    sizes = [3000, 5, 4100]
    grads = [torch.full((n,), -0.5, device=DEVICE) for n in sizes]
    params = [torch.zeros(n, device=DEVICE) for n in sizes]
    for k in (1, 2999, 3003, 5000):
        expected, got = _run_both("ksparse", k, params, grads, radii=[0.5], global_ball=True)
        for a, b in zip(got[0], expected[0]):
            assert torch.equal(a, b), f"k={k}"
        assert sum(int((p != 0).sum()) for p in got[0]) == k


def test_repeated_steps_are_deterministic_and_reuse_the_layout():
    """Same inputs, same bits (partials combine in a fixed order); a second call lays out nothing."""
    results = []
    for _ in range(2):
        params = [_randn(3000, seed=12) * 1e-2, _randn(9, 33, seed=13) * 1e-2]
        gap = torch.zeros((), dtype=torch.float64, device=DEVICE)
        for step, extra in ((lp_fw_step.lp_fw_step_, dict(p=3.0, scales=[])),
                            (ksparse_fw_step.ksparse_fw_step_, dict(k=4, scales=[])),
                            (linf_fw_step.linf_fw_step_, {})):
            misses = set_step._plan.cache_info().misses
            step(params, [], [], torch.tensor([2.0, 0.1, 0.0], dtype=torch.float64, device=DEVICE),
                 torch.tensor([1.0], dtype=torch.float64, device=DEVICE), [1.0] + [0.5] * 9, False, [0, 3000], 9,
                 GAUSSIAN, gap, [0, 33], **extra)
            results.append((params[0].clone(), params[1].clone(), float(gap)))
        assert set_step._plan.cache_info().misses <= misses + 1
    assert set_step._plan.cache_info().hits >= 3
    for (a0, a1, gap_a), (b0, b1, gap_b) in zip(results[:3], results[3:]):
        assert torch.equal(a0, b0) and torch.equal(a1, b1) and gap_a == gap_b


def test_no_params_and_only_empty_tensors_write_a_zero_gap():
    schedule = torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64, device=DEVICE)
    coeffs = torch.tensor([1.0], dtype=torch.float64, device=DEVICE)
    for kind, param in ONE_OF_EACH:
        extra = set_cases.set_extra(kind, param)
        gap = torch.full((), float("nan"), dtype=torch.float64, device=DEVICE)
        STEPS[kind]([], [], [], schedule, coeffs, [], False, [], 0, RADEMACHER, gap, [], **extra)
        assert float(gap) == 0.0
        gap.fill_(float("nan"))
        STEPS[kind]([torch.empty(0, device=DEVICE)], [], [], schedule, coeffs, [1.0], True, [0], 0, RADEMACHER, gap,
                    [], **extra)
        assert float(gap) == 0.0


def test_rejects_what_the_reference_rejects():
    params = [torch.zeros(6, device=DEVICE)]
    args = lambda radii, row_numel=(): (params, [], [torch.ones(6, device=DEVICE)],  # noqa: E731
                                        torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64, device=DEVICE),
                                        torch.zeros(0, dtype=torch.float64), radii, False, [], 0, RADEMACHER,
                                        torch.zeros((), dtype=torch.float64, device=DEVICE), row_numel)
    for p in (1.0, 0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="p must satisfy"):
            lp_fw_step.lp_fw_step_(*args([1.0]), p=p)
    with pytest.raises(ValueError, match="k must be >= 1"):
        ksparse_fw_step.ksparse_fw_step_(*args([1.0]), k=0)
    for step in STEPS.values():
        with pytest.raises(ValueError, match="radii"):
            step(*args([-1.0]))
        with pytest.raises(ValueError, match="row_numel"):
            step(*args([1.0], [4]))


@pytest.mark.parametrize("kind,param", ONE_OF_EACH)
def test_custom_ops_route_from_the_optimizers_entry(kind, param):
    """torch.ops.fgfw_triton.<op> (the set's parameter by keyword) is what fgfw._ops.set_fw_step_ calls for the
    'triton' backend, and gives the launcher's result."""
    from fgfw import _ops

    assert _ops.set_fw_step_available(kind, "triton")
    op = _ops.SET_STEPS[kind][0]
    keyword = _ops.SET_STEPS[kind][1]
    results = []
    for call in ("launcher", "op", "entry"):
        params = [_randn(4, 33, seed=14) * 1e-2]
        momentum = [_randn(4, 33, seed=15)]
        gap = torch.zeros((), dtype=torch.float64, device=DEVICE)
        args = (params, momentum, [], torch.tensor([2.0, 0.1, 0.3], dtype=torch.float64, device=DEVICE),
                torch.tensor([0.5], dtype=torch.float64, device=DEVICE), [0.5] * 4, False, [2], 3, RADEMACHER, gap,
                [33])
        extra = set_cases.set_extra(kind, param)
        if call == "launcher":
            STEPS[kind](*args, **extra)
        elif call == "op":
            getattr(torch.ops.fgfw_triton, op)(*args, **extra)
        else:
            _ops.set_fw_step_(kind, *args[:-1], "triton", args[-1], param=param)
        results.append((params[0].cpu(), momentum[0].cpu(), float(gap)))
    for p, v, g in results[1:]:
        assert torch.equal(p, results[0][0]) and torch.equal(v, results[0][1]) and g == results[0][2]


# ---------------------------------------------------------------------------------------------------
# A skipped step: a schedule (step, alpha, gamma, skip) with skip != 0, read by every kernel on the device, writes
# no bit of the params, momentum or norm scales and NaN into the gap (reference.schedule_values); skip = 0 is the
# 3-element step. Small shapes (the interpreter): rows of 33, a vector, an empty tensor, a tensor of two tiles
# (rows of it in the row scope: balls of several chunks, whose Lp partials the finalize combines).

_SKIP_SHAPES = [(7, 33), (5,), (0,), (2, 2100)]
_SKIP_ROW_NUMEL = {"tensor": [0, 0, 0, 0], "row": [33, 0, 0, 2100], "global": [0, 0, 0, 0]}
_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
           torch.float16: torch.int16}


def _bits(tensors):
    return [t.detach().cpu().contiguous().view(_INT_OF[t.dtype]).clone() for t in tensors]


def _skip_step(kind, param, scope, source, schedule, *, dtype=torch.float32, momentum=True, poison=False):
    """The Triton step with this schedule: (bits of params + momentum + scales before, after, gap)."""
    row_numel = _SKIP_ROW_NUMEL[scope]
    balls = [1] if scope == "global" else [s[0] if n else 1 for s, n in zip(_SKIP_SHAPES, row_numel)]
    params = [_randn(*s, seed=20 + t, dtype=dtype) * 1e-2 for t, s in enumerate(_SKIP_SHAPES)]
    moms = [_randn(*s, seed=30 + t, dtype=reference.compute_dtype(dtype)) for t, s in enumerate(_SKIP_SHAPES)] \
        if momentum else []
    grads = [_randn(*s, seed=40 + t, dtype=dtype) for t, s in enumerate(_SKIP_SHAPES)] if source == "grad" else []
    coeffs = torch.tensor([0.7, -1.1], dtype=torch.float64, device=DEVICE)
    # the norm feedback's scales: within the band the step keeps, not all 1 (Lp and k-sparse)
    scales = [1 + torch.arange(-2, c - 2, dtype=torch.float64, device=DEVICE) * 2.0**-24 for c in balls] \
        if kind != "linf" else []
    if poison:
        params[0].view(-1)[0] = -0.0
        if grads:
            grads[0].view(-1)[3] = float("nan")
            grads[3].view(-1)[-1] = -float("inf")
        else:
            coeffs = torch.tensor([float("nan"), 1.0], dtype=torch.float64, device=DEVICE)
    radii = [0.3] if scope == "global" else [0.2 + 0.05 * b for b in range(sum(balls))]
    offsets = [0, 232, 240, 241]  # the last off a Philox call boundary
    before = _bits(params + moms + scales)
    gap = torch.zeros((), dtype=torch.float64, device=DEVICE)
    STEPS[kind](params, moms, grads, torch.tensor(schedule, dtype=torch.float64, device=DEVICE), coeffs, radii,
                scope == "global", offsets, 11, RADEMACHER, gap, row_numel,
                **set_cases.set_extra(kind, param, scales))
    return before, _bits(params + moms + scales), float(gap)


SKIP_KINDS = [("linf", None), ("lp", 1.5), ("lp", 2.0), ("ksparse", 3)]


@pytest.mark.parametrize("source", ["grad", "rademacher"])
@pytest.mark.parametrize("scope", set_cases.SCOPES)
@pytest.mark.parametrize("kind,param", SKIP_KINDS)
def test_a_skipped_step_writes_no_bit_and_a_nan_gap(kind, param, scope, source):
    for skip in (1.0, float("nan")):
        before, after, gap = _skip_step(kind, param, scope, source, [3.0, 0.2, 0.4, skip], poison=True)
        assert all(torch.equal(a, b) for a, b in zip(before, after)) and math.isnan(gap), f"skip={skip}"
    for dtype, momentum in ((torch.float64, False), (torch.bfloat16, True)):
        before, after, gap = _skip_step(kind, param, scope, source, [3.0, 0.2, 0.4, -1.0], dtype=dtype,
                                        momentum=momentum, poison=True)
        assert all(torch.equal(a, b) for a, b in zip(before, after)) and math.isnan(gap), (dtype, momentum)


@pytest.mark.parametrize("scope", set_cases.SCOPES)
@pytest.mark.parametrize("kind,param", SKIP_KINDS)
def test_skip_zero_is_the_three_element_step(kind, param, scope):
    source = "grad" if scope == "row" else "rademacher"
    _, three, gap_three = _skip_step(kind, param, scope, source, [3.0, 0.2, 0.4])
    before, four, gap_four = _skip_step(kind, param, scope, source, [3.0, 0.2, 0.4, 0.0])
    assert all(torch.equal(a, b) for a, b in zip(three, four))
    assert not all(torch.equal(a, b) for a, b in zip(before, four))
    assert gap_three == gap_four and math.isfinite(gap_three)


def test_a_skipped_step_without_elements_writes_a_nan_gap():
    coeffs = torch.tensor([1.0], dtype=torch.float64, device=DEVICE)
    for kind, param in ONE_OF_EACH:
        extra = set_cases.set_extra(kind, param)
        for schedule, nan in (([1.0, 0.5, 0.5, 1.0], True), ([1.0, 0.5, 0.5, 0.0], False)):
            schedule = torch.tensor(schedule, dtype=torch.float64, device=DEVICE)
            gap = torch.full((), 7.0, dtype=torch.float64, device=DEVICE)
            STEPS[kind]([], [], [], schedule, coeffs, [], False, [], 0, RADEMACHER, gap, [], **extra)
            assert math.isnan(float(gap)) if nan else float(gap) == 0.0
            gap.fill_(7.0)
            STEPS[kind]([torch.empty(0, device=DEVICE)], [], [], schedule, coeffs, [1.0], True, [0], 0, RADEMACHER,
                        gap, [], **extra)
            assert math.isnan(float(gap)) if nan else float(gap) == 0.0


def test_a_schedule_of_another_length_is_refused():
    params = [torch.zeros(6, device=DEVICE)]
    for step, extra in ((linf_fw_step.linf_fw_step_, {}), (lp_fw_step.lp_fw_step_, dict(p=2.0, scales=[])),
                        (ksparse_fw_step.ksparse_fw_step_, dict(k=2, scales=[]))):
        with pytest.raises(ValueError, match=r"\(step, alpha, gamma\) or \(step, alpha, gamma, skip\)"):
            step(params, [], [torch.ones(6, device=DEVICE)], torch.zeros(5, dtype=torch.float64, device=DEVICE),
                 torch.zeros(0, dtype=torch.float64), [1.0], False, [], 0, RADEMACHER,
                 torch.zeros((), dtype=torch.float64, device=DEVICE), [], **extra)
    assert torch.equal(params[0], torch.zeros(6, device=DEVICE))
