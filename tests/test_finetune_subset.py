"""bench/finetune.py's issue-31 methods. First its subset fine-tuning: ``subset_params`` picks every LayerNorm and
bias parameter, and a ``*_subset`` method moves those and leaves every other parameter bit for bit as it was; then
the settings and steps that the other methods' names stand for."""
import importlib.util
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers (not an fgfw dependency): pip install transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))


def small_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def expected_names(model):
    """The LayerNorm and bias parameters, from the parameter names alone: GPT-2 names its LayerNorms ln_1, ln_2 and
    ln_f, and every bias ``*.bias``."""
    return [n for n, _ in model.named_parameters()
            if n.endswith(".bias") or n.split(".")[-2] in ("ln_1", "ln_2", "ln_f")]


def test_subset_params_is_the_layernorms_and_biases():
    import finetune

    model = small_gpt2()
    names = {id(p): n for n, p in model.named_parameters()}
    got = [names[id(p)] for p in finetune.subset_params(model, "ln_bias")]
    want = expected_names(model)
    assert got == want
    # 2 layers: ln_1, ln_2 (weight, bias), c_attn, attn c_proj, c_fc, mlp c_proj biases; ln_f's two
    assert len(want) == 2 * 8 + 2
    assert not any("wte" in n or "wpe" in n or n.endswith("c_attn.weight") for n in got)
    wpe = [names[id(p)] for p in finetune.subset_params(model, "ln_bias_wpe")]
    assert wpe == [n for n, _ in model.named_parameters() if n in want or n == "transformer.wpe.weight"]
    proj = [names[id(p)] for p in finetune.subset_params(model, "ln_bias_attn_proj")]
    assert proj == [n for n, _ in model.named_parameters() if n in want or n.endswith("attn.c_proj.weight")]
    with pytest.raises(ValueError, match="kind"):
        finetune.subset_params(model, "everything")


class LMTask:
    """The part of finetune.Task that make_step uses: the next-token loss of a batch (inputs, targets)."""

    def loss(self, model, batch, per_example=False):
        x, y = batch
        logits = model(input_ids=x).logits
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
        return losses if per_example else losses.mean()


@pytest.mark.parametrize("method", ["afgfw_subset_centred", "afgfw_k2_subset_centred", "afgfw_guided_subset_centred",
                                    "afgfw_avg001_subset_centred", "afgfw_l2_subset_centred", "fgfw_subset_centred",
                                    "frankwolfe_subset_centred", "mezo_subset", "adam_subset",
                                    "afgfw_l2_rescaled_subset_centred", "afgfw_l2_rescaled_wide_subset_centred",
                                    "fgfw_l2_rescaled_wide_subset_centred",
                                    "afgfw_avg001_l2_rescaled_wide_subset_centred"])
def test_subset_method_moves_only_the_subset(method):
    import finetune

    model = small_gpt2()
    subset = {id(p) for p in finetune.subset_params(model, finetune.SUBSET)}
    # the biases and LayerNorm shifts start at zero: start from nonzero values, as a pre-trained model does
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in subset:
                p.add_(0.1 * torch.randn(p.shape))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = finetune.make_step(method, model, LMTask(), 1e-2, seed=0)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second step: AFGFW's running direction and the guided tangent along it
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        step((tokens[:, :-1], tokens[:, 1:]))
    moved = []
    for name, p in model.named_parameters():
        if id(p) in subset:
            moved.append(not torch.equal(p.detach(), before[name]))
        else:
            assert torch.equal(p.detach(), before[name]), f"{method} moved the frozen {name}"
    assert all(moved)  # every subset tensor: a vertex per row ball (a bias: one ball) at every step
    assert len(moved) == len(subset)


