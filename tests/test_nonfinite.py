"""The deferred finite check (check_finite, issue 29): a step whose direction has a NaN or inf is skipped on the
device by the ops themselves (the schedule's 4th element, reference.schedule_values), and the ValueError comes later,
without a host read in the step. Checked here:

* every fused op, on every backend here, against its spec: a skipped step writes no bit of the parameters,
  momentum or norm scales, whatever NaN the direction holds, and NaN into the gap; skip = 0 is the 3-element step;
* gradient_step_ (an unconstrained group's step) against reference.gradient_step_, bit for bit;
* the optimizers: the bad step and every step until the error change nothing, the error names the bad step and
  comes when documented (on the CPU at that step; where the device answers later, at last_gap, state_dict or the
  first step() that finds the answer), and the run then goes on as if the bad step had never been tried;
* on a GPU, a default step under torch.cuda.set_sync_debug_mode("error") (skipped without one).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import _ops
from fgfw import reference as ref

import set_cases

CUDA = torch.cuda.is_available()
# (backend, device) pairs whose fused ops run here; the Triton ones are in test_triton*.py (the interpreter)
BACKENDS = [("torch", "cpu"), ("cpu", "cpu")] + [("cuda", "cuda")] * CUDA
STEPS = [("l1", None), ("linf", None), ("lp", 2.0), ("lp", 1.5), ("ksparse", 3)]
INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
          torch.bfloat16: torch.int16}


def bits(tensors):
    """The tensors' bits (a -0.0 differs from +0.0, a NaN's payload counts), on the CPU."""
    return [t.detach().cpu().contiguous().view(INT_OF[t.dtype]).clone() for t in tensors]


def run_op(backend, kind, param, schedule, params, moms, grads, coeffs, radii, global_ball, offsets, source,
           row_numel, scales, gap):
    distribution = ref.RADEMACHER if source == "rademacher" else ref.GAUSSIAN
    if kind == "l1":
        _ops.l1_fw_step_(params, moms, grads, schedule, coeffs, radii, global_ball, offsets, 5, distribution, gap,
                         backend, row_numel)
    else:
        _ops.set_fw_step_(kind, params, moms, grads, schedule, coeffs, [float(r) for r in radii], global_ball,
                          offsets, 5, distribution, gap, backend, list(row_numel), param, scales)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("kind,param", STEPS)
@pytest.mark.parametrize("source", ["grad", "rademacher"])
@pytest.mark.parametrize("scope", ["tensor", "row", "global"])
def test_a_skipped_step_writes_no_bit_and_a_nan_gap(backend, device, kind, param, source, scope):
    params, moms, grads, coeffs, row_numel, radii, offsets = set_cases.inputs(torch.float32, True, source, scope,
                                                                              device)
    params[0].view(-1)[0] = -0.0  # a signed zero must keep its sign
    if grads:
        grads[0].view(-1)[3] = math.nan  # what a skipped step is for: the direction is not read into anything
        grads[2].view(-1)[1] = -math.inf
    else:
        coeffs = torch.tensor([math.nan, 1.0], dtype=torch.float64, device=device)
    scales = set_cases.scales_for(scope, device) if kind in ("lp", "ksparse") else []
    before = bits(params + moms + scales)
    gap = torch.zeros((), dtype=torch.float64, device=device)
    schedule = torch.tensor([3.0, 0.2, 0.4, 3.0], dtype=torch.float64, device=device)
    run_op(backend, kind, param, schedule, params, moms, grads, coeffs, radii, scope == "global", offsets, source,
           row_numel, scales, gap)
    after = bits(params + moms + scales)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert math.isnan(float(gap))


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("kind,param", STEPS)
def test_skip_zero_is_the_three_element_step(backend, device, kind, param):
    runs = []
    for schedule in ([3.0, 0.2, 0.4], [3.0, 0.2, 0.4, 0.0]):
        params, moms, grads, coeffs, row_numel, radii, offsets = set_cases.inputs(torch.float32, True, "grad", "row",
                                                                                  device)
        scales = set_cases.scales_for("row", device) if kind in ("lp", "ksparse") else []
        gap = torch.zeros((), dtype=torch.float64, device=device)
        run_op(backend, kind, param, torch.tensor(schedule, dtype=torch.float64, device=device), params, moms, grads,
               coeffs, radii, False, offsets, "grad", row_numel, scales, gap)
        runs.append((bits(params + moms + scales), float(gap)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert runs[0][1] == runs[1][1] and math.isfinite(runs[0][1])


def test_a_schedule_of_another_length_is_refused():
    params, moms, grads, coeffs, row_numel, radii, offsets = set_cases.inputs(torch.float32, False, "grad", "tensor",
                                                                              "cpu")
    gap = torch.zeros((), dtype=torch.float64)
    for backend in ("cpu", "torch"):
        with pytest.raises((RuntimeError, ValueError), match=r"\(step, alpha, gamma\) or \(step, alpha, gamma, skip\)"):
            _ops.l1_fw_step_(params, moms, grads, torch.zeros(5, dtype=torch.float64), coeffs, radii, False, offsets,
                             5, 0, gap, backend)


# -- gradient_step_: an unconstrained group's step ---------------------------------------------------------------------
SHAPES = [(7, 33), (5,), (0,), (3, 4, 5), (40_000,)]


def gradient_inputs(dtype, momentum, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda s: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(device)  # noqa: E731
    return ([draw(s) for s in SHAPES], [draw(s) for s in SHAPES] if momentum else [], [draw(s) for s in SHAPES])


@pytest.mark.parametrize("backend,device", [b for b in BACKENDS if b[0] != "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("momentum", [False, True])
def test_gradient_step_is_the_reference_bit_for_bit(backend, device, dtype, momentum):
    # alpha and gamma that round differently in float32 and float64, and a schedule that skips nothing (0.0)
    for schedule in ([4.0, 0.1, 1 / 3], [9.0, 0.0123, 0.7, 0.0]):
        runs = []
        for step in (lambda *a: ref.gradient_step_(*a), lambda *a: _ops.gradient_step_(*a, backend)):
            params, moms, grads = gradient_inputs(dtype, momentum, device)
            step(params, moms, grads, torch.tensor(schedule, dtype=torch.float64, device=device))
            runs.append(bits(params + moms))
        assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("momentum", [False, True])
def test_a_skipped_gradient_step_writes_no_bit(backend, device, momentum):
    params, moms, grads = gradient_inputs(torch.float32, momentum, device)
    params[1][0] = -0.0
    grads[0][0, 0] = math.nan
    before = bits(params + moms)
    _ops.gradient_step_(params, moms, grads, torch.tensor([2.0, 0.5, 0.5, 2.0], dtype=torch.float64, device=device),
                        backend)
    assert all(torch.equal(a, b) for a, b in zip(before, bits(params + moms)))


def test_gradient_step_refuses_bad_arguments():
    params, moms, grads = gradient_inputs(torch.float32, True, "cpu")
    schedule = torch.tensor([1.0, 0.1, 0.5], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="grads must hold one direction per parameter"):
        torch.ops.fgfw.gradient_step_(params, moms, grads[:-1], schedule)
    with pytest.raises(RuntimeError, match=r"momentum\[1\] must have dtype"):
        torch.ops.fgfw.gradient_step_(params, [moms[0], moms[1].double()] + moms[2:], grads, schedule)
    with pytest.raises(RuntimeError, match="params must be float32 or float64"):
        torch.ops.fgfw.gradient_step_([p.half() for p in params], [], [g.half() for g in grads], schedule)
    with pytest.raises(RuntimeError, match="schedule must be a contiguous float64 tensor"):
        torch.ops.fgfw.gradient_step_(params, moms, grads, schedule.float())


# -- the optimizers ----------------------------------------------------------------------------------------------------
def model_and_batch(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    return model, torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def groups(model, centred=False):
    """An L1 ball per weight (centred at the start if asked), the biases and the LayerNorm unconstrained."""
    weights = [model[0].weight, model[3].weight]
    rest = [p for p in model.parameters() if all(p is not w for w in weights)]
    ball = {"params": weights, "constraint": fgfw.L1Ball(radius=30.0)}
    if centred:
        ball["center"] = "init"
    return [ball, {"params": rest, "constraint": None, "step_size": 0.05}]


def make(kind, model, centred=False):
    if kind == "fw":
        return fgfw.FrankWolfe(groups(model, centred), constraint=fgfw.L1Ball(radius=30.0), momentum=0.9,
                               step_size=0.1)
    return fgfw.AFGFW(model, groups(model, centred), constraint=fgfw.L1Ball(radius=30.0), seed=3, step_size=0.1,
                      estimator="activity" if kind == "activity" else "weight")


def take_step(kind, opt, model, x, y, poison=False):
    scale = math.nan if poison else 1.0
    if kind == "fw":
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * scale).backward()
        return opt.step()
    reduction = "none" if kind == "activity" else "mean"
    return opt.step(lambda: F.cross_entropy(model(x), y, reduction=reduction) * scale)


def everything(model, opt):
    """The bits of the parameters and of every tensor of the optimizer's state, and the step counter."""
    tensors = list(model.parameters()) + [t for s in opt.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor)]
    return bits(tensors), int(opt._step_count_k)


