"""The tangent stream: Philox4x32-10 known answers, the mapping of docs/tangent_stream.md, and the compiled
fill_tangent_ kernels (CPU, CUDA) against fgfw.reference on the same arguments.

Rademacher tangents (one bit of each Philox word) must agree bit for bit, which checks the C++
Philox on every element; Gaussian tangents within a tight tolerance (log/sin/cos differ by an ulp).
Within one backend, fill_tangent_ (the JVP's u) and l1_fw_step_ (the update's u) agree bit for bit.
"""
import math

import pytest
import torch

from fgfw import reference as ref

GAUSSIAN, RADEMACHER = ref.GAUSSIAN, ref.RADEMACHER
GAUSSIAN_ATOL = 1e-5

# Random123's known-answer vectors for Philox4x32-10: (counter, key, output words).
PHILOX_KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

# (numel, seed, step, tangent_id, offset): odd sizes, offsets that are not multiples of 4, a call
# counter above 2^32 (its high word in use), negative seed and step (two's complement), a step and
# a tangent id above 2^32 (taken modulo 2^32).
STREAM_CASES = [
    (1, 0, 0, 0, 0),
    (1, 7, 3, 1, 5),
    (3, 123, 1, 0, 2),
    (4, 5, 9, 2, 4),
    (4097, 42, 17, 3, 1),
    (4097, -1, -5, 0, 6),
    (100_003, 2**40 + 11, 2**32 + 7, 2**32 + 1, 3),
    (515, 9, 1, 0, 4 * 2**32 + 2),
]


def _kat_words_as_stream_inputs():
    """KAT 1 is the stream's call q=0 for seed 0, step 0, tangent 0: its words are elements 0..3."""
    counter, key, words = PHILOX_KATS[0]
    assert counter == (0, 0, 0, 0) and key == (0, 0)
    return words


def _expected_from_words(words, distribution):
    """The mapping of docs/tangent_stream.md written independently of reference.py, in float64 arithmetic."""
    if distribution == RADEMACHER:
        return [1.0 if w >> 31 == 0 else -1.0 for w in words]
    u = [((w >> 8) + 0.5) * 2.0**-24 for w in words]
    values = []
    for pair in (0, 2):
        radius = math.sqrt(-2.0 * math.log(u[pair]))
        angle = 2.0 * math.pi * u[pair + 1]
        values += [radius * math.cos(angle), radius * math.sin(angle)]
    return values


def _fill(ops, numel, seed, step, tangent_id, offset, distribution, dtype=torch.float32, device="cpu"):
    out = torch.full((numel,), float("nan"), dtype=dtype, device=device)
    ops.fill_tangent_(out, seed, step, tangent_id, offset, distribution)
    return out


def _assert_matches_reference(out, numel, seed, step, tangent_id, offset, distribution):
    expected = ref.tangent(numel, seed, step, tangent_id, offset, distribution).to(out.dtype)
    out = out.cpu()
    if distribution == RADEMACHER:
        assert torch.equal(out, expected)
    else:
        # float32 values an ulp apart may round to neighbouring values of a narrower output dtype
        rtol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(out.dtype, 0)
        torch.testing.assert_close(out, expected, atol=GAUSSIAN_ATOL, rtol=rtol)


# ---- the reference (always runs) ---------------------------------------------------------------

@pytest.mark.parametrize("counter,key,expected", PHILOX_KATS)
def test_reference_philox_known_answers(counter, key, expected):
    words = ref.philox4x32_10(counter, key)
    assert [int(w) for w in words] == list(expected)


def test_reference_philox_vectorised_equals_single_calls():
    counters = torch.tensor([0, 1, 2**32 - 1, 12345], dtype=torch.int64)
    batch = ref.philox4x32_10((counters, 7, 3, 2), (11, 13))
    for n, c in enumerate(counters.tolist()):
        single = ref.philox4x32_10((c, 7, 3, 2), (11, 13))
        assert [int(w[n]) for w in batch] == [int(w) for w in single]


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_reference_stream_follows_design_mapping(distribution):
    words = _kat_words_as_stream_inputs()
    got = ref.tangent(4, seed=0, step=0, tangent_id=0, offset=0, distribution=distribution)
    expected = torch.tensor(_expected_from_words(words, distribution), dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)


