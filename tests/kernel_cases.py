"""What the CPU and CUDA kernel tests share: inputs, running the reference and a kernel on clones of
them, and the comparison. Every kernel is checked against fgfw.reference on the same inputs."""
import math

import torch

from fgfw import reference as ref

GAUSSIAN, RADEMACHER = ref.GAUSSIAN, ref.RADEMACHER
PARAM_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Gaussian tangents differ from the reference's by about an ulp of float32 (log/sin/cos), whatever
# the parameter dtype: momentum (float32, or float64 for float64 params) inherits that relative
# error, and narrow (bf16/fp16) parameters see u only through the sign at the vertex. One
# tolerance therefore serves every dtype.
GAUSSIAN_TOL = dict(atol=1e-6, rtol=1e-5)
EXACT = dict(atol=0, rtol=0)


def flat_offsets(params):
    """Each tensor's first index in the group's stream: parameter order, then flat index."""
    offsets, start = [], 0
    for p in params:
        offsets.append(start)
        start += p.numel()
    return offsets


def make_group(shapes, dtype, *, momentum, grads, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    cdt = ref.compute_dtype(dtype)

    def draw(shape, scale, out_dtype):
        return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(out_dtype).to(device)

    params = [draw(s, 0.1, dtype) for s in shapes]
    moms = [draw(s, 1.0, cdt) for s in shapes] if momentum else []
    grad_list = [draw(s, 1.0, dtype) for s in shapes] if grads else []
    return params, moms, grad_list


def clone(x):
    """A copy of x at the same address alignment (x's storage offset in a fresh allocation)."""
    offset = x.storage_offset()
    out = torch.empty(offset + x.numel(), dtype=x.dtype, device=x.device)[offset:].view(x.shape)
    return out.copy_(x)


def run_step(step, params, momentum, grads, *, schedule, coeffs, radii, global_ball, offsets, seed, distribution,
             row_numel=()):
    """Runs one step on clones of the inputs (on the inputs' device); returns (params, momentum, gap)."""
    device = params[0].device if params else torch.device("cpu")
    p = [clone(x) for x in params]
    m = [clone(x) for x in momentum]
    gap = torch.full((), float("nan"), dtype=torch.float64, device=device)
    step(p, m, [clone(g) for g in grads], torch.tensor(schedule, dtype=torch.float64, device=device),
         torch.tensor(coeffs, dtype=torch.float64, device=device), radii, global_ball, offsets, seed, distribution, gap,
         list(row_numel))
    return p, m, gap


def run_both(ops, params, momentum, grads, *, schedule=(7, 0.1, 0.3), coeffs=(0.7,), radii=None,
             global_ball=False, offsets=None, seed=5, distribution=GAUSSIAN, row_numel=()):
    """The reference, then the kernel, on clones of the same inputs: [(params, momentum, gap)] * 2."""
    kwargs = dict(schedule=schedule, coeffs=coeffs, global_ball=global_ball, seed=seed, distribution=distribution,
                  radii=list(radii) if radii is not None else ([2.0] if global_ball else
                                                               [1.0 + t for t in range(len(params))]),
                  offsets=flat_offsets(params) if offsets is None else offsets, row_numel=row_numel)
    return [run_step(step, params, momentum, grads, **kwargs) for step in (ref.l1_fw_step_, ops.l1_fw_step_)]


def assert_same_step(expected, got, tol, gap_rtol=1e-9):
    (p_ref, m_ref, gap_ref), (p, m, gap) = expected, got
    for t, (a, b) in enumerate(zip(p, p_ref)):
        torch.testing.assert_close(a, b.to(a.device), **tol, equal_nan=True, msg=lambda s: f"params[{t}]: {s}")
    for t, (a, b) in enumerate(zip(m, m_ref)):
        torch.testing.assert_close(a, b.to(a.device), **tol, equal_nan=True, msg=lambda s: f"momentum[{t}]: {s}")
    torch.testing.assert_close(gap, gap_ref.to(gap.device), atol=1e-12, rtol=gap_rtol, equal_nan=True)


SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]


