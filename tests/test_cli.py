"""End to end: `fgfw reproduce` and `fgfw demo` on the digits for one epoch, outputs checked for sane values; the
demo's whole configuration against the table the README and docs show."""
import csv
import json
import math
import re
import sys
from pathlib import Path

import pytest

from fgfw import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_reproduce_writes_history_summary_and_curves(tmp_path, capsys):
    out = tmp_path / "run"
    cli.main(["reproduce", "--epochs", "1", "--seeds", "0,1", "--methods", "fw,fgfw,afgfw,adam", "--num-tangents", "2",
              "--threads", "1", "--quiet", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "FW (backprop)" in printed and "AFGFW (Alg. 2)" in printed

    rows = read_csv(out / "history.csv")
    assert len(rows) == 4 * 2 * 2  # methods x seeds x (epoch 0, epoch 1)
    assert {r["method"] for r in rows} == {"fw", "fgfw", "afgfw", "adam"}
    for r in rows:
        assert 0.0 <= float(r["test_accuracy"]) <= 1.0
        assert math.isfinite(float(r["train_loss"])) and float(r["train_loss"]) > 0
        assert 0 <= int(r["zeros"]) <= 1090 and 0.0 <= float(r["zero_fraction"]) <= 1.0
        assert float(r["peak_memory_mib"]) > 0
        if r["epoch"] == "1":
            assert float(r["wall_time_s"]) > 0
            # the gap estimate exists for the Frank-Wolfe methods only
            assert (r["fw_gap"] == "") == (r["method"] == "adam")
    fw_final = [float(r["test_accuracy"]) for r in rows if r["method"] == "fw" and r["epoch"] == "1"]

    report = json.loads((out / "history.json").read_text())
    assert report["data"] == "digits" and report["seeds"] == [0, 1] and report["parameters"] == 1090
    assert report["settings"]["afgfw"]["num_tangents"] == 2
    assert report["settings"]["fw"]["scope"] == "row"
    summary = {r["method"]: r for r in read_csv(out / "summary.csv")}
    fw_mean = sum(fw_final) / 2
    assert float(summary["fw"]["test_accuracy_mean"]) == pytest.approx(fw_mean)
    assert int(summary["fw"]["seeds"]) == 2
    assert (out / "curves.png").read_bytes()[:8] == PNG_SIGNATURE


def test_tuned_frank_wolfe_learns_in_one_epoch(tmp_path):
    cli.main(["reproduce", "--epochs", "1", "--batch-size", "8", "--seeds", "0,1,2", "--methods", "fw", "--threads", "1",
              "--quiet", "--out", str(tmp_path)])
    summary = read_csv(tmp_path / "summary.csv")[0]
    assert float(summary["test_accuracy_mean"]) > 0.3  # chance is 0.1; 0.46 when written
    assert float(summary["train_loss_mean"]) < 2.2  # the initial loss is about ln(10) = 2.30


def test_tuned_afgfw_learns_and_fgfw_stays_below(tmp_path):
    """The tuned forward-gradient runs (activity estimator): AFGFW learns, FGFW (no averaging) lags behind."""
    cli.main(["reproduce", "--epochs", "3", "--batch-size", "8", "--seeds", "0,1,2", "--methods", "fgfw,afgfw",
              "--threads", "1", "--quiet", "--out", str(tmp_path)])
    settings = json.loads((tmp_path / "history.json").read_text())["settings"]
    assert settings["afgfw"]["estimator"] == "activity" and "engine" not in settings["afgfw"]
    summary = {r["method"]: float(r["test_accuracy_mean"]) for r in read_csv(tmp_path / "summary.csv")}
    assert summary["afgfw"] > 0.3  # chance is 0.1; 0.45 when written
    assert summary["afgfw"] > summary["fgfw"] + 0.1  # 0.18 when written


def test_estimator_option_overrides_the_preset(tmp_path):
    cli.main(["reproduce", "--epochs", "1", "--seeds", "0", "--methods", "afgfw", "--estimator", "weight",
              "--engine", "forward_ad", "--no-tangents-in-one-pass", "--threads", "1", "--quiet", "--out", str(tmp_path)])
    settings = json.loads((tmp_path / "history.json").read_text())["settings"]["afgfw"]
    assert settings["estimator"] == "weight" and settings["engine"] == "forward_ad"
    assert settings["tangents_in_one_pass"] is False


def test_paper_preset_uses_the_papers_settings(tmp_path):
    out = tmp_path / "paper"
    cli.main(["reproduce", "--paper", "--epochs", "1", "--seeds", "3", "--methods", "fw,afgfw", "--threads", "1",
              "--quiet", "--out", str(out)])
    settings = json.loads((out / "history.json").read_text())["settings"]
    assert settings["fw"] == dict(settings["fw"], radius="1e-4", scope="tensor", step_size="2/(k+2)")
    assert settings["afgfw"] == dict(settings["afgfw"], radius="1e-4", step_size="1/k", averaging_weight="1/sqrt(k)",
                                     num_tangents=1, tangent="gaussian", estimator="weight")
    # the first step alpha_1 = 1 turns every tensor into one vertex of a ball of radius 1e-4: nearly all zeros
    final = [r for r in read_csv(out / "history.csv") if r["epoch"] == "1"]
    assert all(int(r["zeros"]) > 500 for r in final if r["method"] == "afgfw")


DEMO_EPOCH_LINE = re.compile(r"^(\w+) +epoch +(\d+)/(\d+)  loss (\S+)  test acc +(\S+)%  +(\S+)s$")


def test_demo_prints_a_line_per_epoch_and_writes_its_files(tmp_path, capsys, monkeypatch):
    import torch

    threads, set_num_threads, before = [], torch.set_num_threads, torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (threads.append(n), set_num_threads(n)))
    try:
        cli.main(["demo", "--epochs", "2", "--out", str(tmp_path)])
    finally:
        set_num_threads(before)
    assert threads == [1]  # one thread by default, as reproduce
    printed = capsys.readouterr().out
    assert "1 CPU thread(s)" in printed.splitlines()[0]
    progress = [m.groups() for m in map(DEMO_EPOCH_LINE.match, printed.splitlines()) if m]
    assert [(m, int(e)) for m, e, *_ in progress] == [(m.upper(), e) for m in cli.DEMO_METHODS for e in (1, 2)]
    for method in cli.DEMO_METHODS:
        rows = read_csv(tmp_path / f"{method}.csv")
        assert [r["epoch"] for r in rows] == ["0", "1", "2"]
        # each line shows that epoch's record: loss, accuracy and training time so far
        for (_, epoch, total, loss, acc, elapsed), row in zip([p for p in progress if p[0] == method.upper()],
                                                              rows[1:]):
            assert total == "2" and epoch == row["epoch"]
            # (as printed: rounded to the last digit shown)
            assert float(loss) == pytest.approx(float(row["train_loss"]), abs=5.1e-5)
            assert float(acc) == pytest.approx(100 * float(row["test_accuracy"]), abs=5.1e-3)
            assert float(elapsed) == pytest.approx(float(row["wall_time_s"]), abs=0.051)
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    assert {r["method"] for r in json.loads((tmp_path / "summary.json").read_text())} == set(cli.DEMO_METHODS)


def test_demo_help_gives_a_description_and_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Trains the paper's network shape" in text and "'demo' extra" in text
    for default in ("(default 30)", "(default 64)", "(default 0)", "(default 1:", "(default results/demo)"):
        assert default in text


def test_engine_help_lists_the_engines_and_refuses_others(capsys):
    from fgfw.forward_grad import DEFAULT_ENGINE, ENGINES

    with pytest.raises(SystemExit):
        cli.main(["reproduce", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"--engine {{{','.join(sorted(ENGINES))}}}" in text and f"(default: {DEFAULT_ENGINE};" in text
    code, err = _usage_error(capsys, ["reproduce", "--engine", "backprop"])
    assert code == 2 and "argument --engine: invalid choice: 'backprop'" in err


def _no_training(*args, **kwargs):
    raise AssertionError("training started although a package it needs is missing")


@pytest.mark.parametrize("command,module,name", [("demo", "matplotlib", "matplotlib"),
                                                 ("demo", "sklearn", "scikit-learn"),
                                                 ("reproduce", "matplotlib", "matplotlib"),
                                                 ("reproduce", "sklearn", "scikit-learn")])
def test_a_missing_optional_package_stops_before_training(command, module, name, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import fails and find_spec finds nothing: as if not installed
    monkeypatch.setattr(cli, "train", _no_training)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--epochs", "1", "--out", str(out)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()  # nothing loaded, printed or written
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fgfw {command}: error: missing {name} (for ")
    assert "'demo' extra" in lines[0] and "'.[demo]'" in lines[0] and "Traceback" not in captured.err


def test_scikit_learn_is_needed_for_the_digits_only(tmp_path, capsys, monkeypatch):
    """MNIST from a folder needs no scikit-learn: the run goes on to the data (here: no files, its own error)."""
    monkeypatch.setitem(sys.modules, "sklearn", None)
    data = tmp_path / "mnist"
    data.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["reproduce", "--data", str(data), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "scikit-learn" not in err and str(data) in err


def test_bad_data_path_and_options_are_reported(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["reproduce", "--data", str(tmp_path / "missing"), "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["reproduce", "--methods", "fw,lbfgs"])
    assert "methods must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["reproduce", "--radius", "big", "--epochs", "1", "--seeds", "0", "--methods", "fw", "--quiet",
                  "--out", str(tmp_path)])
    assert "radius must be" in capsys.readouterr().err


def test_schedule_specs_from_the_command_line():
    import io

    import torch

    import fgfw
    from fgfw.experiments import LinearDecay, parse_schedule

    decay = parse_schedule("linear:0.01", 100)
    assert isinstance(decay, LinearDecay) and repr(decay) == "linear:0.01"
    assert decay(1) == pytest.approx(0.0099) and decay(50) == pytest.approx(0.005)
    assert decay(100) == pytest.approx(0.0002) and decay(10_000) == pytest.approx(0.0002)  # the 2 % floor
    assert parse_schedule("0.002") == 0.002 and parse_schedule("1/sqrt(k)") == "1/sqrt(k)"
    with pytest.raises(ValueError, match="linear:2"):
        parse_schedule("linear:2", 100)
    with pytest.raises(ValueError, match="number of steps"):
        parse_schedule("linear:0.1")
    # an optimizer holding the schedule saves (a plain record: torch.load's default reads it) and an
    # optimizer built with the same schedule loads it
    theta = torch.nn.Parameter(torch.ones(3))
    opt = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=3.0), step_size=decay)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert saved["param_groups"][0]["step_size"] == {"kind": "callable", "name": "linear:0.01"}
    again = fgfw.FrankWolfe([theta], constraint=fgfw.L1Ball(radius=3.0), step_size=decay)
    again.load_state_dict(saved)
    assert again.param_groups[0]["step_size"](50) == pytest.approx(0.005)


def _usage_error(capsys, argv):
    """The exit status and stderr of ``fgfw argv``, which must stop with a usage error."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    return exit_info.value.code, capsys.readouterr().err


# (option, bad value, what the message says): each must be refused by the parser (exit status 2, one
# line naming the option) before any data is read or any folder is written
BAD_OPTIONS = [
    ("--batch-size", "0", "positive integer"),
    ("--batch-size", "-8", "positive integer"),
    ("--epochs", "0", "positive integer"),
    ("--epochs", "x", "positive integer"),
]


@pytest.mark.parametrize("command", ["demo", "reproduce"])
@pytest.mark.parametrize("option,value,expected", BAD_OPTIONS)
def test_bad_counts_are_usage_errors_naming_the_option(command, option, value, expected, tmp_path,
                                                        capsys):
    out = tmp_path / "out"
    code, err = _usage_error(capsys, [command, option, value, "--out", str(out)])
    assert code == 2
    assert f"argument {option}: " in err and expected in err and repr(value) in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("command", ["demo", "reproduce"])
def test_out_that_is_a_file_is_a_usage_error(command, tmp_path, capsys):
    existing = tmp_path / "results.csv"
    existing.write_text("keep me\n")
    for out in (existing, existing / "run"):
        code, err = _usage_error(capsys, [command, "--epochs", "1", "--out", str(out)])
        assert code == 2 and "argument --out: " in err and str(existing) in err and "not a folder" in err
        assert "Traceback" not in err and "digits:" not in err  # refused before the data is loaded
    assert existing.read_text() == "keep me\n"


def test_device_without_a_gpu_is_a_usage_error(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    out = tmp_path / "out"
    for device in ("cuda", "cuda:0"):
        code, err = _usage_error(capsys, ["reproduce", "--device", device, "--epochs", "1", "--seeds", "0",
                                          "--methods", "fw", "--quiet", "--out", str(out)])
        assert code == 2 and f"argument --device: {device!r}" in err and "no CUDA device" in err
        assert "NVIDIA driver" not in err and not out.exists()
    code, err = _usage_error(capsys, ["reproduce", "--device", "gpu0", "--out", str(out)])
    assert code == 2 and "argument --device: 'gpu0'" in err and "cpu" in err


def test_device_index_beyond_the_gpus_is_a_usage_error(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, err = _usage_error(capsys, ["reproduce", "--device", "cuda:3", "--out", str(tmp_path / "out")])
    assert code == 2 and "argument --device: 'cuda:3'" in err and "1 CUDA device" in err


def test_data_that_is_a_file_or_missing_is_a_usage_error(tmp_path, capsys):
    a_file = tmp_path / "t10k-images-idx3-ubyte.gz"
    a_file.write_bytes(b"")
    out = tmp_path / "out"
    code, err = _usage_error(capsys, ["reproduce", "--data", str(a_file), "--out", str(out)])
    assert code == 2 and "argument --data: " in err and "is a file, not a folder" in err and str(tmp_path) in err
    code, err = _usage_error(capsys, ["reproduce", "--data", str(tmp_path / "missing"), "--out", str(out)])
    assert code == 2 and "argument --data: " in err and "does not exist" in err
    assert not out.exists()


def test_usage_errors_from_the_command_line_are_one_line(tmp_path):
    """The installed entry point: `python -m fgfw` prints usage and one error line, exit status 2."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "fgfw", "reproduce", "--batch-size", "0", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("fgfw reproduce: error: argument --batch-size: ")
    assert not any("Traceback" in line for line in lines)


def test_version_prints_the_package_version(capsys):
    import fgfw
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fgfw {fgfw.__version__}"


SUMMARY_ROW = re.compile(r"^(FW|FGFW|AFGFW) +([\d.]+)% +([\d.]+)\b")


def _documented_demo_table(path: Path) -> dict[str, tuple[str, str]]:
    """{method: (test accuracy, final loss)} as the file's copy of the demo's final table prints them."""
    rows = {}
    lines = path.read_text().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("method   test acc  final loss"))
    for line in lines[header + 1:header + 4]:
        match = SUMMARY_ROW.match(line)
        assert match, (path, line)
        rows[match[1]] = (match[2], match[3])
    return rows


def test_the_demo_prints_the_table_the_docs_show(tmp_path, capsys):
    """The demo's whole configuration (30 epochs, seed 0; about 40 s) ends with the final table that the README
    and docs/reproduction.md show: accuracies and losses as printed, digit for digit. The docs once kept a table
    from before a change of the step (issue 32)."""
    import torch

    before = torch.get_num_threads()
    try:
        cli.main(["demo", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(before)  # the demo trains on one thread
    printed = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(printed) if line.startswith("method   test acc  final loss"))
    got = {m[1]: (m[2], m[3]) for m in map(SUMMARY_ROW.match, printed[header + 1:header + 4]) if m}
    assert set(got) == {"FW", "FGFW", "AFGFW"}, printed[header:]
    for doc in (ROOT / "README.md", ROOT / "docs" / "reproduction.md"):
        assert _documented_demo_table(doc) == got, doc