def test_reference_offsets_compose():
    whole = ref.tangent(23, 5, 2, 1, offset=3)
    parts = torch.cat([ref.tangent(6, 5, 2, 1, offset=3), ref.tangent(17, 5, 2, 1, offset=9)])
    assert torch.equal(whole, parts)


@pytest.mark.parametrize("distribution", [ref.GAUSSIAN, ref.RADEMACHER])
def test_reference_runs_on_the_device_of_its_tensors(distribution):
    """The spec must run where the kernels run: its int counter words become tensors on the device of
    q, not CPU tensors (which failed on CUDA). The meta device stands in for a GPU here: any
    CPU tensor meeting a meta one raises just as it would against a CUDA one."""
    u = ref.tangent(9, 5, 7, 0, offset=2, distribution=distribution, device="meta")
    assert u.device.type == "meta" and u.shape == (9,) and u.dtype == torch.float32
    param = torch.empty(3, 5, device="meta")
    g = ref.direction(param, None, torch.ones(2, dtype=torch.float64, device="meta"), 5, 7, 4, distribution)
    assert g.device.type == "meta" and g.shape == (15,)


def test_reference_gaussian_moments():
    u = ref.tangent(1_000_000, seed=3, step=1, tangent_id=0).double()
    assert abs(u.mean().item()) < 5e-3
    assert abs(u.var().item() - 1) < 5e-3


def test_reference_rademacher_values_and_mean():
    u = ref.tangent(1_000_000, seed=3, step=1, tangent_id=0, distribution=RADEMACHER)
    assert set(u.unique().tolist()) == {-1.0, 1.0}
    assert abs(u.double().mean().item()) < 5e-3


# ---- the compiled CPU kernel -------------------------------------------------------------------