def check_forward_gradient(ops, device, dtype, distribution, coeffs, momentum, global_ball):
    """The forward-gradient step of ``ops`` equals the reference's: Rademacher exactly, Gaussian closely."""
    params, moms, _ = make_group(SHAPES, dtype, momentum=momentum, grads=False, device=device)
    expected, got = run_both(ops, params, moms, [], coeffs=coeffs, global_ball=global_ball,
                             distribution=distribution)
    if distribution == RADEMACHER:
        assert_same_step(expected, got, EXACT)
    else:
        assert_same_step(expected, got, GAUSSIAN_TOL, gap_rtol=1e-5)


def check_backprop_gradient(ops, device, dtype, momentum, global_ball):
    """The backprop-gradient step of ``ops`` equals the reference's bit for bit (offsets unused, left empty)."""
    params, moms, grads = make_group(SHAPES, dtype, momentum=momentum, grads=True, device=device)
    expected, got = run_both(ops, params, moms, grads, global_ball=global_ball, offsets=[])
    assert_same_step(expected, got, EXACT)


# Row balls (scope "row"): a matrix of short rows, a 1-D tensor as one ball, a 3-D tensor with rows of 8,
# rows longer than one CPU segment and one CUDA chunk (2 x 70,000), and an empty tensor with rows.
ROW_SHAPES = [(6, 5), (13,), (3, 4, 2), (2, 70_000), (0, 3)]
ROW_NUMEL = [5, 0, 8, 70_000, 3]


def row_radii(shapes=ROW_SHAPES, row_numel=ROW_NUMEL):
    """A different radius for every ball, so that a ball given another's radius shows."""
    count = sum(1 if n == 0 else math.prod(s) // n for s, n in zip(shapes, row_numel))
    return [0.5 + 0.25 * b for b in range(count)]


def check_row_balls(ops, device, dtype, distribution, momentum, grads):
    """A step over row balls equals the reference's: exactly where no transcendental function is involved."""
    params, moms, grad_list = make_group(ROW_SHAPES, dtype, momentum=momentum, grads=grads, device=device, seed=11)
    expected, got = run_both(ops, params, moms, grad_list, coeffs=(0.8, -0.3), radii=row_radii(),
                             offsets=[] if grads else None, distribution=distribution, row_numel=ROW_NUMEL)
    if grads or distribution == RADEMACHER:
        assert_same_step(expected, got, EXACT, gap_rtol=1e-12)
    else:
        assert_same_step(expected, got, GAUSSIAN_TOL, gap_rtol=1e-5)


# -- the finite check (all_finite, nonfinite) -------------------------------------------------------------------
def nonfinite_cases(device="cpu"):
    """(tensors, expected) with expected from the definition (each value tested with math.isfinite), on ``device``."""
    cases = []
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        info = torch.finfo(dtype)
        extremes = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0], dtype=dtype)
        cases.append(([extremes], True))  # the largest finite values and subnormals are finite
        for bad in (float("nan"), float("inf"), float("-inf")):
            # sizes around the kernel's chunk (2^14) and a multi-chunk tensor that threads share
            for n, at in ((1, 0), (100, 99), (1 << 14, (1 << 14) - 1), ((1 << 14) + 1, 1 << 14), (200_003, 150_001)):
                x = torch.randn(n, generator=gen).to(dtype)
                x[at] = bad
                cases.append(([torch.ones(3, dtype=dtype), x], False))
        cases.append(([torch.randn(200_003, generator=gen).to(dtype), torch.empty(0, dtype=dtype)], True))
        # a non-contiguous view: the bad value is in it; another lies outside it and must not count
        base = torch.randn(64, 64, generator=gen).to(dtype)
        base[5, 0] = float("nan")
        cases.append(([base[:, 1:]], True))
        cases.append(([base.t()[0:1]], False))
    return [([t.to(device) if t.is_contiguous() else _strided_copy(t, device) for t in tensors], expected)
            for tensors, expected in cases]


def _strided_copy(view: torch.Tensor, device) -> torch.Tensor:
    """``view`` on ``device`` with its strides and offset (``.to`` would make it contiguous), so that only the
    view's elements count there too."""
    base = view._base if view._base is not None else view
    return base.to(device).as_strided(view.shape, view.stride(), view.storage_offset())
