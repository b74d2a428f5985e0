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
    # The parameters see the direction d only through its argmax and sign (theta <- keep theta, then the vertex
    # element from -r sign d_i* and the ball's norm sums), so they are equal bit for bit with either tangent: with
    # Rademacher ones every input of the step is the reference's bit for bit, and with Gaussian ones a few
    # float32 ulps in d move no argmax here (a move would be a step to another vertex, which no tolerance
    # would absorb).
    for p, q in zip(params_ref, params_cpu):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    if tangent == "rademacher":
        # the same float64 terms summed in another order: a few ulps of float64 (2e-16 measured)
        assert gaps_cpu == pytest.approx(gaps_ref, rel=1e-13, abs=0)
    else:
        # Gaussian tangents within 8 float32 ulps (4.8e-7) of the reference's (tests/test_properties.py,
        # TANGENT_ULPS): so are the JVP coefficients and d, hence the gap (2.4e-7 measured)
        assert gaps_cpu == pytest.approx(gaps_ref, rel=1e-6, abs=0)


def test_import_registers_the_compiled_ops():
    if not fgfw.HAS_COMPILED_EXTENSION:
        pytest.skip("the compiled extension fgfw._C is not built")
    names = set(torch._C._dispatch_get_all_op_names())
    assert {"fgfw::fill_tangent_", "fgfw::l1_fw_step_"} <= names
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::l1_fw_step_", "CPU")


def test_triton_launchers_called_by_name_in_a_fresh_process():
    # torch.ops.fgfw_triton is registered by importing fgfw.triton: calling the op layer with
    # backend="triton" before anything imported it raised AttributeError
    import subprocess
    import sys
    pytest.importorskip("triton")
    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
            "import torch\nfrom fgfw import _ops, reference\n"
            "out = torch.empty(7)\n_ops.fill_tangent_(out, 1, 2, 0, 3, 1, 'triton')\n"
            "assert torch.equal(out, reference.tangent(7, 1, 2, 0, 3, 1))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
