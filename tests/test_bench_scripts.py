"""Smoke runs of issue 23's scripts at their smallest settings: bench/real_models.py, examples/finetune_gpt2.py
(and bench/finetune.py). They need Hugging Face transformers and torchvision, which fgfw itself does not:
without them these tests skip and say so.

Beyond "it ran", each checks what its numbers must satisfy whatever the machine: the optimizers' state is
exactly what the algorithms keep (Adam two parameter-sized moments, FrankWolfe and AFGFW one momentum, MeZO
none), a step's measured peak above the weights holds that state, the reference rows' ratios are 1.
"""
import csv
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (not an fgfw dependency): "
                                                    f"pip install {' '.join(missing)}")


def run(*command, timeout=600):
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def rows_of(path):
    with open(path, newline="") as f:
        return {(r["model"], r["method"]): r for r in csv.DictReader(f)}


@needs("transformers")
def test_real_models_gpt2(tmp_path):
    methods = ("forward", "adam", "backprop_adamw", "frankwolfe", "afgfw_lean", "mezo")
    out = run("bench/real_models.py", "--preset", "tiny", "--models", "gpt2", "--methods", ",".join(methods),
              "--rounds", "1", "--repeats", "1", "--out", str(tmp_path), "--figures", str(tmp_path))
    rows = rows_of(tmp_path / "real_models_tiny.csv")
    assert set(rows) == {("gpt2", m) for m in methods}
    assert (tmp_path / "real_models_tiny.png").stat().st_size > 0
    weights = float(rows["gpt2", "forward"]["weights_mib"])
    state = {m: float(rows["gpt2", m]["state_mib"]) for m in methods}
    assert state == pytest.approx(dict(forward=0, adam=2 * weights, backprop_adamw=2 * weights, frankwolfe=weights,
                                       afgfw_lean=weights, mezo=0))
    for m in methods:
        assert float(rows["gpt2", m]["above_weights_mib"]) >= state[m]
    assert float(rows["gpt2", "frankwolfe"]["time_vs_frankwolfe"]) == 1.0
    assert float(rows["gpt2", "mezo"]["memory_vs_mezo"]) == 1.0
    assert "afgfw_lean" in out and "cores" in out  # the table and the machine it ran on


@needs("torchvision")
def test_real_models_resnet_batchnorm_takes_k_passes(tmp_path):
    # ResNet-18's BatchNorm in train mode cannot carry K tangents in one pass: the script falls back to K
    # passes. 11.7 M float32 parameters: the momentum (44.7 MiB) must show in the measured peak
    run("bench/real_models.py", "--preset", "tiny", "--models", "resnet18", "--methods", "afgfw_lean_k4",
        "--rounds", "1", "--repeats", "1", "--out", str(tmp_path), "--figures", str(tmp_path))
    row = rows_of(tmp_path / "real_models_tiny.csv")["resnet18", "afgfw_lean_k4"]
    assert float(row["state_mib"]) == pytest.approx(float(row["weights_mib"]))
    assert float(row["weights_mib"]) > 40
    assert float(row["above_weights_mib"]) >= float(row["state_mib"])


