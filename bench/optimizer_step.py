"""Time of one whole optimizer step (issues 24 and 29): fgfw's FrankWolfe against torch.optim.AdamW and
torch.optim.Muon on Hugging Face GPT-2 and on one large tensor, with the same fixed gradients.

Each method's optimizers step the parameters with gradients drawn once; the step alone is timed (no forward or
backward): the median of --repeats timed steps after --warmup untimed ones, every method of a model interleaved
in one process so that the ratios share the machine's state. On a GPU each step is synchronised before and after,
so a host-bound step shows its host time. Methods (issue 29's names):

* ``adamw_fused``, ``adamw_foreach``: torch.optim.AdamW(fused=True), AdamW(foreach=True);
* ``muon``: torch.optim.Muon on the hidden matrices (2-D, in the transformer blocks) + AdamW(fused) on the rest;
* ``fw_readme_groups``: FrankWolfe (momentum 0.9) with the README's groups: row L1 balls on the weights, biases and
  norms unconstrained, an L-infinity ball on the embeddings;
* ``fw_l1``: FrankWolfe (momentum 0.9), one L1 ball per tensor over every tensor; ``fw_l1_nonfinite_op``: the same
  with the finite check in the fused op ``fgfw::nonfinite`` on CUDA (``_ops.CUDA_NONFINITE_OP``; the CPU's check is
  that op already, so there the row repeats ``fw_l1``);
* ``fw_scion``: FrankWolfe on Scion's sets: spectral-norm balls (bfloat16 quintic Newton-Schulz, as Muon's
  products) on the hidden matrices, L-infinity balls on the embeddings, biases and norms unconstrained;
  ``fw_scion_f32``: the same in float32; ``fw_scion_unbatched``: one Newton-Schulz per matrix
  (``SpectralNormBall.batch_vertices`` off; on the CPU that is the default, ``BATCH_ON_CPU``);
* ``afgfw_update``: AFGFW with the README's groups, the update alone after its forward pass (the fused step that
  regenerates the tangent; the forward-mode pass is bench/real_models.py's business);
* one tensor (model ``single_<numel>``): ``copy`` (dst.copy_(src), the memory roof), ``adamw_fused``,
  ``adamw_foreach``, ``fw_l1`` (the default check_finite), ``fw_l1_nonfinite_op``, ``fw_l1_unchecked``
  (check_finite=False).

    python bench/optimizer_step.py --device cuda --preset gpt2     # GPT-2 small (124 M) and one 1e8 tensor
    python bench/optimizer_step.py --preset small --threads 1      # a 4 x 256 GPT-2 and one 1e7 tensor, CPU

Rows go to --out (default bench/results/optimizer_step_{gpu,cpu}.csv): device, model, method, median_ms,
x_adamw_fused, parameters, tensors, threads, torch, fgfw.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import fgfw
from fgfw import _ops
from fgfw.experiments import write_csv

HERE = Path(__file__).resolve().parent
# Hugging Face GPT2Config sizes, and the numel of the one-tensor model
PRESETS = {"gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, single=100_000_000),
           "small": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=50257, n_positions=256, single=10_000_000),
           "quick": dict(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, single=100_000)}
GPT2_METHODS = ("adamw_fused", "adamw_foreach", "muon", "fw_readme_groups", "fw_l1", "fw_l1_nonfinite_op", "fw_scion",
                "fw_scion_f32", "fw_scion_unbatched", "afgfw_update")
SINGLE_METHODS = ("copy", "adamw_fused", "adamw_foreach", "fw_l1", "fw_l1_nonfinite_op", "fw_l1_unchecked")


def gpt2(size: dict, device: torch.device):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = {k: v for k, v in size.items() if k != "single"}
    with device:  # initialised where it runs: seconds less per GPT-2 small on a GPU
        return GPT2LMHeadModel(GPT2Config(**config, bos_token_id=0, eos_token_id=0))


def hidden_matrices(model) -> list[torch.Tensor]:
    """The 2-D parameters inside the transformer blocks (Muon's and the spectral balls' share)."""
    return [p for name, p in model.named_parameters() if p.dim() == 2 and ".h." in f".{name}"]


def readme_groups(model) -> list[dict]:
    """The README's param groups (its quick start)."""
    return fgfw.param_groups(model, weights=fgfw.L1Ball.relative_to_init(5.0, scope="row"), biases=None,
                             norms={"constraint": None, "step_size": 1e-3},
                             embeddings=fgfw.LInfBall.relative_to_init(2.0))


