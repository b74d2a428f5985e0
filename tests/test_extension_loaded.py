"""The compiled extension fgfw._C: loaded when the test command expects it, and a failed import never silent.

A build whose module does not import (a stale build against another torch, a missing shared library)
used to leave fgfw on the reference backend: the kernel tests skipped and the optimizer tests ran the
pure-torch spec, so the suite passed with no kernel tested. These tests check that the reason is kept
(``fgfw._ops.extension_import_error``), shown where a backend that needs it is asked for by name, and
that the test session itself fails when ``FGFW_REQUIRE_EXTENSION=1`` (set by scripts/test.sh).

The broken and missing extensions are simulated in subprocesses, with a ``sitecustomize`` module put
first on ``PYTHONPATH``: one that makes the import of fgfw._C raise (as a module that cannot load does)
and one that hides it (as if it had never been built).
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fgfw
from fgfw import _ops

REPO = Path(__file__).resolve().parents[1]
SIMULATED_ERROR = "libc10_fgfw_test.so: cannot open shared object file (simulated broken fgfw._C)"

BROKEN = f"""
import importlib.abc, importlib.machinery, sys

class _BrokenExtension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # finds fgfw._C (the module is there) and fails to load it, like a module with a missing library
    def find_spec(self, name, path=None, target=None):
        if name == "fgfw._C":
            return importlib.machinery.ModuleSpec(name, self, origin="/simulated/fgfw/_C.so")
        return None

    def create_module(self, spec):
        raise ImportError({SIMULATED_ERROR!r})

    def exec_module(self, module):
        pass

sys.meta_path.insert(0, _BrokenExtension())
"""

MISSING = """
import sys
sys.modules["fgfw._C"] = None  # import fgfw._C raises ModuleNotFoundError: as if it had never been built
"""

# one quick test that needs nothing but fgfw: its session shows what the conftest does around it
QUICK_TEST = "tests/test_backends.py::test_auto_prefers_the_compiled_kernel_on_the_cpu"


def _environment(tmp_path: Path, shim: str | None, **flags: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FGFW_REQUIRE_EXTENSION", "FGFW_REQUIRE_CUDA_KERNELS", "FGFW_NO_SKIP_EVERYWHERE", "FGFW_BACKEND",
                        "PYTEST_ADDOPTS")}
    if shim is not None:
        shim_dir = tmp_path / "shim"
        shim_dir.mkdir(exist_ok=True)
        (shim_dir / "sitecustomize.py").write_text(textwrap.dedent(shim))
        env["PYTHONPATH"] = os.pathsep.join([str(shim_dir)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(flags)
    return env


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _pytest(env: dict, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_extension_state_is_recorded():
    """Loaded: no error and the module's file; not loaded: the ImportError that says why."""
    error = _ops.extension_import_error()
    assert (error is None) == fgfw.HAS_COMPILED_EXTENSION
    if error is None:
        assert Path(_ops.extension_file()).is_file()
    else:
        assert isinstance(error, ImportError) and _ops.extension_file() is None


