"""bench/finetune.py's subset fine-tuning (issue 31): ``subset_params`` picks every LayerNorm and bias parameter, and
a ``*_subset`` method moves those and leaves every other parameter bit for bit as it was."""
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
                                    "frankwolfe_subset_centred", "mezo_subset", "adam_subset"])
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
