"""Real models nobody here wrote: torchvision's resnet18 (BatchNorm in train mode) and Hugging Face's GPT-2 and
LLaMA causal LMs (tiny configs, random init, nothing downloaded), with every optimizer and every set.

Each is built in one line (plus fgfw.param_groups where a set takes matrices only), steps 5 times (resnet18:
2, and 1 for the matrix sets) with a finite loss, keeps every ball feasible after every step, and survives
a state_dict round trip. Skips with
a reason where torchvision or transformers is not installed (the 'models' extra; CI installs it).
"""
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import fgfw
from fgfw.constraints import Unconstrained

torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed (pip install 'fgfw[models]')")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (pip install 'fgfw[models]')")

STEPS = 5
# resnet18 has 11 M parameters in 4608-wide matrices: fewer steps there, one for the sets whose vertex and
# feasibility check take a factorisation per matrix (the checks, not the steps, are what costs on a CPU)
RESNET_STEPS, RESNET_MATRIX_SET_STEPS = 2, 1
MATRIX_SETS = ("nuclear", "group_l1", "spectral", "column")


def resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    return model, lambda reduction="mean": F.cross_entropy(model(x), y, reduction=reduction)


def _causal_lm(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    tokens = torch.randint(0, config.vocab_size, (3, 12))

    def loss(reduction="mean"):
        logits = model(input_ids=tokens).logits[:, :-1]
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
        per_example = per_token.view(tokens.shape[0], -1).mean(1)
        return per_example if reduction == "none" else per_example.mean()
    return model, loss


def gpt2():
    return _causal_lm(transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def llama():
    return _causal_lm(transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               max_position_embeddings=16))


MODELS = {"resnet18": resnet, "gpt2": gpt2, "llama": llama}


def _feasible(opt, rtol=1e-5) -> None:
    """Every ball of every group inside its set (per tensor, row or global, as the group's scope says)."""
    for g, group in enumerate(opt.param_groups):
        c = group["constraint"]
        if isinstance(c, Unconstrained):
            continue
        params, radii = group["params"], group["radii"]
        if c.global_ball:
            balls = [(torch.cat([p.detach().reshape(-1) for p in params]), radii[0])]
        elif c.scope == "row":
            balls = [(row, r) for p, rs in zip(params, radii) for row, r in zip(c.rows(p), rs)]
        else:
            balls = [(p.detach(), r) for p, r in zip(params, radii)]
        for values, r in balls:
            assert c.contains(values, r, rtol=rtol), f"group {g} ({c!r}): a ball of radius {r} left its set"


def _round_trip(opt, make_again):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    again = make_again()
    again.load_state_dict(torch.load(buffer, weights_only=True))
    assert len(again.param_groups) == len(opt.param_groups)
    for a, b in zip(again.param_groups, opt.param_groups):
        assert a["radii"] == b["radii"] and type(a["constraint"]) is type(b["constraint"])


def _train(model, loss, make_opt, per_example=False, closure=True, steps=STEPS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starts moved into the smaller balls
        opt = make_opt()
    for _ in range(steps):
        if closure:
            value = opt.step(lambda: loss("none" if per_example else "mean"))
        else:
            opt.zero_grad()
            value = loss()
            value.backward()
            opt.step()
        assert math.isfinite(float(value if value.dim() == 0 else value.mean()))
        _feasible(opt)
    return opt


# the standard recipe of the stochastic Frank-Wolfe literature, with every optimizer, on every model
RECIPE = lambda: fgfw.KSparsePolytope.from_init_diameter(1.0, k=100)  # noqa: E731
OPTIMIZERS = {
    "frank_wolfe": dict(cls=fgfw.FrankWolfe, closure=False),
    "fgfw": dict(cls=fgfw.FGFW, kwargs=dict(num_tangents=2)),
    "afgfw_lean": dict(cls=fgfw.AFGFW, kwargs=dict(engine="lean")),
    "afgfw_forward_ad": dict(cls=fgfw.AFGFW, kwargs=dict(engine="forward_ad")),
    "afgfw_activity": dict(cls=fgfw.AFGFW, kwargs=dict(estimator="activity"), per_example=True),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_optimizer_builds_in_one_line_and_trains(name, optimizer):
    model, loss = MODELS[name]()
    spec = OPTIMIZERS[optimizer]
    kwargs = dict(spec.get("kwargs", {}), constraint=RECIPE())

    def make():
        if spec["cls"] is fgfw.FrankWolfe:
            return fgfw.FrankWolfe(model, momentum=0.9, **kwargs)
        return spec["cls"](model, seed=0, **kwargs)
    opt = _train(model, loss, make, per_example=spec.get("per_example", False), closure=spec.get("closure", True),
                 steps=RESNET_STEPS if name == "resnet18" else STEPS)
    _round_trip(opt, make)


SETS = {
    "l1": lambda: fgfw.L1Ball.relative_to_init(2.0),
    "l2": lambda: fgfw.L2Ball.from_init_diameter(1.0),
    "linf": lambda: fgfw.LInfBall.relative_to_init(2.0),
    "lp": lambda: fgfw.LpBall.relative_to_init(1.5, p=1.5),
    "ksparse_row": lambda: fgfw.KSparsePolytope.from_init_diameter(1.0, k=8, scope="row"),
    "simplex": lambda: fgfw.Simplex.relative_to_init(1.0),
    "nonneg_l1": lambda: fgfw.NonnegativeL1Ball.relative_to_init(1.0),
    "nuclear": lambda: fgfw.NuclearNormBall.relative_to_init(1.0),
    "group_l1": lambda: fgfw.GroupL1Ball.relative_to_init(1.0),
    "spectral": lambda: fgfw.SpectralNormBall.operator_norm(1.0),
    "column": lambda: fgfw.ColumnNormBall.relative_to_init(1.5),
}


@pytest.mark.parametrize("set_name", sorted(SETS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_set_trains_through_param_groups(name, set_name):
    """The weights in the set, biases and norms unconstrained, embeddings in an L-infinity ball."""
    model, loss = MODELS[name]()

    def make():
        groups = fgfw.param_groups(model, weights=SETS[set_name](), biases=None,
                                   norms={"constraint": None, "step_size": 1e-3},
                                   embeddings=fgfw.LInfBall.relative_to_init(2.0))
        return fgfw.FrankWolfe(groups, constraint=fgfw.L1Ball(radius=1.0), momentum=0.9)
    steps = STEPS if name != "resnet18" else RESNET_MATRIX_SET_STEPS if set_name in MATRIX_SETS else RESNET_STEPS
    opt = _train(model, loss, make, closure=False, steps=steps)
    _round_trip(opt, make)


@pytest.mark.parametrize("name", ["gpt2"])
def test_the_compiled_step_matches_eager(name):
    runs = []
    for compiled in (False, True):
        model, loss = MODELS[name]()
        opt = fgfw.FrankWolfe(fgfw.param_groups(model, weights=RECIPE(), biases=None, norms=None, embeddings=None),
                              constraint=fgfw.L1Ball(radius=1.0), momentum=0.9, check_finite=False, backend="cpu")
        step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
        for _ in range(3):
            opt.zero_grad()
            loss().backward()
            step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