def test_the_extension_is_loaded_when_the_test_command_expects_it():
    """Under scripts/test.sh (FGFW_REQUIRE_EXTENSION=1) the CPU kernels, and where nvcc built them, the CUDA ones."""
    if os.environ.get("FGFW_REQUIRE_EXTENSION", "0") in ("", "0"):
        pytest.skip("FGFW_REQUIRE_EXTENSION is not set (scripts/test.sh sets it)")
    assert fgfw.HAS_COMPILED_EXTENSION, f"fgfw._C failed to import: {_ops.extension_import_error()!r}"
    assert _ops.backend_available("cpu", "cpu")
    assert fgfw.resolve_backend(None, "cpu") == "cpu" or os.environ.get(_ops.BACKEND_ENV_VAR)
    if os.environ.get("FGFW_REQUIRE_CUDA_KERNELS", "0") not in ("", "0"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::l1_fw_step_", "CUDA")


def test_a_failed_import_is_kept_and_reported_by_resolve_backend(tmp_path):
    result = _python("""
        import fgfw
        from fgfw import _ops
        assert not fgfw.HAS_COMPILED_EXTENSION
        print("recorded:", repr(_ops.extension_import_error()))
        assert fgfw.resolve_backend(None, "cpu") == "torch"  # auto still falls back: only a named backend is refused
        for backend in ("cpu", "cuda"):
            try:
                fgfw.resolve_backend(backend, "cpu")
            except ValueError as err:
                print(f"{backend}:", err)
        """, _environment(tmp_path, BROKEN))
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert SIMULATED_ERROR in lines["recorded"]
    assert "not available" in lines["cpu"] and SIMULATED_ERROR in lines["cpu"]
    assert "fgfw._C failed to import" in lines["cpu"]
    assert "not available" in lines["cuda"]


def test_a_missing_extension_is_reported_as_not_built(tmp_path):
    result = _python("""
        import fgfw
        try:
            fgfw.resolve_backend("cpu", "cpu")
        except ValueError as err:
            print(err)
        """, _environment(tmp_path, MISSING))
    assert result.returncode == 0, result.stderr
    assert "fgfw._C is not built" in result.stdout and "pip install --no-build-isolation" in result.stdout


def test_a_broken_extension_fails_the_test_session_loudly(tmp_path):
    """FGFW_REQUIRE_EXTENSION=1 and a module that does not import: the session stops before any test runs."""
    result = _pytest(_environment(tmp_path, BROKEN, FGFW_REQUIRE_EXTENSION="1"), QUICK_TEST)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert SIMULATED_ERROR in output and "fgfw._C is there but failed to import" in output
    assert "fgfw backends: cpu: fgfw._C not loaded" in output
    assert " passed" not in output and " skipped" not in output


def test_a_broken_extension_fails_the_session_even_when_not_required(tmp_path):
    """A module that is there but does not import is a broken build: never a skip."""
    result = _pytest(_environment(tmp_path, BROKEN), QUICK_TEST)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert SIMULATED_ERROR in output and " passed" not in output


def test_a_missing_extension_fails_only_when_required(tmp_path):
    required = _pytest(_environment(tmp_path, MISSING, FGFW_REQUIRE_EXTENSION="1"), QUICK_TEST)
    output = required.stdout + required.stderr
    assert required.returncode != 0 and "fgfw._C is not built" in output and " passed" not in output, output
    # a source checkout without a build (no FGFW_REQUIRE_EXTENSION): the kernel tests skip and say why
    optional = _pytest(_environment(tmp_path, MISSING), QUICK_TEST,
                       "tests/test_backends.py::test_import_registers_the_compiled_ops", "-rs")
    output = optional.stdout + optional.stderr
    assert optional.returncode == 0, output
    assert "1 passed, 1 skipped" in output and "fgfw backends: cpu: fgfw._C not loaded" in output


def test_cuda_kernels_are_required_where_nvcc_built_them(tmp_path):
    """FGFW_REQUIRE_CUDA_KERNELS=1 (scripts/test.sh sets it when nvcc was there at build time) and no CUDA kernels."""
    if not fgfw.HAS_COMPILED_EXTENSION:
        pytest.skip(f"fgfw._C is not loaded here ({_ops.extension_import_error()})")
    if torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::l1_fw_step_", "CUDA"):
        pytest.skip("this build of fgfw._C has the CUDA kernels")
    result = _pytest(_environment(tmp_path, None, FGFW_REQUIRE_EXTENSION="1", FGFW_REQUIRE_CUDA_KERNELS="1"),
                     QUICK_TEST)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "FGFW_REQUIRE_CUDA_KERNELS" in output and "without CUDA kernels" in output and " passed" not in output


def test_the_session_summary_names_the_backends(tmp_path):
    result = _pytest(_environment(tmp_path, None), QUICK_TEST)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    line = next(line for line in output.splitlines() if line.startswith("fgfw backends: "))
    if fgfw.HAS_COMPILED_EXTENSION:
        assert f"cpu (fgfw._C loaded from {_ops.extension_file()})" in line
    assert "cuda kernels registered: " in line and "triton: " in line and "GPU: " in line
    if not torch.cuda.is_available():
        assert line.endswith("GPU: none")


# -- an extension built for another torch ------------------------------------------------------------------------
class _Built:
    def __init__(self, torch_version: str, cuda_version: str = ""):
        self.TORCH_VERSION, self.CUDA_VERSION = torch_version, cuda_version


@pytest.mark.parametrize("built, running, cuda, refused", [
    (_Built("2.14.1+cu130", "13.0"), "2.14.1+cu130", "13.0", ""),
    (_Built("2.14.1"), "2.14.1+cpu", None, ""),  # local labels do not count
    (_Built("2.14.1+cu130", "13.0"), "2.14.0+cu130", "13.0", "built for torch 2.14.1, this process has torch 2.14.0"),
    (_Built("2.14.1+cu130", "13.0"), "2.14.1+cpu", None, "has CUDA kernels (built with CUDA 13.0)"),
    (None, "2.14.1", None, ""),  # a source tree never built: nothing to compare
])
def test_build_mismatch_says_which_torch_and_what_to_install(built, running, cuda, refused):
    reason = _ops.build_mismatch(running, cuda, built)
    assert (reason == "") == (refused == "")
    assert refused in reason
    if refused.startswith("built for"):
        assert "pip install --no-build-isolation ." in reason and "+torch2.14.0" in reason


def test_the_build_records_the_torch_it_was_built_against():
    if not fgfw.HAS_COMPILED_EXTENSION:
        pytest.skip(f"fgfw._C is not loaded: {_ops.extension_import_error()!r}")
    from fgfw import _build_info
    assert _build_info.TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]
    has_cuda_kernels = torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::l1_fw_step_", "CUDA")
    assert (_build_info.CUDA_VERSION != "") == has_cuda_kernels


