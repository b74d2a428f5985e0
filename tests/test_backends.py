"""Backend selection, and whole optimizer trajectories agreeing across backends."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fgfw
from fgfw import _ops


def test_auto_prefers_the_compiled_kernel_on_the_cpu(monkeypatch):
    monkeypatch.delenv(_ops.BACKEND_ENV_VAR, raising=False)
    expected = "cpu" if _ops.backend_available("cpu", "cpu") else "torch"
    assert fgfw.resolve_backend(None, "cpu") == expected
    assert fgfw.resolve_backend("auto", "cpu") == expected
    assert fgfw.available_backends("cpu")[-1] == "torch"


def test_environment_variable_is_honoured_and_checked(monkeypatch):
    monkeypatch.setenv(_ops.BACKEND_ENV_VAR, "torch")
    assert fgfw.resolve_backend(None, "cpu") == "torch"
    # an explicit "auto" chooses by availability, whatever the environment says
    assert fgfw.resolve_backend("auto", "cpu") == ("cpu" if _ops.backend_available("cpu", "cpu") else "torch")
    monkeypatch.setenv(_ops.BACKEND_ENV_VAR, "vulkan")
    with pytest.raises(ValueError, match=_ops.BACKEND_ENV_VAR):
        fgfw.resolve_backend(None, "cpu")


def test_a_named_backend_that_cannot_run_is_an_error_not_a_fallback():
    with pytest.raises(ValueError, match="not available"):
        fgfw.resolve_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="backend"):
        fgfw.resolve_backend("opencl", "cpu")


def _trajectory(backend, tangent, dtype=torch.float64, steps=5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 7), nn.ReLU(), nn.Linear(7, 4)).to(dtype)
    gen = torch.Generator().manual_seed(1)
    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=20.0), seed=7, step_size=0.1, tangent=tangent,
                     num_tangents=2, backend=backend)
    gaps = []
    for _ in range(steps):
        x = torch.randn(32, 9, generator=gen, dtype=dtype)
        y = torch.randint(0, 4, (32,), generator=gen)
        opt.step(lambda: F.cross_entropy(model(x), y))
        gaps.append(float(opt.last_gap))
    return [p.detach().clone() for p in model.parameters()], gaps


@pytest.mark.parametrize("tangent", ["gaussian", "rademacher"])
def test_cpu_kernel_trajectory_equals_the_reference(tangent):
    if not _ops.backend_available("cpu", "cpu"):
        pytest.skip("the compiled extension fgfw._C is not built")
    params_ref, gaps_ref = _trajectory("torch", tangent)
    params_cpu, gaps_cpu = _trajectory("cpu", tangent)
    for p, q in zip(params_ref, params_cpu):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
    assert gaps_cpu == pytest.approx(gaps_ref, rel=1e-6)


def test_import_registers_the_compiled_ops():
    if not fgfw.HAS_COMPILED_EXTENSION:
        pytest.skip("the compiled extension fgfw._C is not built")
    names = set(torch._C._dispatch_get_all_op_names())
    assert {"fgfw::fill_tangent_", "fgfw::l1_fw_step_"} <= names
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::l1_fw_step_", "CPU")