def same(a, b):
    return a[1] == b[1] and len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))


@pytest.mark.parametrize("kind", ["fw", "afgfw", "activity"])
@pytest.mark.parametrize("centred", [False, True])
def test_on_the_cpu_the_bad_step_raises_changes_nothing_and_the_run_goes_on(kind, centred):
    """The twin never sees the bad step: after the error the two runs are the same, bit for bit."""
    model, x, y = model_and_batch()
    twin, _, _ = model_and_batch()
    opt, twin_opt = make(kind, model, centred), make(kind, twin, centred)
    for _ in range(2):
        take_step(kind, opt, model, x, y)
        take_step(kind, twin_opt, twin, x, y)
    before = everything(model, opt)
    with pytest.raises(ValueError, match=r"not finite at step k=3: that step"):
        take_step(kind, opt, model, x, y, poison=True)
    # a centred ball subtracts and adds back 0: values equal, bits too here (no -0.0 among the weights)
    assert same(before, everything(model, opt))
    for _ in range(2):
        take_step(kind, opt, model, x, y)
        take_step(kind, twin_opt, twin, x, y)
    assert same(everything(model, opt), everything(twin, twin_opt))
    assert float(opt.last_gap) == float(twin_opt.last_gap)


@pytest.mark.parametrize("kind", ["fw", "afgfw"])
def test_where_the_answer_comes_later_every_step_is_skipped_until_the_error(kind, monkeypatch):
    """A GPU's step() raises only once the device is past the bad step; here step() is made to find no answer
    (as a GPU still busy would), so the steps after the bad one run too: on the device, skipped. The error then
    comes from last_gap, naming the bad step, and the run goes on as the twin's."""
    model, x, y = model_and_batch()
    twin, _, _ = model_and_batch()
    opt, twin_opt = make(kind, model), make(kind, twin)
    take_step(kind, opt, model, x, y)
    take_step(kind, twin_opt, twin, x, y)
    before = everything(model, opt)
    report = opt._report_nonfinite
    monkeypatch.setattr(opt, "_report_nonfinite", lambda wait: report(wait) if wait else None)
    take_step(kind, opt, model, x, y, poison=True)
    take_step(kind, opt, model, x, y)  # finite, but after a bad step not yet reported: skipped
    take_step(kind, opt, model, x, y)
    assert same(before, everything(model, opt))
    with pytest.raises(ValueError, match=r"not finite at step k=2"):
        opt.last_gap
    opt.state_dict()  # reported: nothing pending
    take_step(kind, opt, model, x, y)
    take_step(kind, twin_opt, twin, x, y)
    assert same(everything(model, opt), everything(twin, twin_opt))


