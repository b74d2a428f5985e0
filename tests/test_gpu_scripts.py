"""The scripts that only a GPU machine runs, run here on the CPU: scripts/gpu_sanitize.py on the CPU kernels, and both
commands of scripts/gpu_check.sh (key, tests, models) as a dry run (GPU_CHECK_DRY_RUN=1: each step's CPU stand-in). A GPU run once found
the sanitizer's script calling the set steps without an argument their schema had gained since, so that
compute-sanitizer never reached a kernel; here that breaks CI instead.
"""
import csv
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    """This interpreter's folder first on PATH (the scripts call python3), without the Triton interpreter's switch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def test_gpu_sanitize_runs_every_set_through_the_optimizers_on_the_cpu(fgfw_ops):
    done = subprocess.run([sys.executable, "scripts/gpu_sanitize.py", "--device", "cpu"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # 5 sets x 3 scopes x 2 dtypes x (a FrankWolfe and an AFGFW step), and the direct calls
    assert "gpu_sanitize: 60 optimizer steps (cpu backend) and" in done.stdout, done.stdout


@pytest.mark.parametrize("phase", ["key", "tests", "models"])
def test_gpu_check_dry_run(fgfw_ops, phase, tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    done = subprocess.run(["bash", "scripts/gpu_check.sh", phase], cwd=ROOT, capture_output=True, text=True,
                          env=_env(GPU_CHECK_DRY_RUN="1", OUT=str(tmp_path)), timeout=900)
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stderr[-3000:]
    assert f"gpu_check {phase}: exit 0" in summary
    assert "SKIPPED" not in summary, summary
    if phase == "key":
        assert "== kernel benchmark: exit 0" in summary, summary
        assert (tmp_path / "kernel_gpu.csv").exists()
        assert "== optimizer step benchmark: exit 0" in summary, summary
        models = {line.split(",")[1] for line in (tmp_path / "optimizer_step_gpu.csv").read_text().splitlines()[1:]}
        assert models == ({"gpt2_quick", "single_1e5"} if importlib.util.find_spec("transformers") else
                          {"single_1e5"}), models
        assert "== attention JVP benchmark: exit 0" in summary, summary
        assert "fused_jvp" in (tmp_path / "attention_jvp_gpu.csv").read_text()
        if importlib.util.find_spec("transformers"):
            assert "== lean step profile: exit 0" in summary, summary
            assert "kernel launches" in (tmp_path / "lean_profile.txt").read_text()
            assert "lean step profile, TF32" not in summary, summary  # a CUDA setting: GPU runs only
    elif phase == "models":
        if importlib.util.find_spec("transformers"):
            assert "== real models (GPT-2): exit 0" in summary, summary
            rows = (tmp_path / "real_models_gpu.csv").read_text().splitlines()
            assert any(",backprop_adamw," in row for row in rows), rows[:3]
            # issue 31, item 4: the fine-tuning comparison's CPU miniature, every method's row
            assert "== fine-tuning GPT-2 small: exit 0" in summary, summary
            with open(tmp_path / "finetune_text_gpt2_small_cpu.csv", newline="") as f:
                methods = [row["method"] for row in csv.DictReader(f)]
            assert methods == ["mezo", "afgfw_centred", "fgfw_centred", "frankwolfe_centred", "adam"], methods
            assert "| adam |" in summary, summary
    else:
        for part in ("cuda", "triton"):
            log = (tmp_path / f"tests_{part}.log").read_text()
            # pytest's last line: "N/M tests collected (K deselected) in T s", with ", E errors" when some failed
            assert re.search(r"\d+/\d+ tests collected", log) and not re.search(r"\d+ errors?\b|ERROR", log), \
                log[-2000:]
        assert "gpu_sanitize: 60 optimizer steps" in (tmp_path / "sanitizer.log").read_text()
