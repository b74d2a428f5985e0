"""Command line: ``fgfw demo``, ``fgfw reproduce`` and ``fgfw info`` (also ``python -m fgfw ...``)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings

import torch

from . import info
from .experiments import METHODS, PRESETS, RunConfig, config_from_preset, summarize, train, write_csv
from .forward_grad import DEFAULT_ENGINE, ENGINES
from .models import paper_mlp
from .optim import ESTIMATORS

# The demo trains with the "tuned" preset: the paper's own schedules and radius leave this network at
# chance (see bench/RESULTS.md and `fgfw reproduce --paper`).
DEMO_METHODS = ("fw", "fgfw", "afgfw")
LABELS = {"fw": "FW (backprop)", "fgfw": "FGFW (Alg. 1)", "afgfw": "AFGFW (Alg. 2)", "adam": "Adam (no constraint)",
          "sgd": "SGD (no constraint)"}


class _PlainProgress:
    """A progress line for terminals without tqdm: a line at every 10 % (no carriage-return tricks)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done, self.shown, self.start = total, desc, 0, -1, time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        tenth = 10 * self.done // max(self.total, 1)
        if tenth != self.shown:
            self.shown = tenth
            print(f"  {self.desc}: {100 * self.done // max(self.total, 1):3d}% ({self.done}/{self.total} steps, "
                  f"{time.perf_counter() - self.start:.0f}s)", flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool = True):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True)


