"""Shared fixtures: the compiled ops, or a skip that says why they cannot run here.

The session fails before any test runs when the compiled extension fgfw._C is expected and cannot be
used: when it is there but does not import (a broken build), when ``FGFW_REQUIRE_EXTENSION=1`` and it
is missing, and when ``FGFW_REQUIRE_CUDA_KERNELS=1`` and it has no CUDA kernels (scripts/test.sh sets
these). Otherwise the kernel tests would skip and the optimizer tests run on the reference backend,
and the suite would pass with no kernel tested. The last line of the session says which backends ran.
"""
import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before triton is
# first imported (its standard library is built at import); importing fgfw (torch.library) imports
# triton, so this is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Under pytest-xdist (scripts/test.sh runs one worker per core) each worker takes its share of the cores: torch's
# default, a thread per core in every worker, oversubscribed them and made the many small kernel tests 5 to 9
# times slower. Tests of the parallel paths set their thread counts themselves.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

REQUIRE_EXTENSION = "FGFW_REQUIRE_EXTENSION"
REQUIRE_CUDA_KERNELS = "FGFW_REQUIRE_CUDA_KERNELS"
# scripts/test.sh sets it: a test skipped here that `--gpu-only` would not select either runs nowhere, so the
# session fails and names it (a GPU test must say so: "cuda" or "triton" in its id, a GPU skip mark, or the gpu
# mark; see needs_gpu)
NO_SKIP_EVERYWHERE = "FGFW_NO_SKIP_EVERYWHERE"
BUILD_COMMAND = "pip install --no-build-isolation -e . (or scripts/test.sh)"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "no", "false", "off")


def _ops():
    """fgfw._ops, with the import of fgfw._C attempted; None when fgfw itself does not import (the tests say why)."""
    try:
        from fgfw import _ops
    except Exception:  # noqa: BLE001  (a broken fgfw fails every test module's import, with its traceback)
        return None
    _ops.extension_import_error()
    return _ops


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::l1_fw_step_", "CUDA")


def _extension_failure(ops) -> str | None:
    """Why this session must not run, or None."""
    err = ops.extension_import_error()
    if err is not None:
        reason = f"{type(err).__name__}: {err}"
        if not ops.extension_not_built(err):
            return (f"the compiled extension fgfw._C is there but failed to import ({reason}); the kernel tests "
                    f"would skip and the optimizers run on the reference backend. Rebuild it against torch "
                    f"{torch.__version__}: {BUILD_COMMAND}")
        if _flag(REQUIRE_EXTENSION):
            return (f"{REQUIRE_EXTENSION}=1 but the compiled extension fgfw._C is not built ({reason}); "
                    f"build it with: {BUILD_COMMAND}")
        return None
    if _flag(REQUIRE_CUDA_KERNELS) and not _has_cuda_kernels():
        return (f"{REQUIRE_CUDA_KERNELS}=1 (scripts/test.sh sets it when nvcc is there at build time) but fgfw._C "
                f"({ops.extension_file()}) was built without CUDA kernels: the CUDA build was skipped or failed; "
                f"see the build log (FGFW_CUDA=ON makes a build without them an error)")
    return None


def backends_line() -> str:
    """One line: which backends this session could use."""
    ops = _ops()
    if ops is None:
        return "fgfw backends: fgfw does not import"
    err = ops.extension_import_error()
    if err is None:
        cpu = f"cpu (fgfw._C loaded from {ops.extension_file()})"
        cuda = "yes" if _has_cuda_kernels() else "no"
    else:
        cpu = f"cpu: fgfw._C not loaded ({type(err).__name__}: {err}), torch reference only"
        cuda = "no"
    if ops._triton_module() is None:
        triton = "absent"
    elif torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        triton = "compiled"
    else:
        triton = "interpreter"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return f"fgfw backends: {cpu}, cuda kernels registered: {cuda}, triton: {triton}, GPU: {gpu}"


def pytest_addoption(parser):
    parser.addoption("--gpu-only", action="store_true",
                     help="run only the tests that exercise GPU code when a GPU is there (the CUDA kernels, compiled "
                          "Triton, CUDA graphs, anything parametrised over 'cuda' or 'triton' or skipped for want "
                          "of a GPU): scripts/gpu_check.sh tests, where CI has already run the rest")