def make_optimizers(method: str, model) -> list:
    """The optimizer(s) of a method on ``model`` (a module or, for the one-tensor model, a list of one parameter):
    a list, stepped together."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    if method == "adamw_fused":
        return [torch.optim.AdamW(params, lr=1e-3, fused=True)]
    if method == "adamw_foreach":
        return [torch.optim.AdamW(params, lr=1e-3, foreach=True)]
    if method == "muon":
        hidden = hidden_matrices(model)
        ids = {id(p) for p in hidden}
        return [torch.optim.Muon(hidden, lr=1e-2, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW([p for p in params if id(p) not in ids], lr=1e-3, fused=True)]
    if method == "fw_readme_groups":
        return [fgfw.FrankWolfe(readme_groups(model), constraint=fgfw.L1Ball(radius=1.0), momentum=0.9)]
    if method in ("fw_l1", "fw_l1_nonfinite_op", "fw_l1_unchecked"):
        return [fgfw.FrankWolfe(params, constraint=fgfw.L1Ball.relative_to_init(2.0), momentum=0.9,
                                check_finite=method != "fw_l1_unchecked")]
    if method.startswith("fw_scion"):
        hidden = hidden_matrices(model)
        ids = {id(p) for p in hidden}
        spectral = fgfw.SpectralNormBall.operator_norm(
            2.0, quintic_dtype="float32" if method == "fw_scion_f32" else "bfloat16")
        groups = fgfw.param_groups(model, weights=fgfw.LInfBall.relative_to_init(2.0), biases=None, norms=None,
                                   embeddings=fgfw.LInfBall.relative_to_init(2.0))
        for group in groups:  # the hidden matrices leave the weights' group for the spectral balls
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        groups = [g for g in groups if g["params"]] + [{"params": hidden, "constraint": spectral}]
        return [fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=1.0), momentum=0.9)]
    if method == "afgfw_update":
        return [fgfw.AFGFW(model, params=readme_groups(model), constraint=fgfw.L1Ball(radius=1.0), seed=0)]
    raise ValueError(f"unknown method {method!r}")


class Case:
    """One method on one model: its optimizers and how to step them."""

    def __init__(self, method: str, model, device: torch.device):
        self.method = method
        if method == "copy":
            (p,) = model
            self.src, self.dst = p.grad, torch.empty_like(p)
            self.opts = []
            return
        self.opts = make_optimizers(method, model)
        self.coeffs = torch.full((1,), 1e-3, dtype=torch.float64, device=device)  # afgfw_update's <grad f, u>

    def step(self) -> None:
        if self.method == "copy":
            self.dst.copy_(self.src)
        elif self.method == "afgfw_update":  # step() after its forward pass
            self.opts[0]._update_from_coefficients(self.coeffs)
        else:
            for opt in self.opts:
                opt.step()


def with_gradients(params, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(1)
    for p in params:
        p.grad = 1e-3 * torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype)


def timed(case: Case, device: torch.device) -> float:
    saved = fgfw.SpectralNormBall.batch_vertices, _ops.CUDA_NONFINITE_OP
    if case.method == "fw_scion_unbatched":
        fgfw.SpectralNormBall.batch_vertices = None  # the optimizer then calls vertex() once per matrix
    if case.method == "fw_l1_nonfinite_op":
        _ops.CUDA_NONFINITE_OP = True  # the finite check in fgfw::nonfinite on CUDA (the CPU's is that op already)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        case.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - begin
    finally:
        fgfw.SpectralNormBall.batch_vertices, _ops.CUDA_NONFINITE_OP = saved


def measure(model_name: str, cases: dict[str, Case], device: torch.device, warmup: int, repeats: int,
            info: dict) -> list[dict]:
    times = {m: [] for m in cases}
    for i in range(warmup + repeats):
        for m, case in cases.items():  # interleaved: every method sees the same machine state
            t = timed(case, device)
            if i >= warmup:
                times[m].append(t)
    medians = {m: 1e3 * statistics.median(ts) for m, ts in times.items()}
    base = medians.get("adamw_fused", float("nan"))
    rows = []
    print(f"\n{model_name}: {info['parameters']:,} parameters in {info['tensors']} tensors")
    print("| method | ms per optimizer step (median) | x AdamW(fused) |")
    print("|---|---:|---:|")
    for m, ms in medians.items():
        rows.append(dict(device=str(device), model=model_name, method=m, median_ms=ms, x_adamw_fused=ms / base,
                         **info))
        print(f"| {m} | {ms:.3f} | {ms / base:.2f} |", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", nargs="*", choices=GPT2_METHODS, default=list(GPT2_METHODS),
                        help="the GPT-2 rows (none: skip that model, which needs transformers)")
    parser.add_argument("--single-methods", nargs="*", choices=SINGLE_METHODS, default=list(SINGLE_METHODS),
                        help="the one-tensor rows (none: skip that model)")
    parser.add_argument("--single-numel", type=float, default=None, help="default: the preset's")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    size = PRESETS[args.preset]
    common = dict(threads=torch.get_num_threads(), torch=torch.__version__, fgfw=fgfw.__version__)
    print(f"# preset {args.preset}; device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}; torch "
          f"{torch.__version__}; {torch.get_num_threads()} threads; warm-up {args.warmup}, median of {args.repeats}")
    rows = []
    if args.methods:
        cases = {}
        for m in args.methods:
            model = gpt2(size, device)  # each method its own copy: the steps change the parameters
            with_gradients(model.parameters(), device)
            cases[m] = Case(m, model, device)
        params = list(model.parameters())
        rows += measure("gpt2" if args.preset == "gpt2" else f"gpt2_{args.preset}", cases, device, args.warmup,
                        args.repeats, dict(parameters=sum(p.numel() for p in params), tensors=len(params), **common))
        del cases, model, params
    if args.single_methods:
        numel = int(args.single_numel or size["single"])
        cases = {}
        for m in args.single_methods:
            torch.manual_seed(0)
            p = torch.nn.Parameter(0.01 * torch.randn(numel, device=device))
            with_gradients([p], device)
            cases[m] = Case(m, [p], device)
        rows += measure(f"single_{numel:.0e}".replace("e+0", "e").replace("e+", "e"), cases, device, args.warmup,
                        args.repeats, dict(parameters=numel, tensors=1, **common))
    out = args.out or HERE / "results" / f"optimizer_step_{'gpu' if device.type == 'cuda' else 'cpu'}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out, rows)
    print(f"\nCSV: {out}")


if __name__ == "__main__":
    main()