def _make_out(out: str) -> None:
    """Makes the --out folder (main has checked that no file is in the way)."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {out!r}: cannot make the folder ({err.strerror or err}); give a folder you can "
                         f"write") from None


def _write_history(out_dir: str, name: str, rows: list[dict]) -> None:
    write_csv(os.path.join(out_dir, f"{name}.csv"), rows)


def _plot_curves(path: str, summary: dict[str, list[dict]], title: str) -> None:
    """Training loss and test accuracy vs epoch, one line per method: mean over seeds, min-max band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for method, rows in summary.items():
        epochs = [r["epoch"] for r in rows]
        label = LABELS.get(method, method.upper())
        seeds = rows[0]["seeds"]
        if seeds > 1:
            label += f" (mean of {seeds} seeds, band min-max)"
        for ax, key, scale in ((ax_loss, "train_loss", 1), (ax_acc, "test_accuracy", 100)):
            mean = [scale * r[f"{key}_mean"] for r in rows]
            line, = ax.plot(epochs, mean, label=label)
            if seeds > 1:
                ax.fill_between(epochs, [scale * r[f"{key}_min"] for r in rows],
                                [scale * r[f"{key}_max"] for r in rows], color=line.get_color(), alpha=0.2)
    ax_loss.set(xlabel="epoch", ylabel="training loss (cross-entropy)", title=title, yscale="log")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title=title)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def demo(args: argparse.Namespace) -> None:
    from .data import digits_split

    if args.threads:
        torch.set_num_threads(args.threads)
    _make_out(args.out)
    train_data, test_data = digits_split()
    histories, table = {}, []
    print(f"digits: {len(train_data[1])} train / {len(test_data[1])} test images (8x8); model 64-10-10-10-10-10 "
          f"(1,090 parameters); {args.epochs} epochs, batch {args.batch_size}, seed {args.seed}, backend "
          f"{args.backend or 'auto'}, {torch.get_num_threads()} CPU thread(s)", flush=True)

    def epoch_line(row: dict) -> None:
        print(f"{row['method'].upper():<6} epoch {row['epoch']:>{len(str(args.epochs))}}/{args.epochs}  loss "
              f"{row['train_loss']:.4f}  test acc {100 * row['test_accuracy']:6.2f}%  {row['wall_time_s']:6.1f}s",
              flush=True)

    for method in DEMO_METHODS:
        cfg = config_from_preset(method, "tuned", epochs=args.epochs, batch_size=args.batch_size, seed=args.seed,
                                 backend=args.backend)
        torch.manual_seed(args.seed)
        model = paper_mlp(in_features=64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            # torch's own notice when forward AD first loads its decompositions; nothing for a demo user to do
            warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated", category=FutureWarning)
            rows = train(cfg, model, train_data, test_data, on_epoch=epoch_line)
        histories[method] = rows
        _write_history(args.out, method, rows)
        last = rows[-1]
        table.append((method, last["test_accuracy"], last["train_loss"], last["zero_fraction"], last["wall_time_s"],
                      cfg.describe()))
    print(f"\n{'method':<7} {'test acc':>9} {'final loss':>11} {'zeros':>7} {'time':>7}  settings")
    for method, acc, loss, zeros, seconds, settings in table:
        shown = {k: v for k, v in settings.items()
                 if k in ("radius", "scope", "step_size", "averaging_weight", "momentum", "num_tangents",
                           "estimator")}
        print(f"{method.upper():<7} {100 * acc:>8.2f}% {loss:>11.4f} {100 * zeros:>6.1f}% {seconds:>6.1f}s  {shown}")
    plot = os.path.join(args.out, "loss_curves.png")
    _plot_curves(plot, summarize(list(histories.values())), "digits, paper MLP shape")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump([dict(method=m, test_accuracy=a, final_loss=l, zero_fraction=z, wall_time_s=t, settings=s)
                   for m, a, l, z, t, s in table], f, indent=2)
    print(f"\nwrote {plot} and per-epoch CSVs to {args.out}/")


def _reproduce_configs(args: argparse.Namespace) -> list[RunConfig]:
    """One RunConfig per (method, seed): the preset, with every option given on the command line on top."""
    shared = dict(epochs=args.epochs, batch_size=args.batch_size, radius=args.radius, scope=args.scope,
                  num_tangents=args.num_tangents, tangent=args.tangent, estimator=args.estimator,
                  tangents_in_one_pass=args.tangents_in_one_pass, engine=args.engine,
                  backend=args.backend,
                  device=args.device)
    per_method = {
        "fw": dict(step_size=args.fw_step_size, momentum=args.momentum),
        "fgfw": dict(step_size=args.fgfw_step_size),
        "afgfw": dict(step_size=args.afgfw_step_size, averaging_weight=args.averaging_weight),
        "adam": dict(lr=args.lr),
        "sgd": dict(lr=args.lr),
    }
    configs = []
    for method in args.methods:
        overrides = dict(shared, **per_method[method])
        if method in ("adam", "sgd"):
            overrides = {k: overrides[k] for k in ("epochs", "batch_size", "device", "lr")}
        for seed in args.seeds:
            configs.append(config_from_preset(method, args.preset, seed=seed, **overrides))
    return configs


def reproduce(args: argparse.Namespace) -> dict:
    """Trains every method and seed on the paper's network; writes CSV/JSON/PNG; returns the summary."""
    from .data import load

    if args.threads:
        torch.set_num_threads(args.threads)
    train_data, test_data = load(args.data)
    in_features = train_data[0].shape[1]
    _make_out(args.out)
    configs = _reproduce_configs(args)
    name = "digits" if args.data in (None, "digits") else os.path.basename(os.path.normpath(args.data))
    n_params = sum(p.numel() for p in paper_mlp(in_features=in_features).parameters())
    steps = -(-len(train_data[1]) // args.batch_size) * args.epochs
    print(f"{name}: {len(train_data[1])} train / {len(test_data[1])} test images; model {in_features}-10-10-10-10-10 "
          f"({n_params:,} parameters); preset {args.preset!r}; {args.epochs} epochs x "
          f"{steps // max(args.epochs, 1)} steps (batch {args.batch_size}); seeds {args.seeds}", flush=True)
    histories = []
    for cfg in configs:
        torch.manual_seed(cfg.seed)
        model = paper_mlp(in_features=in_features)
        bar = _progress(steps, f"{cfg.method} seed {cfg.seed}", enabled=not args.quiet)
        with warnings.catch_warnings():
            # the paper's radius rescales the default initialisation into the ball: expected, reported below
            warnings.simplefilter("ignore", UserWarning)
            rows = train(cfg, model, train_data, test_data, progress=bar)
        if bar is not None:
            bar.close()
        last = rows[-1]
        print(f"  {cfg.method:<6} seed {cfg.seed}: test accuracy {100 * last['test_accuracy']:6.2f}%, train loss "
              f"{last['train_loss']:.4f}, zeros {last['zeros']}/{n_params}, {last['wall_time_s']:.1f}s", flush=True)
        histories.append(rows)
    summary = summarize(histories)
    rows = [r for h in histories for r in h]
    write_csv(os.path.join(args.out, "history.csv"), rows)
    settings = {cfg.method: {k: v for k, v in cfg.describe().items() if k != "seed"} for cfg in configs}
    report = dict(data=name, train_size=len(train_data[1]), test_size=len(test_data[1]), parameters=n_params,
                  preset=args.preset, seeds=args.seeds, settings=settings, history=rows, summary=summary)
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(report, f, indent=1)
    final = [dict(method=m, **{k: v for k, v in s[-1].items()}) for m, s in summary.items()]
    write_csv(os.path.join(args.out, "summary.csv"), final)
    plot = os.path.join(args.out, "curves.png")
    _plot_curves(plot, summary, f"{name}, paper MLP, preset {args.preset!r}")
    print(f"\nafter {args.epochs} epochs, mean +- std over {len(args.seeds)} seed(s):")
    print(f"{'method':<22} {'test acc (%)':>15} {'train loss':>17} {'zeros':>14} {'time/run':>9} {'peak MiB':>9}")
    for row in final:
        print(f"{LABELS.get(row['method'], row['method']):<22} "
              f"{100 * row['test_accuracy_mean']:7.2f} +- {100 * row['test_accuracy_std']:5.2f} "
              f"{row['train_loss_mean']:8.4f} +- {row['train_loss_std']:6.4f} "
              f"{row['zeros_mean']:7.0f}/{n_params:<6} {row['wall_time_s_mean']:8.1f}s {row['peak_memory_mib_max']:9.0f}")
    print(f"\nwrote {plot}, history.csv, history.json and summary.csv to {args.out}/")
    return summary


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _check_out(parser: argparse.ArgumentParser, out: str) -> None:
    """--out must be a folder that exists or can be made: refuses a file (at it or above it)."""
    path = os.path.abspath(out)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path):
        where = "" if path == os.path.abspath(out) else f" (in {out!r})"
        parser.error(f"argument --out: {path!r}{where} is a file, not a folder; give a folder for the results "
                     f"(it is made if missing)")
    if not os.access(path, os.W_OK | os.X_OK):
        parser.error(f"argument --out: {path!r} is not writable; give a folder for the results that you can write")


def _check_data(parser: argparse.ArgumentParser, data: str | None) -> None:
    """--data must be 'digits' or an existing folder (what is in it, data.mnist_split checks)."""
    if data is None or data == "digits":
        return
    if not os.path.exists(data):
        parser.error(f"argument --data: folder {data!r} does not exist; give 'digits' or a folder of MNIST IDX "
                     f"files (nothing is downloaded)")
    if not os.path.isdir(data):
        parser.error(f"argument --data: {data!r} is a file, not a folder; give the folder that holds the MNIST IDX "
                     f"files (e.g. {os.path.dirname(data) or '.'!r}) or 'digits'")


def _check_device(parser: argparse.ArgumentParser, text: str) -> None:
    """--device must name a device torch has here: checked before any tensor is made on it."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"argument --device: {text!r} is not a torch device; give cpu, cuda or cuda:N")
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            cuda = torch.version.cuda or "none: a CPU-only build"
            parser.error(f"argument --device: {text!r} but torch finds no CUDA device here (torch "
                         f"{torch.__version__}, CUDA {cuda}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            parser.error(f"argument --device: {text!r} but there {'is' if count == 1 else 'are'} {count} CUDA "
                         f"device{'' if count == 1 else 's'} here (cuda:0 to cuda:{count - 1})")
        return
    if device.type == "meta":
        parser.error(f"argument --device: {text!r} tensors hold no data and cannot be trained; use cpu or cuda")
    module = getattr(torch, device.type, None)  # torch.mps, torch.xpu, ...
    if callable(getattr(module, "is_available", None)) and not module.is_available():
        parser.error(f"argument --device: {text!r} but torch finds no {device.type} device here; use --device cpu")
    try:
        torch.empty(0, device=device)
    except Exception as err:  # noqa: BLE001  (whatever the device's runtime raises: reported in one line)
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0]
        parser.error(f"argument --device: {text!r} cannot be used here ({reason}); use --device cpu or cuda")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks the option types cannot make (they need the file system or the machine), before any run."""
    if hasattr(args, "out"):
        _check_out(parser, args.out)
    if hasattr(args, "data"):
        _check_data(parser, args.data)
    if hasattr(args, "device"):
        _check_device(parser, args.device)


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers such as 0,1,2, got {text!r}")
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed")
    return seeds


def _method_list(text: str) -> list[str]:
    methods = [m.strip().lower() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"methods must be a comma-separated list from {','.join(METHODS)}, got {text!r}")
    return methods


def _add_reproduce_parser(sub) -> None:
    p = sub.add_parser(
        "reproduce", help="the paper's MNIST experiment: FW, FGFW, AFGFW (and Adam) on the 784-10-10-10-10-10 MLP",
        description="Trains the paper's network with FW (backprop), FGFW and AFGFW under an L1 constraint and "
                    "writes per-epoch CSV/JSON and curves. Settings come from a preset ('tuned': what trains, the "
                    "default; 'paper': Section V read literally, which stays near chance) and any option given here "
                    "overrides them for every method it applies to.")
    p.add_argument("--data", default="digits",
                   help="'digits' (scikit-learn's 8x8 digits, the default) or a folder of MNIST IDX files (gzip or "
                        "raw; the test set alone is split 8,000/2,000), e.g. ../shared/data/mnist")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tuned")
    p.add_argument("--paper", dest="preset", action="store_const", const="paper",
                   help="the paper's exact setting: radius 1e-4 per tensor, alpha_k = 2/(k+2) (FW, FGFW), "
                        "alpha_k = 1/k and gamma_k = 1/sqrt(k) (AFGFW), one Gaussian tangent (= --preset paper)")
    p.add_argument("--methods", type=_method_list, default=["fw", "fgfw", "afgfw", "adam"],
                   help=f"comma-separated, from {','.join(METHODS)} (default fw,fgfw,afgfw,adam)")
    p.add_argument("--epochs", type=_positive_int, default=20)
    p.add_argument("--batch-size", type=_positive_int, default=64)
    p.add_argument("--seeds", type=_seed_list, default=[0, 1, 2], help="comma-separated (default 0,1,2)")
    p.add_argument("--radius", default=None,
                   help="L1 radius: a number, or 'init:S' = S x each ball's initial L1 norm (preset: tuned init:5, "
                        "paper 1e-4)")
    p.add_argument("--scope", choices=("tensor", "row", "global"), default=None,
                   help="one L1 ball per tensor, per unit (row) or over all parameters (preset: tuned row, paper "
                        "tensor)")
    p.add_argument("--fw-step-size", default=None, help="FW alpha_k: a constant, 2/(k+2), 1/k, 1/sqrt(k), or linear:A (A decayed linearly to 2%% of "
                        "A over the run; preset: tuned linear:0.004, paper 2/(k+2))")
    p.add_argument("--fgfw-step-size", default=None, help="FGFW alpha_k (as --fw-step-size; preset: tuned linear:0.004, paper 2/(k+2))")
    p.add_argument("--afgfw-step-size", default=None, help="AFGFW alpha_k (as --fw-step-size; preset: tuned linear:0.004, paper 1/k)")
    p.add_argument("--averaging-weight", default=None, help="AFGFW gamma_k: a constant or 1/sqrt(k) (preset: tuned 0.1, paper 1/sqrt(k))")
    p.add_argument("--momentum", type=float, default=None, help="FW momentum rho (0 = none; preset: tuned 0.9, paper none)")
    p.add_argument("--num-tangents", type=_positive_int, default=None,
                   help="forward passes (tangents) per FGFW/AFGFW step (preset: tuned 16, paper 1)")
    p.add_argument("--tangent", choices=("gaussian", "rademacher"), default=None)
    p.add_argument("--estimator", choices=ESTIMATORS, default=None,
                   help="FGFW/AFGFW gradient estimate: 'weight' (the paper's: tangents over the parameters) or "
                        "'activity' (tangents over the linear layers' outputs, fgfw.activity) (preset: tuned "
                        "activity, paper weight)")
    p.add_argument("--tangents-in-one-pass", action=argparse.BooleanOptionalAction, default=None,
                   help="carry the tangents of a step through one forward pass (vmap), or one pass each (preset: "
                        "tuned yes, paper no; with --estimator weight it needs the lean engine)")
    p.add_argument("--engine", choices=sorted(ENGINES), default=None,
                   help=f"forward-mode engine of the 'weight' estimator: {', '.join(sorted(ENGINES))} (default: "
                        f"{DEFAULT_ENGINE}; forward_ad is the fastest for this tiny network on the CPU)")
    p.add_argument("--lr", type=float, default=None, help="Adam / SGD learning rate (no constraint)")
    p.add_argument("--backend", default=None, help="cuda | triton | cpu | torch | auto (default: auto)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    _add_threads_option(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", default="results/reproduce", help="folder for the CSV/JSON files and curves.png")
    p.set_defaults(run=reproduce)


def _add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_non_negative_int, default=1,
                   help="torch CPU threads (default 1: the paper's network is too small to gain from more; on a "
                        "2-core machine 2 threads ran the demo 2.5 to 20x slower than 1; 0 = torch's default)")


