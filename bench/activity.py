"""The two forward-gradient estimators side by side: quality, memory and time against backprop.

For each MLP (all parameters in nn.Linear layers, which the activity estimator needs) and batch size:

* quality: the cosine between the estimate and the backprop gradient of the same batch (the first
  images of the MNIST split when ``--data`` names an MNIST folder, the default ../shared/data/mnist when
  it exists; otherwise bench/memory.py's random batch), mean over ``--draws`` tangent draws, for the weight estimator (the paper's, u over the parameters; the lean
  engine) and the activity estimator (fgfw.activity, u over the linear outputs), K = 1 and 16 tangents;
* transient memory of the call (``fgfw.lean.measure_peak``, as bench/memory.py) and its median time,
  beside a no_grad forward and a backprop step (forward + backward); the activity estimator both
  keeping the linear layers' inputs and with ``recompute_inputs`` (a second, plain forward instead).

The weight estimate is c u over all parameters, so its cosine is ~sqrt(K / d); the activity estimate's
noise grows with the number of perturbed activations per example instead. Writes bench/activity.csv.

    PYTHONPATH=python python bench/activity.py [--quick] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from fgfw import _ops
from fgfw.activity import activity_gradients
from fgfw.experiments import write_csv
from fgfw.forward_grad import ENGINES
from fgfw.lean import measure_peak
from memory import MODELS, TangentSource, batch, median_times

HERE = Path(__file__).resolve().parent
CASES = {"paper_net": (64, 4096), "deep_mlp": (256, 2048), "deep_wide_mlp": (512,)}
QUICK_CASES = {"paper_net": (64,), "deep_mlp": (128,)}
KS = (1, 16)


def activity_source(backend, draw):
    def make(out, offset, t):
        return _ops.fill_tangent_(out, 1, 1 + draw, t, offset, 0, backend)
    return make


def cosine(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def run_case(name, size, device, repeats, draws, images=None):
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    x, y = (images[0][:size], images[1][:size]) if images is not None and size <= len(images[1]) else batch(name, size)
    x, y = x.to(device), y.to(device)
    params = list(model.parameters())
    backend = _ops.resolve_backend(None, device)
    mean_loss = lambda: F.cross_entropy(model(x), y)  # noqa: E731
    example_losses = lambda: F.cross_entropy(model(x), y, reduction="none")  # noqa: E731
    exact = torch.cat([g.reshape(-1) for g in torch.autograd.grad(mean_loss(), params)])

    offsets = [sum(p.numel() for p in params[:j]) for j in range(len(params))]

    def weight_tangents(k, draw):  # (K, *p.shape) for parameter j, from the stream; draw picks the step
        return lambda j: torch.stack([_ops.fill_tangent_(torch.empty_like(params[j]), 1, 1 + draw, t, offsets[j], 0,
                                                         backend) for t in range(k)])

    def weight_estimate(k, draw=0):
        make = weight_tangents(k, draw)
        if k == 1:
            _, c = ENGINES["lean"](model, params, lambda j: make(j)[0], mean_loss)
            c = c.reshape(1)
        else:
            _, c = ENGINES["lean"].batched(model, params, make, mean_loss, k)
        u = torch.cat([make(j).reshape(k, -1) for j in range(len(params))], 1)
        return (c.to(u.dtype) @ u) / k

    def activity_estimate(k, draw=0):
        _, grads = activity_gradients(model, params, example_losses, activity_source(backend, draw), k, k > 1)
        return torch.cat([grads[id(p)].reshape(-1) for p in params])

    def forward():
        with torch.no_grad():
            mean_loss()

    def backprop():
        mean_loss().backward()
        model.zero_grad(set_to_none=True)

    calls = {"no_grad_forward": forward, "backprop": backprop}
    for k in KS:
        # the weight estimator's call: the directional derivatives only (the update regenerates u in the kernel)
        calls[f"weight_k{k}"] = (lambda k=k: ENGINES["lean"](model, params, TangentSource(params, backend).one, mean_loss)
                                 if k == 1 else ENGINES["lean"].batched(model, params,
                                                                        TangentSource(params, backend).stacked(k),
                                                                        mean_loss, k))
        calls[f"activity_k{k}"] = lambda k=k: activity_gradients(model, params, example_losses,
                                                                 activity_source(backend, 0), k, k > 1)
        # the same estimate, from a second plain forward instead of kept layer inputs
        calls[f"activity_recompute_k{k}"] = lambda k=k: activity_gradients(model, params, example_losses,
                                                                           activity_source(backend, 0), k, k > 1, True)
    transients = {}
    for call, fn in calls.items():
        fn()  # warm-up
        transients[call] = measure_peak(fn, device)[1]
    seconds = median_times(calls, repeats, device)
    quality = {}
    for k in KS:
        quality[f"weight_k{k}"] = sum(cosine(weight_estimate(k, d), exact) for d in range(draws)) / draws
        quality[f"activity_k{k}"] = sum(cosine(activity_estimate(k, d), exact) for d in range(draws)) / draws
        quality[f"activity_recompute_k{k}"] = quality[f"activity_k{k}"]  # the same estimate (tests/test_activity.py)
    return [dict(model=name, batch=size, call=call, parameters=exact.numel(), cosine_to_gradient=quality.get(call, ""),
                 transient_mib=transients[call] / 2**20, transient_vs_backprop=transients[call] / transients["backprop"],
                 ms=seconds[call] * 1e3, time_vs_backprop=seconds[call] / seconds["backprop"]) for call in calls]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="small batches, one repeat, two draws")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--data", default=str(HERE.parent.parent / "shared" / "data" / "mnist"),
                        help="MNIST folder for the batches (default ../shared/data/mnist; random data without it)")
    parser.add_argument("--out", default=str(HERE / "activity.csv"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cases = QUICK_CASES if args.quick else CASES
    repeats, draws = (1, 2) if args.quick else (args.repeats, args.draws)
    images = None
    if Path(args.data).is_dir():
        from fgfw.data import mnist_split
        images = mnist_split(args.data)[0]
    rows = []
    print(f"data: {'MNIST training images from ' + args.data if images is not None else 'random (bench/memory.py)'}")
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"device {device}")
    print("model          batch  call                     cos(est, grad)  transient MiB  /backprop   ms      /backprop")
    for name, sizes in cases.items():
        for size in sizes:
            for r in run_case(name, size, device, repeats, draws, images):
                rows.append(r)
                cos = f"{r['cosine_to_gradient']:.3f}" if r["cosine_to_gradient"] != "" else "-"
                print(f"{name:14s} {size:<6d} {r['call']:24s} {cos:>14s}  {r['transient_mib']:13.2f}  "
                      f"{r['transient_vs_backprop']:9.2f}  {r['ms']:8.2f}  {r['time_vs_backprop']:8.2f}", flush=True)
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