@pytest.mark.parametrize("method, kind, scale, averaging", [
    ("afgfw_l2_rescaled_subset_centred", "AFGFW", 0.5, 0.1),
    ("afgfw_l2_rescaled_wide_subset_centred", "AFGFW", 5.0, 0.1),
    ("fgfw_l2_rescaled_wide_subset_centred", "FGFW", 5.0, None),
    ("afgfw_avg001_l2_rescaled_wide_subset_centred", "AFGFW", 5.0, 0.01)])
def test_rescaled_methods_are_the_sets_and_steps_their_names_say(method, kind, scale, averaging):
    """The ``_rescaled`` methods step by rescale="gradient" in centred L2 row balls, ``_wide`` ones of WIDE_SCALE x the
    pre-trained norm: checked on the optimizer make_step builds, and on its first step, which from the centre of an
    L2 ball is SGD's step alpha v on every ball (s - theta = -r v / ||v||, so min(alpha ||v|| / r, 1) (s - theta) is
    -alpha v while alpha ||v|| <= r): each subset tensor moves along one direction by a length that does not depend on
    its radius."""
    import fgfw
    import finetune

    model = small_gpt2()
    with torch.no_grad():
        for p in finetune.subset_params(model, finetune.SUBSET):
            p.add_(0.1 * torch.randn(p.shape))
    subset = finetune.subset_params(model, finetune.SUBSET)
    start = [p.detach().clone() for p in subset]
    step = finetune.make_step(method, model, LMTask(), 1e-3, seed=0)
    opt = step.optimizer
    assert type(opt).__name__ == kind
    (group,) = opt.param_groups
    assert isinstance(group["constraint"], fgfw.L2Ball) and group["rescale"] == "gradient"
    assert group.get("averaging_weight") == averaging
    for p, radius in zip(group["params"], group["radii"]):
        want = scale * p.detach().reshape(p.shape[0] if p.dim() > 1 else 1, -1).norm(dim=1).double()
        torch.testing.assert_close(torch.as_tensor(radius, dtype=torch.float64).reshape(-1), want)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    step((tokens[:, :-1], tokens[:, 1:]))
    # the first step's move, divided by alpha, is v = gamma c u (AFGFW) or c u (FGFW): the same for any radius, so a
    # second model whose balls are twice as wide moves the same (an alpha x distance step would move twice as far)
    wide = small_gpt2()
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p, p0 in zip(finetune.subset_params(wide, finetune.SUBSET), start):
            p.copy_(p0)
    before = finetune.WIDE_SCALE, finetune.CENTRED_SCALE
    finetune.WIDE_SCALE, finetune.CENTRED_SCALE = 2 * before[0], 2 * before[1]
    try:
        step_wide = finetune.make_step(method, wide, LMTask(), 1e-3, seed=0)
    finally:
        finetune.WIDE_SCALE, finetune.CENTRED_SCALE = before
    step_wide((tokens[:, :-1], tokens[:, 1:]))
    for p, q, p0 in zip(subset, finetune.subset_params(wide, finetune.SUBSET), start):
        moved, moved_wide = (p.detach() - p0).double(), (q.detach() - p0).double()
        assert moved.norm() > 0
        torch.testing.assert_close(moved_wide, moved, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("method", ["afgfw_avg001_l2_rescaled_wide_decay_subset_centred",
                                    "afgfw_activity_avg001_l2_rescaled_wide_decay_centred"])
def test_decay_methods_take_the_constant_methods_steps_scaled_down_to_zero(method):
    """A ``_decay`` method is its constant-step method with the k-th step's alpha scaled by 1 - (k - 1) / n: its
    first step is the constant method's bit for bit (the same tangent and alpha), and after n steps it stops moving
    (alpha 0, while the running direction still changes; what remains is the rounding of the exact iterate to float32,
    ~1e-11 here, against ~1e-4 for a step). Without a budget it is refused."""
    import finetune

    constant = method.replace("_decay", "")
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    batches = [(tokens[:, :-1], tokens[:, 1:])] * 3

    def run(name, **kwargs):
        model = small_gpt2()
        with torch.no_grad():  # off the centre's exact zero biases, as a pre-trained model is
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        step = finetune.make_step(name, model, LMTask(), 3e-3, seed=0, **kwargs)
        trace = [[p.detach().clone() for p in model.parameters()]]
        for batch in batches:
            step(batch)
            trace.append([p.detach().clone() for p in model.parameters()])
        return trace

    decayed, steady = run(method, decay_steps=2), run(constant)
    for a, b in zip(decayed[1], steady[1]):
        assert torch.equal(a, b)  # step 1: alpha x 1
    def largest_move(after, before):
        return max(float((a - b).abs().max()) for a, b in zip(after, before))

    assert largest_move(decayed[2], decayed[1]) > 1e-6  # step 2: alpha x 1/2
    assert largest_move(decayed[2], steady[2]) > 1e-6  # ... not the constant method's alpha
    assert largest_move(decayed[3], decayed[2]) < 1e-6 * largest_move(decayed[2], decayed[1])  # step 3: alpha x 0
    with pytest.raises(ValueError, match="decay_steps"):
        finetune.make_step(method, small_gpt2(), LMTask(), 3e-3, seed=0)


def test_activity_rms_rescaled_method_is_the_estimator_and_step_its_name_says():
    """``afgfw_activity_rms_avg001_l2_rescaled_wide_centred``: AFGFW with the activity estimator and RMS-scaled tangents,
    averaging 0.01, rescale="gradient" in centred L2 row balls of WIDE_SCALE x the pre-trained norm, on every
    parameter."""
    import fgfw
    import finetune

    model = small_gpt2()
    with torch.no_grad():  # no all-zero bias, whose radius relative_to_init would take from elsewhere
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    opt = finetune.make_step("afgfw_activity_rms_avg001_l2_rescaled_wide_centred", model, LMTask(), 1e-3,
                             seed=0).optimizer
    assert type(opt).__name__ == "AFGFW" and opt.estimator == "activity" and opt.tangent_scale == "rms"
    (group,) = opt.param_groups
    assert group["params"] == list(model.parameters())
    assert group["center"] == "init" and group["rescale"] == "gradient" and group["averaging_weight"] == 0.01
    assert isinstance(group["constraint"], fgfw.L2Ball)
    for p, radius in zip(group["params"], group["radii"]):
        want = finetune.WIDE_SCALE * p.detach().reshape(p.shape[0] if p.dim() > 1 else 1, -1).norm(dim=1).double()
        torch.testing.assert_close(torch.as_tensor(radius, dtype=torch.float64).reshape(-1), want)


def test_split_method_perturbs_and_steps_the_layernorms_and_the_rest_in_turn():
    """``afgfw_activity_rms_split_centred``: two AFGFW optimizers (activity estimator, RMS-scaled tangents), one over
    the LayerNorms' parameters and one over every other parameter, taking turns: the first step moves every
    LayerNorm tensor and nothing else, the second every other tensor and no LayerNorm. A model without LayerNorms is
    refused."""
    import finetune

    model = small_gpt2()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    norms = {n for n, _ in model.named_parameters() if n.split(".")[-2] in ("ln_1", "ln_2", "ln_f")}
    step = finetune.make_step("afgfw_activity_rms_split_centred", model, LMTask(), 1e-3, seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    ln_opt, rest_opt = step.optimizers
    assert {names[id(p)] for g in ln_opt.param_groups for p in g["params"]} == norms
    assert {names[id(p)] for g in rest_opt.param_groups for p in g["params"]} == set(names.values()) - norms
    for opt in step.optimizers:
        assert opt.estimator == "activity" and opt.tangent_scale == "rms" and opt.param_groups[0]["center"] == "init"
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    for turn in (norms, set(names.values()) - norms):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        step((tokens[:, :-1], tokens[:, 1:]))
        moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
        assert moved == turn
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="LayerNorm"):
        finetune.make_step("afgfw_activity_rms_split_centred", mlp, LMTask(), 1e-3, seed=0)