def _add_demo_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="train the paper's MLP shape on scikit-learn's digits with FW, FGFW, AFGFW",
        description="Trains the paper's network shape (64-10-10-10-10-10 ReLU, 1,090 parameters) on scikit-learn's "
                    "8x8 digits with FW (backprop), FGFW (Alg. 1) and AFGFW (Alg. 2) under an L1 constraint, with "
                    "the 'tuned' preset of `fgfw reproduce`; prints a line per epoch and a final table, and writes "
                    "a CSV per method, summary.json and loss_curves.png. Needs the 'demo' extra (scikit-learn, "
                    "matplotlib).")
    p.add_argument("--epochs", type=_positive_int, default=30, help="epochs per method (default %(default)s)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="minibatch size (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation, batches and tangents "
                                                         "(default %(default)s)")
    p.add_argument("--backend", default=None, help="cuda | triton | cpu | torch | auto (default: auto)")
    _add_threads_option(p)
    p.add_argument("--out", default="results/demo",
                   help="folder for the CSVs, summary.json and loss_curves.png (default %(default)s)")
    p.set_defaults(run=demo)


def _add_info_parser(sub) -> None:
    p = sub.add_parser(
        "info", help="versions, the extension's CUDA architectures, and which backends run where (and why not)",
        description="Prints the fgfw, Python, torch, triton and CUDA versions, the GPUs, the compiled extension and "
                    "its CUDA architectures, and for every device which backends can run there and, where one "
                    "cannot, why.")
    p.add_argument("--bench", action="store_true",
                   help=f"also measure, for {BENCH_SECONDS:g} seconds, the copy bandwidth and the fused step's "
                        f"fraction of it (on the first GPU, else the CPU)")
    p.set_defaults(run=lambda args: info.main(BENCH_SECONDS if args.bench else None))


BENCH_SECONDS = 5.0
DEMO_EXTRA = "demo"  # pyproject.toml's [project.optional-dependencies]: what the CLI needs beyond fgfw


def _missing_packages(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(pip name, what needs it) of each optional package ``args``'s command needs and is not installed."""
    needs = []
    if args.command == "demo" or (args.command == "reproduce" and args.data in (None, "digits")):
        needs.append(("sklearn", "scikit-learn", "the digits data"))
    if args.command in ("demo", "reproduce"):
        needs.append(("matplotlib", "matplotlib", "the curves"))
    # tqdm is optional: without it the progress is printed as plain lines
    return [(name, why) for module, name, why in needs if importlib.util.find_spec(module) is None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fgfw", description=__doc__)
    from . import __version__
    parser.add_argument("--version", action="version", version=f"fgfw {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_parser(sub)
    _add_reproduce_parser(sub)
    _add_info_parser(sub)
    args = parser.parse_args(argv)
    _check_args(sub.choices[args.command], args)
    missing = _missing_packages(args)
    if missing:
        # checked before any data is read or any training runs: not after minutes of training, at the plot
        names = " ".join(name for name, _ in missing)
        print(f"fgfw {args.command}: error: missing {', '.join(f'{n} (for {why})' for n, why in missing)}: install "
              f"fgfw's '{DEMO_EXTRA}' extra (pip install --no-build-isolation '.[{DEMO_EXTRA}]' in fgfw's source "
              f"folder) or pip install {names}", file=sys.stderr)
        sys.exit(2)
    try:
        args.run(args)
    except (FileNotFoundError, ValueError) as err:
        # data and settings errors are the user's to fix: the message says how, a traceback adds nothing
        print(f"fgfw {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)