def test_an_extension_built_for_another_torch_is_not_loaded_and_says_why(tmp_path):
    other_torch = """
import sys, types
built = types.ModuleType("fgfw._build_info")
built.TORCH_VERSION, built.CUDA_VERSION = "2.0.0", ""
sys.modules["fgfw._build_info"] = built
"""
    result = _python("""
        import sys
        import fgfw
        assert not fgfw.HAS_COMPILED_EXTENSION and "fgfw._C" not in sys.modules  # never loaded
        assert fgfw.resolve_backend(None, "cpu") == "torch"
        try:
            fgfw.resolve_backend("cpu", "cpu")
        except ValueError as err:
            print(err)
        """, _environment(tmp_path, other_torch))
    assert result.returncode == 0, result.stderr
    assert "fgfw._C was built for torch 2.0.0, this process has torch" in result.stdout


SKIP_PROBE = """
import pytest


def test_skips_for_a_reason_no_gpu_lifts():
    pytest.skip("not today")


@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_waits_for_a_gpu():
    pass


@pytest.mark.shared_data
def test_waits_for_the_shared_data():
    pytest.skip("../shared/data is not here")


def test_runs():
    pass
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_test_skipped_everywhere_fails_the_session(tmp_path, workers):
    """FGFW_NO_SKIP_EVERYWHERE=1 (scripts/test.sh) fails a session that skips a test --gpu-only would not select,
    and names it, also when pytest-xdist runs the suite (scripts/test.sh does): there the reports come from the
    workers without their items (before, the xdist session passed)."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(SKIP_PROBE)
    env = _environment(tmp_path, None, FGFW_NO_SKIP_EVERYWHERE="1")
    result = _pytest(env, *workers, str(tmp_path), cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "FAILED: 1 skipped tests that --gpu-only does not select" in output, output
    nowhere = output.split("so they run nowhere", 1)[1]
    assert "test_skips_for_a_reason_no_gpu_lifts" in nowhere and "test_waits_for_a_gpu" not in nowhere, output
    assert "test_waits_for_the_shared_data" not in nowhere, output