def test_state_dict_raises_a_pending_error_and_load_state_dict_drops_it(monkeypatch):
    model, x, y = model_and_batch()
    opt = make("fw", model)
    take_step("fw", opt, model, x, y)
    saved = opt.state_dict()
    report = opt._report_nonfinite
    monkeypatch.setattr(opt, "_report_nonfinite", lambda wait: report(wait) if wait else None)
    take_step("fw", opt, model, x, y, poison=True)
    with pytest.raises(ValueError, match=r"a gradient was not finite at step k=2"):
        opt.state_dict()
    take_step("fw", opt, model, x, y, poison=True)
    opt.load_state_dict(saved)  # the pending error belonged to the run the state replaces
    take_step("fw", opt, model, x, y)
    assert int(opt._step_count_k) == 2


def test_without_the_check_a_nan_spreads():
    model, x, y = model_and_batch()
    opt = fgfw.FrankWolfe(groups(model), constraint=fgfw.L1Ball(radius=30.0), momentum=0.9, step_size=0.1,
                          check_finite=False)
    take_step("fw", opt, model, x, y, poison=True)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_the_check_adds_no_op_per_tensor():
    """The finite check and the skip are device ops whose number does not grow with the model (bench/op_count.py's
    gate covers the whole step); here: one more layer, the same number of dispatched ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for depth in (1, 4):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(8, 8), nn.LayerNorm(8))])
        weights = [m.weight for m in model if isinstance(m, nn.Linear)]
        rest = [p for p in model.parameters() if all(p is not w for w in weights)]
        opt = fgfw.FrankWolfe([{"params": weights, "constraint": fgfw.L1Ball(radius=5.0)},
                               {"params": rest, "constraint": None}], constraint=fgfw.L1Ball(radius=5.0),
                              momentum=0.9)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        Count.n = 0
        with Count():
            opt.step()
        counts.append(Count.n)
    assert counts[0] == counts[1]


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("nonfinite_op", [False, True])  # the check in torch ops (default) or fgfw::nonfinite
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_gpu_step_never_synchronises_and_raises_at_the_next_step(backend, nonfinite_op, monkeypatch):
    if not _ops.backend_available(backend, "cuda"):
        pytest.skip(f"backend {backend!r} is not available here")
    if nonfinite_op and not _ops._has_kernel("nonfinite", "CUDA"):
        pytest.skip("fgfw._C has no CUDA nonfinite (built without csrc/cuda/nonfinite.cu)")
    monkeypatch.setattr(_ops, "CUDA_NONFINITE_OP", nonfinite_op)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()
    weights = [model[0].weight, model[2].weight]
    rest = [p for p in model.parameters() if all(p is not w for w in weights)]
    opt = fgfw.FrankWolfe([{"params": weights, "constraint": fgfw.L1Ball(radius=30.0)},
                           {"params": rest, "constraint": None}], constraint=fgfw.L1Ball(radius=30.0),
                          momentum=0.9, backend=backend)
    x = torch.randn(32, 64, device="cuda")

    def step(scale):
        opt.zero_grad()
        (model(x).square().mean() * scale).backward()
        opt.step()

    step(1.0)  # the first step makes the state (and the pinned copy): outside the debug mode
    torch.cuda.synchronize()
    before = everything(model, opt)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(1.0)
        step(math.nan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert everything(model, opt)[1] == before[1] + 1  # the finite step counted, the bad one not
    with pytest.raises(ValueError, match=r"a gradient was not finite at step k=3"):
        step(1.0)


def test_a_compiled_step_keeps_the_check_whole():
    """fullgraph=True with check_finite on (it broke the graph when the check read the host): the compiled step
    skips the bad step and the good one behind it, on the device, and last_gap raises it; the parameters are the
    eager run's after its two good steps (a compiled step gives the eager CPU step's bits: test_compile.py)."""
    model, x, y = model_and_batch()
    twin, _, _ = model_and_batch()
    opt, twin_opt = make("fw", model), make("fw", twin)
    step = torch.compile(opt.step, fullgraph=True)
    for i in range(4):
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * (math.nan if i == 2 else 1.0)).backward()
        step()
        if i < 2:
            take_step("fw", twin_opt, twin, x, y)
    with pytest.raises(ValueError, match=r"a gradient was not finite at step k=3"):
        opt.last_gap
    assert same(everything(model, opt), everything(twin, twin_opt))


def test_the_device_verdict_is_the_reference_on_every_path():
    """_ops.nonfinite: the fused op's answer on the CPU (complex tensors as their real pairs), the multi-tensor sums
    elsewhere (the GPU's default path, run here on CPU tensors), against reference.all_finite; float64 values whose
    sum overflows are finite."""
    big = torch.full((5,), 1e308, dtype=torch.float64)
    cases = [[torch.ones(3), big], [torch.ones(3), big.clone().index_fill_(0, torch.tensor([2]), math.inf)],
             [torch.tensor([1.0, math.nan], dtype=torch.float16), torch.arange(4)],
             [torch.zeros(0), torch.tensor([60000.0] * 3, dtype=torch.float16)],
             [torch.tensor([1 + 2j, complex(math.nan, 0)])], [torch.arange(3)]]
    for tensors in cases:
        want = ref.all_finite(tensors)
        assert bool(_ops._finite_multi_tensor(tensors, torch.device("cpu"))) == want
        assert bool(_ops.nonfinite(tensors, torch.device("cpu"))) == (not want)
