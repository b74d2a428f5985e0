"""Whole optimizer steps captured in a CUDA graph and replayed equal the same steps run eagerly.

A step is capturable when it makes no host-to-device copy and reads nothing on the host: the step
counter, the schedule (k, alpha_k, gamma_k) and the tangents' step live on the device and the step
advances them itself, so each replay is the next step, not a repeat of the captured one. Needs a GPU.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import _ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

WARMUP, CAPTURED, REPLAYS = 3, 3, 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4)).cuda()


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 12, generator=gen).cuda(), torch.randint(0, 4, (32,), generator=gen).cuda()


def _afgfw(model, backend):
    # named schedules only: a constant or callable would be fine too, but these exercise the device k
    return fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=4.0), seed=7, num_tangents=2, engine="lean",
                      backend=backend, check_finite=False)


def _frank_wolfe(model, backend):
    return fgfw.FrankWolfe(model.parameters(), constraint=fgfw.L1Ball(radius=4.0), momentum=0.8, backend=backend,
                           check_finite=False)


def _run(make_opt, kind, backend, *, graphed):
    """WARMUP eager steps, then CAPTURED * REPLAYS more: eagerly, or as REPLAYS replays of one graph holding
    CAPTURED steps. Returns the parameters, the last gap and the step counter."""
    model = _model()
    opt = make_opt(model, backend)
    x, y = _batch()

    def step():
        if kind == "forward":
            opt.step(lambda: F.cross_entropy(model(x), y))
        else:
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph docs ask
        for _ in range(WARMUP):
            step()
    torch.cuda.current_stream().wait_stream(side)
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CAPTURED):
                step()
        for _ in range(REPLAYS):
            graph.replay()
    else:
        for _ in range(CAPTURED * REPLAYS):
            step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()], opt.last_gap.clone(), int(opt._step_count_k)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("kind", ["forward", "backprop"])
def test_replayed_steps_equal_eager_steps(kind, backend):
    if not _ops.backend_available(backend, torch.device("cuda")):
        pytest.skip(f"backend {backend} is not available here")
    make_opt = _afgfw if kind == "forward" else _frank_wolfe
    eager = _run(make_opt, kind, backend, graphed=False)
    replayed = _run(make_opt, kind, backend, graphed=True)
    assert replayed[2] == eager[2] == WARMUP + CAPTURED * REPLAYS
    for p, q in zip(replayed[0], eager[0]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(replayed[1], eager[1], rtol=1e-6, atol=1e-9)
    # the replays moved the parameters: a graph that repeated one frozen step would still match above
    # only if every step were the same, which different tangents per step rule out
    assert not torch.equal(replayed[0][0], _model()[0].weight.detach())