@needs("transformers")
def test_finetune_gpt2_example(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    out = run("examples/finetune_gpt2.py", "--text", str(text), "--steps", "3", "--batch", "2", "--length", "16",
              "--layers", "1", "--width", "32", "--num-tangents", "2")
    memory = [line for line in out.splitlines() if "MiB" in line]
    assert len(memory) == 2 and "AFGFW" in memory[0] and "backprop" in memory[1]
    afgfw, backprop = (float(line.split("MiB")[0].split()[-1]) for line in memory)
    assert 0 < afgfw and 0 < backprop
    assert "validation loss" in out


MNIST = os.path.join(ROOT, "..", "shared", "data", "mnist")


@pytest.mark.shared_data
@pytest.mark.skipif(not os.path.isdir(MNIST), reason=f"needs the MNIST IDX files at {MNIST}")
def test_finetune_mnist_quick(tmp_path):
    out = run("bench/finetune.py", "--task", "mnist", "--data", MNIST, "--quick", "--out", str(tmp_path),
              "--figures", str(tmp_path))
    with open(tmp_path / "finetune_mnist.csv", newline="") as f:
        ends = list(csv.DictReader(f))
    methods = {"adam", "frankwolfe", "afgfw", "afgfw_activity", "fgfw", "mezo", "frankwolfe_centred", "afgfw_centred",
               "afgfw_activity_centred", "fgfw_centred", "afgfw_activity_rms_centred", "afgfw_k2_centred",
               "afgfw_guided_centred", "afgfw_activity_l2_rescaled_centred", "afgfw_activity_l2_rescaled_wide_centred",
               "afgfw_activity_avg001_l2_rescaled_wide_centred", "afgfw_avg001_l2_rescaled_wide_centred",
               "afgfw_activity_rms_avg001_l2_rescaled_wide_centred"}
    decaying = {"afgfw_activity_avg001_l2_rescaled_wide_decay_centred"}
    # one selection run per method (one step size in --quick), then one seed at each budget; a step that decays
    # over the passes has no wall-clock run
    assert sorted(e["phase"] for e in ends) == sorted(["select", "passes", "seconds"] * len(methods)
                                                      + ["select", "passes"] * len(decaying))
    assert {e["method"] for e in ends} == methods | decaying
    for e in ends:
        if e["phase"] == "passes":
            assert float(e["passes"]) == 4  # the budget, in forward passes: MeZO's and K = 2 steps count 2
        if e["phase"] != "select":
            assert e["test_loss"] != ""  # the test split is read at the end of every final run, and only there
        else:
            assert e.get("test_loss", "") == ""
    assert "validation loss of the pre-trained start" in out
    assert (tmp_path / "finetune_mnist.png").stat().st_size > 0


TORCH_HEADERS = os.path.join(os.path.dirname(torch.__file__), "include", "c10")  # the text task's fine-tuning data


@needs("transformers")
@pytest.mark.skipif(not os.path.isdir(TORCH_HEADERS), reason=f"needs torch's C++ headers at {TORCH_HEADERS}")
def test_finetune_gpt2_small_comparison_quick(tmp_path):
    """Issue 31, item 4's GPU comparison (bench/finetune.py --model gpt2-small) at its CPU miniature: a row per
    method with the budget's passes, finite losses, and memory that holds what each method must: the copy's
    weights, Adam's gradients and two moments, more than MeZO for every other method (MeZO keeps no state)."""
    out = run("bench/finetune.py", "--task", "text", "--model", "gpt2-small", "--device", "cpu", "--quick",
              "--out", str(tmp_path), timeout=300)
    with open(tmp_path / "finetune_text_gpt2_small_cpu.csv", newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["mezo", "afgfw_centred", "fgfw_centred", "frankwolfe_centred", "adam"]
    weights_mib = 4 * int(rows["mezo"]["parameters"]) / 2**20  # float32
    for r in rows.values():
        assert {r["device"], r["model"], r["seed"], r["diverged"]} == {"cpu", "gpt2-small-quick", "0", "False"}
        assert float(r["passes"]) == 8  # the --quick budget in forward passes: MeZO's steps count two
        assert all(0 < float(r[k]) < 20 for k in ("test_loss_start", "test_loss", "val_loss"))
        assert float(r["ms_per_step"]) > 0
        assert float(r["ms_per_pass"]) == pytest.approx(float(r["ms_per_step"]) / (2 if r["method"] == "mezo" else 1))
        assert float(r["time_vs_mezo"]) == pytest.approx(float(r["ms_per_pass"]) / float(rows["mezo"]["ms_per_pass"]))
        assert float(r["peak_mib"]) >= weights_mib
        if r["method"] != "mezo":
            assert float(r["memory_vs_mezo"]) > 1
    assert float(rows["adam"]["peak_mib"]) >= 4 * weights_mib
    assert float(rows["mezo"]["time_vs_mezo"]) == float(rows["mezo"]["memory_vs_mezo"]) == 1.0
    assert len({r["test_loss_start"] for r in rows.values()}) == 1  # one pre-trained start for every method
    assert float(rows["adam"]["test_loss"]) < float(rows["adam"]["test_loss_start"])
    assert "| afgfw_centred |" in out


@needs("transformers")
def test_activity_layer_error_quick(tmp_path):
    """bench/activity_layer_error.py at its smallest: a row per parameter and tangent scale with every layer perturbed,
    and again with the LayerNorms or the other layers alone (each parameter in the one that holds it), each a finite
    positive error (an estimate equal to the gradient would be a broken comparison)."""
    run("bench/activity_layer_error.py", "--quick", "--out", str(tmp_path))
    with open(tmp_path / "activity_layer_error.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["tangent_scale"] for r in rows} == {"unit", "rms"}
    names = {r["parameter"] for r in rows}
    assert len(rows) == 4 * len(names) and any(".ln_1." in name for name in names)
    norms = {r["parameter"] for r in rows if r["sites"] == "layernorms"}
    assert norms == {n for n in names if n.split(".")[-2] in ("ln_1", "ln_2", "ln_f")}
    assert {r["parameter"] for r in rows if r["sites"] == "others"} == names - norms
    assert all(0 < float(r["relative_error_one_tangent"]) < float("inf") for r in rows)


@needs("transformers")
def test_optimizer_step_quick(tmp_path):
    """bench/optimizer_step.py at its smallest: every method's row is written for both models, under issue 29's
    names, AdamW(fused)'s ratio is 1 and every step took time (the numbers themselves belong to bench/RESULTS.md,
    not to a test)."""
    out_csv = tmp_path / "optimizer_step.csv"
    run("bench/optimizer_step.py", "--preset", "quick", "--repeats", "2", "--warmup", "1", "--out", str(out_csv))
    with open(out_csv, newline="") as f:
        rows = {(r["model"], r["method"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("gpt2_quick", m) for m in ("adamw_fused", "adamw_foreach", "muon", "fw_readme_groups",
                                                     "fw_l1", "fw_l1_nonfinite_op", "fw_scion", "fw_scion_f32",
                                                     "fw_scion_unbatched", "afgfw_update")} | \
        {("single_1e5", m) for m in ("copy", "adamw_fused", "adamw_foreach", "fw_l1", "fw_l1_nonfinite_op",
                                     "fw_l1_unchecked")}
    assert all(float(r["x_adamw_fused"]) == 1.0 for (_, m), r in rows.items() if m == "adamw_fused")
    assert all(float(r["median_ms"]) > 0 and r["device"] == "cpu" for r in rows.values())


def test_lm_quick(tmp_path):
    """bench/lm.py --quick: every method trains through its grid and writes a finite validation loss per run."""
    out_csv = tmp_path / "lm.csv"
    run("bench/lm.py", "--quick", "--out", str(out_csv), "--figure", str(tmp_path / "lm.png"))
    with open(out_csv.with_name("lm_summary.csv"), newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"adamw", "muon", "fw_scion", "fw_l1"}
    assert all(0 < float(r["val_mean"]) < 10 for r in rows.values())
    assert (tmp_path / "lm.png").exists()


def test_lm_extra_grid_quick():
    """bench/lm_extra_grid.py runs given settings beyond lm.py's grids and prints a finite validation loss each."""
    out = run("bench/lm_extra_grid.py", "--preset", "quick", "fw_scion", '{"step_size": 0.01, "scale": 2.0}',
              "muon", '{"lr": 0.001}')
    values = [float(line.split("val ")[1].split()[0]) for line in out.splitlines() if line.startswith("extra")]
    assert len(values) == 2 and all(0 < v < 10 for v in values), out


@needs("transformers")
def test_op_count_of_a_step_does_not_grow_with_depth():
    """Issue 29: one FrankWolfe step on Hugging Face GPT-2 dispatches at most 30 aten ops, the same number with 2
    and 12 layers, with the README's param groups and with one L1 ball per tensor (bench/op_count.py's gate);
    AFGFW's update the same number at both depths too. Before the unconstrained groups stepped in multi-tensor ops,
    the README's groups took 225 and 1,105, and AFGFW drew a tangent per tensor."""
    out = run("bench/op_count.py", "--methods", "fw_readme_groups", "fw_l1", "--layers", "2", "12", "--max-ops", "30")
    assert "| fw_readme_groups |" in out and "| fw_l1 |" in out
    # AFGFW's update after its forward pass: its unconstrained groups' tangents drawn per run, not per tensor
    out = run("bench/op_count.py", "--methods", "afgfw_update", "--layers", "2", "12", "--max-ops", "50")
    assert "| afgfw_update |" in out


@needs("transformers")
def test_op_count_of_a_lean_step_against_inference():
    """Issue 30's target: a whole lean AFGFW step on Hugging Face GPT-2 (2 and 12 layers) dispatches at most 3x the
    aten ops of an inference forward (2.95x and 2.79x with a layer's tangents drawn in one op, lazy view tangents and
    the leaner rules; 4.6x and 4.4x with the first tangent carrier, 9.9x and 10.3x with forward-AD duals), which the
    script enforces itself (exit 1)."""
    out = run("bench/op_count.py", "--forward-gradient", "--layers", "2", "12", "--max-ratio", "3.0")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 2 |") or line.startswith("| 12 |")]
    assert len(rows) == 2
    for row in rows:
        inference, step = int(row[2]), int(row[3])
        assert 0 < inference < step <= 3.0 * inference


def test_lean_carrier_tiny():
    """bench/lean_carrier.py: the carried pass and the pass with duals give the same directional derivative, and the
    table has a row per method."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'fgfw[models]')")
    out = run("bench/lean_carrier.py", "--layers", "1", "--width", "32", "--batch", "2", "--length", "16",
              "--repeats", "1")
    header = out.splitlines()[0]
    c_duals = float(header.split("c with duals ")[1].split(",")[0])
    c_carried = float(header.split("carried ")[1])
    assert c_duals != 0 and abs(c_carried - c_duals) <= 1e-4 * abs(c_duals)
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert rows == ["inference", "backprop_adamw", "lean_duals", "lean_carrier"]


def test_kernel_bench_blocked_argmax_is_torch_argmax():
    """The compile rows' two-stage argmax (bench/kernel_bench.py, argmax_rows) picks torch.argmax's index, the
    lowest on ties, in the last whole block, the tail and across blocks."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import kernel_bench
    finally:
        sys.path.pop(0)
    block = kernel_bench.ARGMAX_BLOCK
    gen = torch.Generator().manual_seed(0)
    for n in (5, 2 * block - 1, 2 * block, 3 * block, 3 * block + 7, 100_003):
        cases = [torch.rand(3, n, generator=gen), torch.zeros(3, n)]
        cases[1][0, -1] = 1  # in the tail (or the last block)
        cases[1][1, n // 2] = cases[1][1, -1] = 1  # a tie: the lower index
        cases[1][2, 0] = cases[1][2, block if n > block else 1] = 1  # a tie across blocks
        for a in cases:
            assert torch.equal(kernel_bench.argmax_rows(a, True), torch.argmax(a, 1, keepdim=True)), n


def test_attention_jvp_tiny(tmp_path):
    """bench/attention_jvp.py --device cpu --tiny (the fused kernel in Triton's interpreter): every method's row in
    both dtypes, the SDPA forward's ratio 1."""
    pytest.importorskip("triton")
    out_csv = tmp_path / "attention_jvp.csv"
    out = run("bench/attention_jvp.py", "--device", "cpu", "--tiny", "--out", str(out_csv))
    with open(out_csv, newline="") as f:
        rows = {(r["dtype"], r["method"]): r for r in csv.DictReader(f)}
    assert set(rows) == {(d, m) for d in ("float32", "bfloat16") for m in ("sdpa_forward", "chunked_jvp", "fused_jvp")}
    assert all(float(r["x_sdpa_forward"]) == 1.0 for (_, m), r in rows.items() if m == "sdpa_forward")
    assert all(float(r["median_ms"]) > 0 for r in rows.values())
    assert "target: fused_jvp bfloat16" in out


@needs("transformers")
def test_profile_lean_step_tf32_flag():
    """scripts/profile_lean_step.py --tf32 (gpu_check.sh key's second profile, GPU only there) runs and says that its
    float32 products were TF32 ones."""
    out = run("scripts/profile_lean_step.py", "--device", "cpu", "--tiny", "--tf32", "--rows", "3")
    assert "float32 (TF32 products)" in out and "aten op calls" in out


def test_kernel_bench_cpu_speed_gate_logic(fgfw_ops, tmp_path):
    """bench/kernel_bench.py --quick (CI's CPU speed gate, run by scripts/test.sh) on a tiny size, so that its logic is
    checked whatever the timings: a row per fused set, each beside its own copy; --gate 0 passes; an impossible ratio
    exits 1 naming every row; a per-set threshold fails that set's row alone; a bad threshold is a usage error."""
    quick = ("bench/kernel_bench.py", "--quick", "--sizes", "1e4", "--min-time", "0", "--warmup", "1")
    out = run(*quick, "--gate", "0", "--out", str(tmp_path / "gate.csv"))
    with open(tmp_path / "gate.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    sets = ("l1", "linf", "lp", "ksparse")
    assert sorted((r["set"], r["backend"]) for r in rows) == sorted((s, b) for s in sets for b in ("fused", "copy"))
    assert all(r["mode"] == "fw_momentum" and int(r["params"]) == 10_000 for r in rows)
    assert all(float(r["best_frac_copy"]) > 0 for r in rows)
    assert "gate: passed (4 rows)" in out
    for s in sets:
        assert f"gate: ok   single {s} fw_momentum" in out

    def gate(*thresholds):
        command = [sys.executable, *quick, "--gate-retries", "0", "--out", str(tmp_path / "fail.csv"), *thresholds]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)

    failed = gate("--gate", "1e9")
    assert failed.returncode == 1, failed.stderr[-3000:]
    for s in sets:
        assert f"gate: FAIL single {s} fw_momentum" in failed.stdout
    assert "4 of 4 rows below" in failed.stderr
    one = gate("--gate", "0", "--gate", "ksparse=1e9")
    assert one.returncode == 1 and "gate: FAIL single ksparse" in one.stdout and "1 of 4 rows below" in one.stderr
    assert gate("--gate", "l2=0.5").returncode == 2  # not a set the gate measures
