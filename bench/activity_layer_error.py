"""Per-layer error of the activity estimator against autograd on the text task's model (issue 31, item 2).

The model and batch are bench/finetune.py's text task: the byte-level GPT-2 (2 layers x 128) pre-trained on
Python's standard library, one training batch (16 x 64) of torch's c10 headers, per-example losses. For each
``tangent_scale`` the estimate with K tangents in one pass is compared with autograd's gradient of the mean
loss, per parameter: ``||g_hat - g|| / ||g||``, times sqrt(K) to give one tangent's error (the K estimates
are independent, so the mean's squared error is one tangent's over K), the mean over ``--draws`` seeds.

It also prints each perturbed output's share of ``Var(c_b) = sum_l sigma_l^2 ||dL_b/dz_l||^2`` (autograd's
per-example output gradients; sigma_l = 1, or the output's RMS): which outputs' noise every estimate carries.

Fewer perturbed sites per pass (``sites``): besides every layer at once (``all``), the estimator is given the
LayerNorms' parameters alone (``layernorms``: only their outputs are perturbed, and ``c_b`` carries only their
noise) and every other parameter alone (``others``), the two halves of a run that alternates them pass by pass.
Each parameter's error is then read in the configuration that holds it.

    python bench/activity_layer_error.py            # writes bench/results/activity_layer_error.csv
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import finetune  # noqa: E402
from fgfw import _ops, activity, reference  # noqa: E402
from fgfw.experiments import write_csv  # noqa: E402


def output_energies(model, layers, closure):
    """(name, per-example mean of ||dL_b/dz||^2, RMS of z) for each perturbed output, by autograd."""
    names = {m: n for n, m in model.named_modules()}
    outputs = []

    def hook(layer, args, out):
        out.retain_grad()
        outputs.append((names[layer], out))
    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        with torch.enable_grad():
            losses = closure()
            losses.sum().backward()  # d(sum_b L_b)/dz_b = dL_b/dz_b
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    n = len(losses)
    return [(name, float(z.grad.double().square().sum()) / n, float(z.detach().double().square().mean().sqrt()))
            for name, z in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tangents", type=int, default=32, help="K, in one pass")
    parser.add_argument("--draws", type=int, default=3, help="seeds averaged per parameter")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 5 pre-training steps, K = 2, one draw")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--pretrained", default=None, metavar="FILE",
                        help="bench/finetune.py's cache of the pre-trained text model (--pretrained there)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tangents, draws = (2, 1) if args.quick else (args.tangents, args.draws)
    task = finetune.TextTask(args.quick)
    model = finetune.pretrain_cached(task, args.pretrained, "byte", args.quick)[0].eval()
    batch = task.batch("train", torch.Generator().manual_seed(5))

    def closure():
        return task.loss(model, batch, per_example=True)
    params = list(model.parameters())
    layers = activity.perturbed_layers(model, params)
    energies = output_energies(model, layers, closure)
    for rule in activity.TANGENT_SCALES:
        sigma = [(rms if rule == "rms" else 1.0) ** 2 * energy for _, energy, rms in energies]
        print(f"tangent_scale={rule!r}: each output's share of Var(c_b)")
        for (name, energy, rms), share in zip(energies, sigma):
            print(f"  {name:30s} rms {rms:7.4f}  ||dL_b/dz||^2 {energy:9.3e}  share {share / sum(sigma):6.1%}")
    with torch.enable_grad():
        exact = dict(zip(map(id, params), torch.autograd.grad(closure().mean(), params)))
    norms = finetune.layernorm_params(model)
    sites = {"all": params, "layernorms": [p for p in params if id(p) in norms],
             "others": [p for p in params if id(p) not in norms]}
    rows = []
    for site, perturbed in sites.items():
        for rule in activity.TANGENT_SCALES:
            errors = {name: [] for name, p in model.named_parameters() if any(p is q for q in perturbed)}
            for draw in range(draws):
                def fill(out, offset, t, seed=100 + draw):
                    return _ops.fill_tangent_(out, seed, torch.tensor(1), t, offset, reference.GAUSSIAN, "cpu")
                grads = activity.activity_gradients(model, perturbed, closure, fill, tangents, True,
                                                    tangent_scale=rule)[1]
                for name, p in model.named_parameters():
                    if name in errors:
                        g = exact[id(p)]
                        errors[name].append(float((grads[id(p)] - g).norm() / g.norm()) * math.sqrt(tangents))
            for name, values in errors.items():
                rows.append(dict(parameter=name, sites=site, tangent_scale=rule, tangents=tangents, draws=draws,
                                 relative_error_one_tangent=sum(values) / len(values)))
    by = {(r["parameter"], r["sites"], r["tangent_scale"]): r["relative_error_one_tangent"] for r in rows}
    print(f"\none tangent's relative error ||g_hat - g|| / ||g|| (sqrt(K) x that of K = {tangents}, mean of "
          f"{draws} draws); 'alone': the LayerNorms or the other layers perturbed without the rest; the last column "
          f"charges an alternating run's two passes: unit / (alone x sqrt(2))")
    print(f"  {'parameter':36s} {'unit':>9s} {'rms':>9s} {'unit/rms':>9s} {'alone':>9s} {'alone rms':>9s} "
          f"{'unit/alone/sqrt2':>16s}")
    for name, p in model.named_parameters():
        unit, rms = by[(name, "all", "unit")], by[(name, "all", "rms")]
        site = "layernorms" if id(p) in norms else "others"
        alone, alone_rms = by[(name, site, "unit")], by[(name, site, "rms")]
        print(f"  {name:36s} {unit:9.1f} {rms:9.1f} {unit / rms:9.1f} {alone:9.1f} {alone_rms:9.1f} "
              f"{unit / alone / math.sqrt(2):16.1f}")
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "activity_layer_error.csv"), rows)


if __name__ == "__main__":
    main()