@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_cpu_known_answer_words(fgfw_ops, distribution):
    got = _fill(fgfw_ops, 4, 0, 0, 0, 0, distribution).double()
    expected = torch.tensor(_expected_from_words(_kat_words_as_stream_inputs(), distribution), dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("numel,seed,step,tangent_id,offset", STREAM_CASES)
def test_cpu_matches_reference(fgfw_ops, numel, seed, step, tangent_id, offset, distribution):
    out = _fill(fgfw_ops, numel, seed, step, tangent_id, offset, distribution)
    _assert_matches_reference(out, numel, seed, step, tangent_id, offset, distribution)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_cpu_output_dtypes(fgfw_ops, dtype, distribution):
    out = _fill(fgfw_ops, 4097, 11, 2, 1, 3, distribution, dtype=dtype)
    _assert_matches_reference(out, 4097, 11, 2, 1, 3, distribution)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_cpu_non_contiguous_out_in_logical_order(fgfw_ops, distribution):
    out = torch.zeros(6, 9).t()
    fgfw_ops.fill_tangent_(out, 4, 1, 0, 2, distribution)
    expected = torch.zeros(6, 9).t()
    ref.fill_tangent_(expected, 4, 1, 0, 2, distribution)
    atol = 0 if distribution == RADEMACHER else GAUSSIAN_ATOL
    torch.testing.assert_close(out, expected, atol=atol, rtol=0)


def test_cpu_offsets_compose_bit_exactly(fgfw_ops):
    whole = _fill(fgfw_ops, 4097, 8, 3, 2, 1, GAUSSIAN)
    parts = torch.cat([_fill(fgfw_ops, 5, 8, 3, 2, 1, GAUSSIAN), _fill(fgfw_ops, 4092, 8, 3, 2, 6, GAUSSIAN)])
    assert torch.equal(whole, parts)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tangent_id", [0, 1])
def test_cpu_fill_equals_the_tangent_l1_fw_step_regenerates(fgfw_ops, tangent_id, dtype, distribution):
    """The JVP's u (fill_tangent_) and the update's u (l1_fw_step_) are one stream, bit for bit.

    With v = 0, gamma = 1 and coefficient 1 on tangent `tangent_id` (0 on any before it), the step
    sets v = 0 * 0 + 1 * (0 * u_0 + 1 * u_id) = u_id exactly; alpha = 0 leaves theta alone.
    """
    seed, step = 2**40 + 9, 17
    cases = [(numel, offset) for numel in (1, 5, 4097, 100_003) for offset in (0, 3, 8, 2**33 + 1)]
    params = [torch.randn(numel, dtype=dtype) for numel, _ in cases]
    momentum = [torch.zeros(numel, dtype=dtype) for numel, _ in cases]
    coeffs = torch.zeros(tangent_id + 1, dtype=torch.float64)
    coeffs[tangent_id] = 1.0
    schedule = torch.tensor([step, 0.0, 1.0], dtype=torch.float64)
    fgfw_ops.l1_fw_step_(params, momentum, [], schedule, coeffs, [1.0] * len(cases), False,
                         [offset for _, offset in cases], seed, distribution, torch.zeros((), dtype=torch.float64))
    for v, (numel, offset) in zip(momentum, cases):
        assert torch.equal(v, _fill(fgfw_ops, numel, seed, step, tangent_id, offset, distribution, dtype=dtype)), \
            (numel, offset)


def test_cpu_independent_of_thread_count(fgfw_ops):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fill(fgfw_ops, 50_001, 1, 2, 0, 3, GAUSSIAN)
        torch.set_num_threads(2)
        two = _fill(fgfw_ops, 50_001, 1, 2, 0, 3, GAUSSIAN)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_cpu_gaussian_moments(fgfw_ops):
    u = _fill(fgfw_ops, 1_000_000, 3, 1, 0, 0, GAUSSIAN).double()
    assert torch.isfinite(u).all()
    assert abs(u.mean().item()) < 5e-3
    assert abs(u.var().item() - 1) < 5e-3


def test_cpu_rademacher_values_and_mean(fgfw_ops):
    u = _fill(fgfw_ops, 1_000_000, 3, 1, 0, 0, RADEMACHER)
    assert set(u.unique().tolist()) == {-1.0, 1.0}
    assert abs(u.double().mean().item()) < 5e-3


def test_cpu_empty_out_is_a_no_op(fgfw_ops):
    fgfw_ops.fill_tangent_(torch.empty(0), 1, 1, 0, 0, GAUSSIAN)


@pytest.mark.parametrize("out,offset,distribution,name", [
    (torch.empty(4), 0, 2, "distribution"),
    (torch.empty(4), -1, GAUSSIAN, "offset"),
    (torch.empty(4, dtype=torch.int32), 0, GAUSSIAN, "out"),
])
def test_cpu_bad_arguments_are_named(fgfw_ops, out, offset, distribution, name):
    with pytest.raises(RuntimeError, match=name):
        fgfw_ops.fill_tangent_(out, 0, 0, 0, offset, distribution)


def test_error_messages_carry_their_numbers(fgfw_ops):
    # A second, static libstdc++ inside the module (a toolchain that links it statically) breaks number
    # formatting in c10::str: a segfault on one machine, a message without its number on another.
    with pytest.raises(RuntimeError, match="offset must be >= 0, got -12345"):
        fgfw_ops.fill_tangent_(torch.empty(4), 0, 0, 0, -12345, GAUSSIAN)


def test_module_links_the_shared_libstdcxx(fgfw_ops):
    """fgfw._C must use the process's shared libstdc++ (see the note in CMakeLists.txt), never carry a copy."""
    import shutil
    import subprocess

    import fgfw._C
    if shutil.which("ldd") is None:
        pytest.skip("ldd is not installed")
    needed = subprocess.run(["ldd", fgfw._C.__file__], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in needed, needed


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_cpu_fill_at_a_step_tensor_equals_the_int_step(fgfw_ops, distribution):
    step = (1 << 33) + 17  # taken modulo 2^32 either way
    expected = torch.empty(37)
    fgfw_ops.fill_tangent_(expected, 9, step, 1, 6, distribution)
    out = torch.full((37,), float("nan"))
    fgfw_ops.fill_tangent_at_step_(out, 9, torch.tensor(step), 1, 6, distribution)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("step,name", [(torch.tensor(2.0), "int64"), (torch.tensor([1, 2]), "one element")])
def test_cpu_fill_at_step_rejects_a_bad_counter(fgfw_ops, step, name):
    with pytest.raises(RuntimeError, match=f"step must be an int64 tensor of one element.*"):
        fgfw_ops.fill_tangent_at_step_(torch.empty(4), 0, step, 0, 0, GAUSSIAN)


def _likes(device="cpu"):
    """Parameters of several shapes, dtypes and layouts (a channels-last 4-D one), and their places in a stream."""
    likes = [torch.zeros(3, 5, device=device), torch.zeros(7, dtype=torch.bfloat16, device=device),
             torch.zeros(2, 3, 4, dtype=torch.float64, device=device),
             torch.zeros(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)]
    return likes, [0, 16, 24, 52]


def _assert_tangents_are_one_fill_each(backend, device="cpu"):
    """tangents_at_step on ``backend``: new tensors laid out as their likes, each what fill_tangent_ at the same step
    writes into empty_like(like) on that backend (bit for bit), and that within the reference's tolerance."""
    from fgfw import _ops
    likes, offsets = _likes(device)
    step = torch.tensor(5, device=device)
    for distribution in (GAUSSIAN, RADEMACHER):
        ids = [1, 0, 3, 1]
        out = _ops.tangents_at_step(likes, 13, step, ids, offsets, distribution, backend)
        assert len(out) == len(likes)
        for like, tangent_id, offset, t in zip(likes, ids, offsets, out):
            assert (t.shape, t.dtype, t.device, t.stride()) == (like.shape, like.dtype, like.device, like.stride())
            assert t.data_ptr() != like.data_ptr() and not t.requires_grad
            one = _ops.fill_tangent_(torch.empty_like(like), 13, step, tangent_id, offset, distribution, backend)
            assert torch.equal(t, one)
            _assert_matches_reference(t.reshape(-1), like.numel(), 13, 5, tangent_id, offset, distribution)
        # one parameter's K tangents (the batched pass's draw): K tensors, each tangent t of that place
        out = _ops.tangents_at_step([likes[0]] * 3, 13, step, [0, 1, 2], [offsets[0]] * 3, distribution, backend)
        for t, tangent_id in zip(out, [0, 1, 2]):
            assert torch.equal(t, _ops.fill_tangent_(torch.empty_like(likes[0]), 13, step, tangent_id, offsets[0],
                                                     distribution, backend))
        assert not torch.equal(out[0], out[1])


def test_cpu_tangents_at_step_are_one_fill_each(fgfw_ops):
    _assert_tangents_are_one_fill_each("cpu")


def test_reference_tangents_at_step_are_one_fill_each():
    _assert_tangents_are_one_fill_each("torch")


def test_cpu_tangents_at_step_checks_its_arguments(fgfw_ops):
    likes, _ = _likes()
    with pytest.raises(RuntimeError, match="one offset per tensor of likes, got 2 offsets for 4 tensors"):
        fgfw_ops.tangents_at_step(likes, 0, torch.tensor(1), [0] * 4, [0, 4], GAUSSIAN)
    with pytest.raises(RuntimeError, match="one tangent id per tensor of likes, got 1 tangent ids for 4 tensors"):
        fgfw_ops.tangents_at_step(likes, 0, torch.tensor(1), [0], [0, 16, 24, 52], GAUSSIAN)
    with pytest.raises(RuntimeError, match="step must be an int64 tensor of one element"):
        fgfw_ops.tangents_at_step(likes, 0, torch.tensor(1.0), [0] * 4, [0, 16, 24, 52], GAUSSIAN)
    assert fgfw_ops.tangents_at_step([], 0, torch.tensor(1), [], [], GAUSSIAN) == []


def test_tangents_at_step_fake_describes_its_outputs(fgfw_ops):
    """The fake kernel (torch.compile traces with it) gives tensors laid out as the likes, without data."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        likes = [mode.from_tensor(t) for t in _likes()[0]]
        out = fgfw_ops.tangents_at_step(likes, 0, mode.from_tensor(torch.tensor(1)), [0] * 4, [0, 16, 24, 52],
                                        GAUSSIAN)
    assert [(t.shape, t.dtype, t.stride()) for t in out] == [(t.shape, t.dtype, t.stride()) for t in likes]


# ---- the CUDA kernel (skips without a GPU) -------------------------------------------------------

@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("numel,seed,step,tangent_id,offset", STREAM_CASES + [(3_000_001, 5, 2, 1, 7)])
def test_cuda_matches_reference(fgfw_cuda_ops, numel, seed, step, tangent_id, offset, distribution):
    out = _fill(fgfw_cuda_ops, numel, seed, step, tangent_id, offset, distribution, device="cuda")
    _assert_matches_reference(out, numel, seed, step, tangent_id, offset, distribution)


def test_cuda_tangents_at_step_are_one_fill_each(fgfw_cuda_ops):
    _assert_tangents_are_one_fill_each("cuda", "cuda")


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_cuda_output_dtypes(fgfw_cuda_ops, dtype, distribution):
    out = _fill(fgfw_cuda_ops, 4097, 11, 2, 1, 3, distribution, dtype=dtype, device="cuda")
    _assert_matches_reference(out, 4097, 11, 2, 1, 3, distribution)


def _launches_on_the_current_stream(launch, out: torch.Tensor) -> bool:
    """Whether ``launch()`` (which writes ``out``) ran on the current stream: a side stream is held behind
    ~0.1 s of spinning and made current for the launch; a snapshot of ``out`` taken at once on the default
    stream (not ordered after the side one) still holds the old values only if the launch waits on the side
    stream. A kernel launched on the default stream instead would be done before the snapshot."""
    out.fill_(float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        launch()
    snapshot = out.clone()  # on the default stream
    torch.cuda.current_stream().synchronize()
    untouched = bool(torch.isnan(snapshot).all())
    side.synchronize()
    return untouched


def test_cuda_equals_cpu_kernel_and_uses_current_stream(fgfw_cuda_ops):
    out = torch.empty(6, 9, device="cuda").t()
    assert _launches_on_the_current_stream(lambda: fgfw_cuda_ops.fill_tangent_(out, 4, 1, 0, 2, RADEMACHER), out)
    expected = torch.empty(6, 9).t()
    fgfw_cuda_ops.fill_tangent_(expected, 4, 1, 0, 2, RADEMACHER)
    assert torch.equal(out.cpu(), expected)
    # the check itself can fail: a write on the default stream is seen by the snapshot
    def on_default_stream():
        with torch.cuda.stream(torch.cuda.default_stream()):
            fgfw_cuda_ops.fill_tangent_(out, 4, 1, 0, 2, RADEMACHER)
    assert not _launches_on_the_current_stream(on_default_stream, out)


def test_cuda_step_uses_current_stream(fgfw_cuda_ops):
    params = [torch.zeros(10_000, device="cuda"), torch.zeros(7, 33, device="cuda")]
    schedule = torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64, device="cuda")
    coeffs = torch.tensor([0.5], dtype=torch.float64, device="cuda")
    gap = torch.empty((), dtype=torch.float64, device="cuda")

    def step():
        for p in params:
            p.zero_()
        fgfw_cuda_ops.l1_fw_step_(params, [], [], schedule, coeffs, [1.0, 1.0], False, [0, 10_000], 3, GAUSSIAN, gap,
                                  [])
    assert _launches_on_the_current_stream(step, gap)


@pytest.mark.parametrize("distribution", [GAUSSIAN, RADEMACHER])
def test_cuda_fill_at_a_device_step_equals_the_int_step_without_a_sync(fgfw_cuda_ops, distribution):
    step = (1 << 33) + 17
    expected = torch.empty(4099, device="cuda")
    fgfw_cuda_ops.fill_tangent_(expected, 9, step, 1, 6, distribution)
    counter = torch.tensor(step, device="cuda")
    out = torch.full((4099,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the kernel reads the counter: no device-to-host copy
    try:
        fgfw_cuda_ops.fill_tangent_at_step_(out, 9, counter, 1, 6, distribution)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, expected)
    on_host = torch.full((4099,), float("nan"), device="cuda")
    fgfw_cuda_ops.fill_tangent_at_step_(on_host, 9, counter.cpu(), 1, 6, distribution)
    assert torch.equal(on_host, expected)