def needs_gpu(item) -> bool:
    """Whether a collected test exercises GPU code where a GPU is present (see --gpu-only). The cpu variants of
    the GPU test files (a "device" parameter of "cpu") run in CI, not on the GPU machine."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("device") == "cpu":
        return False
    name = item.nodeid.lower()
    if "cuda" in name or "triton" in name or "fgfw_cuda_ops" in getattr(item, "fixturenames", ()):
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", "")).lower()
        if "gpu" in reason or "cuda" in reason:
            return True
    return item.get_closest_marker("gpu") is not None


# nodeid -> (why it skipped, whether --gpu-only selects it). Under pytest-xdist the reports reach this process
# from the workers without their items, so a skipped test's report carries needs_gpu as a user property.
_SKIPPED: dict[str, tuple[str, bool]] = {}
NEEDS_GPU_PROPERTY = "fgfw_needs_gpu"


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--gpu-only"):
        return
    keep = [item for item in items if needs_gpu(item)]
    config.hook.pytest_deselected(items=[item for item in items if not needs_gpu(item)])
    items[:] = keep


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: the test exercises GPU code when a GPU is there (kept by --gpu-only)")
    # pytest-timeout (the GPU run's per-test limit) reads this marker; registered here too for runs without it
    config.addinivalue_line("markers", "timeout(seconds): a longer per-test limit for a test that is slow on purpose")
    config.addinivalue_line("markers", "shared_data: the test reads ../shared/data and skips where it is absent (a skip "
                                       "FGFW_NO_SKIP_EVERYWHERE allows: the data, not a GPU, is missing)")


def pytest_sessionstart(session):
    ops = _ops()
    failure = None if ops is None else _extension_failure(ops)
    if failure is not None:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(backends_line())
        pytest.exit(f"fgfw: {failure}", returncode=pytest.ExitCode.TESTS_FAILED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped:
        # a test that waits for a GPU, or for the shared data set, runs where that is: not "nowhere"
        runs_elsewhere = needs_gpu(item) or item.get_closest_marker("shared_data") is not None
        report.user_properties.append((NEEDS_GPU_PROPERTY, runs_elsewhere))


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        _SKIPPED[report.nodeid] = (reason, dict(report.user_properties).get(NEEDS_GPU_PROPERTY, True))


def skipped_everywhere() -> list[tuple[str, str]]:
    """(nodeid, reason) of the tests this session skipped that `--gpu-only` does not select: they run nowhere."""
    return [(nodeid, reason) for nodeid, (reason, gpu) in _SKIPPED.items() if not gpu]


def pytest_sessionfinish(session, exitstatus):
    if (_flag(NO_SKIP_EVERYWHERE) and not session.config.getoption("--gpu-only") and skipped_everywhere()
            and session.exitstatus == pytest.ExitCode.OK):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    everywhere = [] if terminalreporter.config.getoption("--gpu-only") else skipped_everywhere()
    if everywhere:
        verdict = "FAILED" if _flag(NO_SKIP_EVERYWHERE) else "warning"
        terminalreporter.write_line(f"{verdict}: {len(everywhere)} skipped tests that --gpu-only does not select "
                                    f"either, so they run nowhere ({NO_SKIP_EVERYWHERE}):")
        for nodeid, reason in everywhere[:50]:
            terminalreporter.write_line(f"  {nodeid}: {reason}")
    terminalreporter.write_line(backends_line())


@pytest.fixture(scope="session")
def fgfw_ops():
    """torch.ops.fgfw with the compiled kernels of fgfw._C loaded; skips when the extension is not built."""
    ops = _ops()
    err = ImportError("fgfw does not import") if ops is None else ops.extension_import_error()
    if err is not None:
        # only a module that was never built gets here: a broken one or a required one stops the session
        pytest.skip(f"fgfw._C is not built ({type(err).__name__}: {err}); build it with: {BUILD_COMMAND}")
    return torch.ops.fgfw


@pytest.fixture(scope="session")
def fgfw_cuda_ops(fgfw_ops):
    """torch.ops.fgfw for CUDA tensors; skips without a GPU or when fgfw._C was built without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("fgfw::fill_tangent_", "CUDA"):
        pytest.skip("fgfw._C was built without CUDA kernels (FGFW_CUDA=OFF, or no nvcc at build time)")
    return fgfw_ops
