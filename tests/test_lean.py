"""The lean engine: each lean rule against PyTorch's own JVP and finite differences, the engines against
backprop, just-in-time tangents, no graph, memory flat in depth, K tangents in one pass."""
import collections
import copy
import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import fgfw
from fgfw import lean
from fgfw.forward_grad import ENGINES, directional_derivative
from fgfw.models import paper_mlp
from test_forward_grad import MODELS, backprop_reference, logits_of, relative_error, stream_tangents

D = torch.float64


def randn(*shape):
    return torch.randn(*shape, dtype=D)


# -- each rule: (lean function, torch function, tensor inputs, other arguments) ---------------------------------
def rule_cases():
    torch.manual_seed(10)
    mask_bool = torch.rand(2, 13, 11) > 0.3
    mask_bool[..., 0] = True  # no fully masked row
    return {
        "linear": (lean.linear, F.linear, [randn(3, 4, 6), randn(5, 6), randn(5)], {}),
        "linear_1d": (lean.linear, F.linear, [randn(6), randn(5, 6), randn(5)], {}),
        "linear_4d": (lean.linear, F.linear, [randn(2, 3, 4, 6), randn(5, 6), randn(5)], {}),
        "linear_4d_no_bias": (lambda x, w: lean.linear(x, w), lambda x, w: F.linear(x, w),
                              [randn(2, 3, 4, 6), randn(5, 6)], {}),
        "linear_strided_rows": (lambda x, w, b: lean.linear(x.transpose(0, 1), w, b),
                                lambda x, w, b: F.linear(x.transpose(0, 1), w, b),
                                [randn(4, 3, 6), randn(5, 6), randn(5)], {}),
        "addmm": (lean.addmm, torch.addmm, [randn(5), randn(4, 6), randn(6, 5)], {}),
        "addmm_matrix_bias": (lean.addmm, torch.addmm, [randn(4, 5), randn(4, 6), randn(6, 5)], {}),
        "mul": (lean.mul, torch.mul, [randn(3, 4), randn(3, 4)], {}),
        "mul_broadcast": (lean.mul, torch.mul, [randn(2, 3, 4), randn(3, 1)], {}),
        "mul_number": (lambda x: lean.mul(x, 0.044715), lambda x: torch.mul(x, 0.044715), [randn(3, 4)], {}),
        "conv2d": (lean.conv2d, F.conv2d, [randn(10, 3, 7, 7), randn(4, 3, 3, 3), randn(4)],
                   dict(stride=2, padding=1)),
        "conv2d_groups": (lean.conv2d, F.conv2d, [randn(3, 4, 6, 6), randn(6, 2, 3, 3), randn(6)],
                          dict(padding="same", groups=2, dilation=1)),
        "layer_norm": (lambda x, w, b: lean.layer_norm(x, (3, 5), w, b), lambda x, w, b: F.layer_norm(x, (3, 5), w, b),
                       [randn(4, 3, 5), randn(3, 5), randn(3, 5)], {}),
        "layer_norm_plain": (lambda x: lean.layer_norm(x, (7,)), lambda x: F.layer_norm(x, (7,)), [randn(2, 3, 7)], {}),
        "softmax_last": (lambda x: lean.softmax(x, -1), lambda x: F.softmax(x, -1), [randn(4, 6)], {}),
        "softmax_dim0": (lambda x: lean.softmax(x, 0), lambda x: F.softmax(x, 0), [randn(4, 6)], {}),
        "cross_entropy": (lambda z: lean.cross_entropy(z, torch.tensor([0, 3, 2, 3, -100])),
                          lambda z: F.cross_entropy(z, torch.tensor([0, 3, 2, 3, -100])), [randn(5, 4)], {}),
        "cross_entropy_sum": (lambda z: lean.cross_entropy(z, torch.tensor([1, 2]), reduction="sum"),
                              lambda z: F.cross_entropy(z, torch.tensor([1, 2]), reduction="sum"), [randn(2, 4)], {}),
        "cross_entropy_none": (lambda z: lean.cross_entropy(z, torch.tensor([1, 2, 0]), reduction="none"),
                               lambda z: F.cross_entropy(z, torch.tensor([1, 2, 0]), reduction="none"),
                               [randn(3, 4)], {}),
        "cross_entropy_1d": (lambda z: lean.cross_entropy(z, torch.tensor(2)),
                             lambda z: F.cross_entropy(z, torch.tensor(2)), [randn(4)], {}),
        # 13 query rows of 4-wide heads: the tangent is computed in chunks of 4 rows (the last one partial)
        "attention": (lean.scaled_dot_product_attention, F.scaled_dot_product_attention,
                      [randn(2, 3, 13, 4), randn(2, 3, 11, 4), randn(2, 3, 11, 4)], {}),
        "attention_causal": (lean.scaled_dot_product_attention, F.scaled_dot_product_attention,
                             [randn(2, 13, 4), randn(2, 13, 4), randn(2, 13, 4)], dict(is_causal=True, scale=0.3)),
        "attention_bool_mask": (lean.scaled_dot_product_attention, F.scaled_dot_product_attention,
                                [randn(2, 13, 4), randn(2, 11, 4), randn(2, 11, 4)], dict(attn_mask=mask_bool)),
        "attention_float_mask": (lambda q, k, v, m: lean.scaled_dot_product_attention(q, k, v, attn_mask=m),
                                 lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                                 [randn(2, 13, 4), randn(2, 11, 4), randn(2, 11, 4), randn(13, 11)], {}),
    }


RULES = rule_cases()


@pytest.mark.parametrize("name", RULES)
def test_rule_matches_torch_jvp_and_finite_differences(name):
    lean_fn, torch_fn, inputs, kwargs = RULES[name]
    torch.manual_seed(11)
    tangents = [torch.randn_like(x) for x in inputs]

    out, out_t = torch.func.jvp(lambda *a: lean_fn(*a, **kwargs), tuple(inputs), tuple(tangents))
    with sdpa_kernel(SDPBackend.MATH):
        ref, ref_t = torch.func.jvp(lambda *a: torch_fn(*a, **kwargs), tuple(inputs), tuple(tangents))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_t, ref_t, rtol=1e-10, atol=1e-12)

    eps = 1e-6
    with sdpa_kernel(SDPBackend.MATH):
        plus = torch_fn(*[x + eps * t for x, t in zip(inputs, tangents)], **kwargs)
        minus = torch_fn(*[x - eps * t for x, t in zip(inputs, tangents)], **kwargs)
    torch.testing.assert_close(out_t, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["linear", "addmm", "mul", "conv2d", "layer_norm", "attention_float_mask"])
def test_rule_with_some_inputs_constant(name):
    """Each input alone carrying a tangent (forward_ad leaves the others without one): the rule's None paths."""
    lean_fn, torch_fn, inputs, kwargs = RULES[name]
    torch.manual_seed(12)
    for i in range(len(inputs)):
        tangent = torch.randn_like(inputs[i])
        with fwAD.dual_level():
            args = list(inputs)
            args[i] = fwAD.make_dual(inputs[i], tangent)
            lean_t = fwAD.unpack_dual(lean_fn(*args, **kwargs)).tangent
            with sdpa_kernel(SDPBackend.MATH):
                ref_t = fwAD.unpack_dual(torch_fn(*args, **kwargs)).tangent
        torch.testing.assert_close(lean_t, ref_t, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", RULES)
def test_rule_run_directly_in_the_engines_setting(name, monkeypatch):
    """Forward AD under no_grad (the one-tangent engine's setting): the rules run without
    autograd.Function.apply, on all inputs with a tangent, then on each alone."""
    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(lambda cls, *a: pytest.fail("apply called")))
    lean_fn, torch_fn, inputs, kwargs = RULES[name]
    torch.manual_seed(17)
    tangents = [torch.randn_like(x) for x in inputs]
    for with_tangent in [range(len(inputs))] + [[i] for i in range(len(inputs))]:
        with torch.no_grad(), fwAD.dual_level():
            args = [fwAD.make_dual(x, t) if i in with_tangent else x for i, (x, t) in enumerate(zip(inputs, tangents))]
            out, out_t = fwAD.unpack_dual(lean_fn(*args, **kwargs))
            with sdpa_kernel(SDPBackend.MATH):
                ref, ref_t = fwAD.unpack_dual(torch_fn(*args, **kwargs))
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out_t, ref_t, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape, bias", [((7, 64), True), ((7, 64), False), ((3, 4, 64), True), ((3, 4, 64), False),
                                         ((2, 3, 4, 64), False)])
def test_linear_rule_gives_f_linears_own_primal(shape, bias):
    """The one-tangent linear computes the primal itself (the rows viewed once for three products): in float32 it
    is F.linear's result bit for bit, the same BLAS call (so the lean loss is the model's loss); a 4-D x with a bias
    (F.linear adds the bias after its product) is declined."""
    torch.manual_seed(14)
    x, w = torch.randn(shape), torch.randn(33, 64)
    b = torch.randn(33) if bias else None
    y, t = lean.LinearJvp.fused_forward_and_jvp(x, w, b, torch.randn_like(x), torch.randn_like(w), None)
    assert torch.equal(y, F.linear(x, w, b)) and t.shape == y.shape
    assert lean.LinearJvp.fused_forward_and_jvp(torch.randn(2, 3, 4, 64), w, torch.randn(33), None, None, None) is None


@pytest.mark.parametrize("name", [n for n in RULES if n.startswith("attention")])
def test_attention_tangent_in_chunks_of_query_rows(name, monkeypatch):
    """With no floor on a chunk's scores, the rows come in chunks of the head's width (the last one partial): the
    tangent of both paths (torch.func's jvp, and the engine's on plain tensors) still matches torch's."""
    monkeypatch.setattr(lean, "_CHUNK_SCORES", 0)
    chunks = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda tensors, *a, **k: chunks.append(len(tensors)) or real_cat(tensors, *a, **k))
    lean_fn, torch_fn, inputs, kwargs = RULES[name]
    torch.manual_seed(13)
    tangents = [torch.randn_like(x) for x in inputs]
    with sdpa_kernel(SDPBackend.MATH):
        _, ref_t = torch.func.jvp(lambda *a: torch_fn(*a, **kwargs), tuple(inputs), tuple(tangents))
    _, out_t = torch.func.jvp(lambda *a: lean_fn(*a, **kwargs), tuple(inputs), tuple(tangents))
    torch.testing.assert_close(out_t, ref_t, rtol=1e-10, atol=1e-12)
    with torch.no_grad(), fwAD.dual_level():
        out_t = fwAD.unpack_dual(lean_fn(*[fwAD.make_dual(x, t) for x, t in zip(inputs, tangents)], **kwargs)).tangent
    torch.testing.assert_close(out_t, ref_t, rtol=1e-10, atol=1e-12)
    assert chunks and all(n == 4 for n in chunks)  # 13 query rows of 4-wide heads: chunks of 4, 4, 4, 1


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
def test_relu_and_gelu_keep_torchs_rule_which_is_lean(approximate):
    """No rule for them: torch's forward-mode rule is one kernel on the tangent, no buffer beyond y, y_dot."""
    fn = F.relu if approximate is None else lambda x: F.gelu(x, approximate=approximate)
    backward = (lambda g, x, y: torch.ops.aten.threshold_backward(g, y, 0)) if approximate is None else (
        lambda g, x, y: torch.ops.aten.gelu_backward(g, x, approximate=approximate))
    assert (F.relu if approximate is None else F.gelu) not in lean._RULES
    torch.manual_seed(18)
    x, x_t = randn(64, 32), randn(64, 32)
    with torch.no_grad(), fwAD.dual_level():
        dual = fwAD.make_dual(x, x_t)
        (y, y_t), peak = lean.measure_peak(lambda: fwAD.unpack_dual(fn(dual)))
    assert peak <= 2 * y.nbytes
    torch.testing.assert_close(y_t, backward(x_t, x, y), rtol=0, atol=0)


def test_rules_under_vmap_of_jvp():
    """K tangents at once (the batched engine's path), including the in-place accumulations."""
    for name in ("linear", "layer_norm", "conv2d", "attention"):
        lean_fn, torch_fn, inputs, kwargs = RULES[name]
        torch.manual_seed(13)
        tangents = [torch.randn(3, *x.shape, dtype=D) for x in inputs]
        lean_t = torch.func.vmap(lambda *t: torch.func.jvp(lambda *a: lean_fn(*a, **kwargs), tuple(inputs), t)[1])(
            *tangents)
        for k in range(3):
            with sdpa_kernel(SDPBackend.MATH):
                _, ref_t = torch.func.jvp(lambda *a: torch_fn(*a, **kwargs), tuple(inputs),
                                          tuple(t[k] for t in tangents))
            torch.testing.assert_close(lean_t[k], ref_t, rtol=1e-10, atol=1e-12)


def test_unsupported_variants_are_declined():
    x = randn(4, 3)
    assert lean.cross_entropy(x, torch.tensor([0, 1, 2, 0]), weight=randn(3)) is NotImplemented
    assert lean.cross_entropy(x, torch.tensor([0, 1, 2, 0]), label_smoothing=0.1) is NotImplemented
    assert lean.scaled_dot_product_attention(x[None], x[None], x[None], dropout_p=0.1) is NotImplemented
    assert lean.addmm(randn(3), x, randn(3, 3), beta=0.5) is NotImplemented
    assert lean.mul(x, torch.ones(4, 3, dtype=torch.float32)) is NotImplemented  # mixed dtypes: torch's promotion
    assert lean.mul(torch.arange(3), 2) is NotImplemented  # integers carry no tangent


# -- the engines against backprop ------------------------------------------------------------------------------
def double_model(name):
    model, x, y = MODELS[name]()
    model.double()
    return model, (x.double() if x.is_floating_point() else x), y


@pytest.mark.parametrize("name", MODELS)
def test_lean_engine_matches_backprop(name):
    model, x, y = double_model(name)
    loss_fn = lambda m: F.cross_entropy(logits_of(m, x), y)
    params = list(model.parameters())
    tangents = stream_tangents(params)
    ref_loss, ref_c, clone = backprop_reference(model, list(range(len(params))), tangents, loss_fn)

    loss, c = ENGINES["lean"](model, params, lambda j: tangents[j], lambda: loss_fn(model))

    assert relative_error(c, ref_c) <= 1e-10
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    for (name_, buf), ref_buf in zip(model.named_buffers(), clone.buffers()):
        assert torch.equal(buf, ref_buf), name_  # BatchNorm statistics: one ordinary forward's update


@pytest.mark.parametrize("name", [n for n in MODELS if n != "batchnorm"])
def test_batched_engine_matches_backprop_per_tangent(name):
    model, x, y = double_model(name)
    loss_fn = lambda m: F.cross_entropy(logits_of(m, x), y)
    params = list(model.parameters())
    per_tangent = [stream_tangents(params, tangent_id=k) for k in range(3)]
    refs = [backprop_reference(model, list(range(len(params))), t, loss_fn) for t in per_tangent]

    batched = ENGINES["lean"].batched
    loss, c = batched(model, params, lambda j: torch.stack([t[j] for t in per_tangent]), lambda: loss_fn(model), 3)

    assert c.shape == (3,)
    for k, (ref_loss, ref_c, _) in enumerate(refs):
        assert relative_error(c[k], ref_c) <= 1e-10
    torch.testing.assert_close(loss, refs[0][0], rtol=1e-13, atol=0)


def test_batched_engine_refuses_batchnorm_training_and_checks_shapes():
    model, x, y = double_model("batchnorm")
    params = list(model.parameters())
    stacked = [torch.stack([u, u]) for u in stream_tangents(params)]
    with pytest.raises(ValueError, match="in place"):
        lean.lean_directional_derivatives(model, params, lambda j: stacked[j], lambda: F.cross_entropy(model(x), y), 2)
    model, x, y = double_model("mlp")
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"make_tangents\(0\)"):
        lean.lean_directional_derivatives(model, params, lambda j: torch.zeros_like(params[j]),
                                          lambda: F.cross_entropy(model(x), y), 2)


class CrossAttention(nn.Module):
    """Attention with distinct query and memory: the unpacked projection path, and MHA's mask conventions."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 5)

    def forward(self, x, memory, mask, causal):
        return self.head(self.attn(x, memory, memory, attn_mask=mask, need_weights=False, is_causal=causal)[0])


@pytest.mark.parametrize("mask_kind", ["float", "bool", "per_head", "causal"])
def test_cross_attention_masks_and_a_captured_parameter(mask_kind, monkeypatch):
    calls = []
    rule = lean.AttentionJvp.jvp
    monkeypatch.setattr(lean.AttentionJvp, "jvp", staticmethod(lambda ctx, *t: calls.append(1) or rule(ctx, *t)))
    torch.manual_seed(14)
    model = CrossAttention().double()
    x, memory = randn(2, 6, 8), randn(2, 9, 8)
    masks = {"float": randn(6, 9), "bool": torch.rand(6, 9) > 0.7, "per_head": randn(2 * 2, 6, 9),
             "causal": torch.ones(6, 9, dtype=torch.bool).triu(1)}
    mask, causal = masks[mask_kind], mask_kind == "causal"
    y = torch.randint(0, 5, (12,))
    weight = model.head.weight  # also used by the closure directly, outside any module
    loss_fn = lambda m, w: F.cross_entropy(m(x, memory, mask, causal).reshape(-1, 5), y) + 0.1 * w.pow(2).sum()
    params = list(model.parameters())
    tangents = stream_tangents(params)
    _, ref_c, _ = backprop_reference(model, list(range(len(params))), tangents, lambda m: loss_fn(m, m.head.weight))
    _, c = ENGINES["lean"](model, params, lambda j: tangents[j], lambda: loss_fn(model, weight))
    assert relative_error(c, ref_c) <= 1e-10
    assert calls == [1]  # through the lean attention rule, not torch's fallback


# -- just-in-time tangents, no graph ---------------------------------------------------------------------------
def test_tangents_are_made_just_before_their_layer_and_freed_after():
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 3))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    params = list(model.parameters())
    owner = {id(p): i for i, m in enumerate(model) for p in m.parameters()}
    events, alive = [], []

    def make_tangent(j):
        u = torch.randn_like(params[j])
        events.append(("tangent", owner[id(params[j])]))
        alive.append(weakref.ref(u))
        return u

    def pre_hook(module, _):
        events.append(("layer", list(model).index(module)))
        if module is model[4]:  # the last layer starts: earlier layers' tangents must be gone
            assert sum(ref() is not None for ref in alive) == 0

    for m in model:
        m.register_forward_pre_hook(pre_hook)
    ENGINES["lean"](model, params, make_tangent, lambda: F.cross_entropy(model(x), y))
    layers = [i for kind, i in events if kind == "layer"]
    for kind, i in events:
        if kind == "tangent":  # a layer's tangents are made after the layer starts, before the next one
            assert events.index(("layer", i)) < events.index((kind, i))
            later = [e for e in events if e[0] == "layer" and e[1] > i]
            assert not later or events.index((kind, i)) < events.index(later[0])
    assert layers == [0, 1, 2, 3, 4]


def test_no_graph_and_nothing_saved_for_backward():
    model, x, y = MODELS["transformer"]()
    params = list(model.parameters())
    tangents = stream_tangents(params)
    outputs, saved = [], []
    for m in model.modules():
        m.register_forward_hook(lambda mod, inp, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss, c = ENGINES["lean"](model, params, lambda j: tangents[j],
                                  lambda: F.cross_entropy(logits_of(model, x), y))
    assert outputs and all(o.grad_fn is None for o in outputs)
    assert saved == []
    for t in (loss, c):
        assert t.grad_fn is None and not t.requires_grad
    assert all(p.grad is None for p in params)
    with fwAD.dual_level():
        assert all(fwAD.unpack_dual(p).tangent is None for p in params)


def test_parameters_untouched_after_raise_and_engine_runs_again():
    model, x, y = MODELS["tied"]()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    tangents = stream_tangents(params)

    def failing():
        model(x)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        ENGINES["lean"](model, params, lambda j: tangents[j], failing)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    _, c = ENGINES["lean"](model, params, lambda j: tangents[j], lambda: F.cross_entropy(model(x), y))
    _, ref_c = directional_derivative(model, params, lambda j: tangents[j], lambda: F.cross_entropy(model(x), y))
    assert relative_error(c.double(), ref_c.double()) <= 1e-4


# -- memory ----------------------------------------------------------------------------------------------------
def mlp_of_depth(depth, width=256):
    torch.manual_seed(16)
    layers = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def step_peaks(model, x, y):
    params = list(model.parameters())
    tangents = stream_tangents(params)
    closure = lambda: F.cross_entropy(model(x), y)
    _, lean_peak = lean.measure_peak(lambda: ENGINES["lean"](model, params, lambda j: tangents[j].clone(), closure))

    def backprop():
        closure().backward()
        model.zero_grad(set_to_none=True)

    _, backprop_peak = lean.measure_peak(backprop)
    return lean_peak, backprop_peak


def test_peak_memory_does_not_grow_with_depth():
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    activation = 512 * 256 * 4
    lean_2, backprop_2 = step_peaks(mlp_of_depth(2), x, y)
    lean_8, backprop_8 = step_peaks(mlp_of_depth(8), x, y)
    # lean: a constant number of activations (x, x_dot, y, y_dot and one layer's tangents), whatever the depth
    assert lean_8 <= lean_2 + activation // 4
    assert lean_8 <= 5 * activation
    # the measure sees depth where there is some: backprop keeps every layer's activations
    assert backprop_8 >= backprop_2 + 6 * activation


def test_lean_rule_is_leaner_than_torchs_on_the_paper_net():
    """torch's linear rule materialises a zero tangent of the input (784 x batch); the lean one does not."""
    model = paper_mlp()
    x, y = torch.randn(1024, 784), torch.randint(0, 10, (1024,))
    params = list(model.parameters())
    tangents = stream_tangents(params)
    closure = lambda: F.cross_entropy(model(x), y)
    _, stock = lean.measure_peak(lambda: directional_derivative(model, params, lambda j: tangents[j], closure))
    _, lean_peak = lean.measure_peak(lambda: ENGINES["lean"](model, params, lambda j: tangents[j], closure))
    assert stock >= x.numel() * 4  # the input-sized zero tangent
    assert lean_peak <= stock / 10


# -- with the optimizer ----------------------------------------------------------------------------------------
def test_optimizer_with_lean_engine_follows_the_forward_ad_trajectory():
    model, x, y = MODELS["cnn"]()
    model.double()
    x = x.double()
    twin = copy.deepcopy(model)
    runs = []
    for m, engine in ((model, "forward_ad"), (twin, "lean")):
        opt = fgfw.AFGFW(m, constraint=fgfw.L1Ball(radius=50.0), seed=3, num_tangents=2, engine=engine,
                         backend="torch")
        runs.append([float(opt.step(lambda: F.cross_entropy(m(x), y))) for _ in range(3)])
    assert runs[0] == pytest.approx(runs[1], rel=1e-12)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_registry():
    assert ENGINES["forward_ad"] is directional_derivative
    assert ENGINES["lean"] is lean.lean_directional_derivative
    assert ENGINES["lean"].batched is lean.lean_directional_derivatives


# -- the GEMM layouts of a lean step (issue 30, item 2) ----------------------------------------------------------------
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addmm_", "baddbmm_"}


def _blas_layout(t: torch.Tensor) -> bool:
    """Whether a GEMM operand is a (batch of) matrices that BLAS reads in place, with 16-byte aligned rows: unit
    stride along one of its last two dims, the other stride at least that dim's size and a multiple of 16 bytes
    (a (2 x ld) leading dimension that cuBLAS's vectorised kernels take), and a 16-byte aligned start."""
    rows, cols = t.shape[-2:]
    s_rows, s_cols = t.stride()[-2:]
    if s_cols == 1 or cols == 1:
        lead, need = s_rows, cols
    elif s_rows == 1 or rows == 1:
        lead, need = s_cols, rows
    else:
        return False
    aligned = (lead * t.element_size()) % 16 == 0 or need == 1
    return lead >= need and aligned and (t.data_ptr() % 16 == 0)


def test_gemm_operands_of_a_lean_step_take_blas_layouts():
    """Every matrix product that a lean AFGFW step on Hugging Face GPT-2 dispatches (Conv1D's addmm with its (in, out)
    weight, the tied head's linear, attention's per-head products) gets operands that BLAS reads in place with
    aligned rows (no SIMT fallback for layout's sake on a GPU), when the model's widths are multiples of 4, as the
    inference forward's are; and each linear layer's product becomes exactly 3 (the primal and two tangent terms:
    no copy-and-multiply of a transposed weight, no product split by the rule)."""
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is not installed (pip install 'fgfw[models]')")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in _GEMMS:
                self.calls.append((func.overloadpacket.__name__,
                                   [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    tokens = torch.randint(0, 256, (2, 32))

    def closure():
        return model(tokens, labels=tokens).loss

    opt = fgfw.AFGFW(model, constraint=fgfw.L1Ball(radius=1.0), seed=0, engine="lean")
    opt.step(closure)
    inference, step = Gemms(), Gemms()
    with torch.no_grad(), inference:
        closure()
    with step:
        opt.step(closure)
    # the check itself: a transposed matrix passes, an every-other-column view, an odd leading dimension and a
    # misaligned start do not
    matrix = torch.zeros(8, 12)
    assert _blas_layout(matrix) and _blas_layout(matrix.T) and not _blas_layout(matrix[:, ::2])
    assert not _blas_layout(torch.zeros(8, 13)[:, :12]) and not _blas_layout(matrix.view(-1)[1:89].view(8, 11))
    assert inference.calls and step.calls
    for name, operands in inference.calls + step.calls:
        for t in operands:
            assert _blas_layout(t), (name, tuple(t.shape), t.stride())
    # the linear layers' products (attention runs in one SDPA kernel in the inference forward, in bmm's and
    # baddbmm's in the step)
    linear = [[name for name, _ in calls if name not in ("bmm", "baddbmm", "baddbmm_")]
              for calls in (inference.calls, step.calls)]
    assert len(linear[0]) == 9  # 2 x (c_attn, attention's c_proj, c_fc, the MLP's c_proj) and the head
    assert len(linear[1]) == 3 * len(linear[0]), sorted(linear[1])


# -- the tangent carrier (fgfw.tangent_carrier): each way a call is carried, against torch's forward AD ----------------
class Ops(nn.Module):
    """Three parameters that a closure combines with the op under test."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(21)
        self.a = nn.Parameter(randn(3, 4))
        self.b = nn.Parameter(randn(4))
        self.c = nn.Parameter(randn(3, 4))


CARRIED = {  # name -> f(module) -> a tensor; the loss is the sum of its squares' cosines (every entry counts)
    "views": lambda m: m.a.view(4, 3).t().reshape(12)[2:9].unsqueeze(0).expand(2, 7).contiguous() * 1.5,
    "split_chunk_unbind": lambda m: torch.cat([*m.a.split([1, 2]), m.c.chunk(2, 1)[1].repeat(1, 2), m.c.unbind(0)[2][None]]),
    "getitem_permute": lambda m: m.a[None, 1:, ::2].permute(2, 0, 1).flatten().flip(0).roll(1),
    "add_sub_alpha": lambda m: torch.add(m.a, m.c, alpha=0.5) - torch.sub(m.a, m.b, alpha=2) + torch.rsub(m.c, 3.0, alpha=2),
    "radd_rsub": lambda m: 2.0 + m.a - (1.0 - m.c) + (m.b - m.a.detach()) + (m.a - torch.ones(3, 4, dtype=D)),
    "one_tangent_broadcast": lambda m: m.b + torch.ones(3, 4, dtype=D) + (torch.zeros(2, 1, 4, dtype=D) - m.c),
    "dtype_promotion": lambda m: (m.a.float() + torch.ones(3, 4, dtype=D)) * m.c,
    "matmul": lambda m: (m.a @ m.c.t()) + torch.matmul(m.a, torch.ones(4, 2, dtype=D)).sum() + m.a.mm(m.c.t()),
    "bmm": lambda m: torch.bmm(m.a[None], m.c.t()[None]) + torch.bmm(torch.ones(1, 3, 3, dtype=D), m.c[None]).sum(),
    "pow": lambda m: m.a.pow(2) + torch.pow(m.c, 3.0) + (m.a * m.a + 1) ** 0.5 + m.b ** 1 + m.a.pow(0),
    "derivative_ops": lambda m: torch.tanh(m.a) + torch.sigmoid(m.c) + torch.exp(m.b) + F.gelu(m.a, approximate="tanh")
    + F.gelu(m.c) + F.relu(m.a) + F.silu(m.c),
    "div": lambda m: m.a / 3.0 + torch.div(m.c, torch.full((4,), 2.0, dtype=D)) + m.b / m.a,
    "cat_stack_missing": lambda m: torch.cat([m.a, torch.ones(1, 4, dtype=D), m.c], 0).sum(0)
    + torch.stack([m.b, torch.zeros(4, dtype=D)], 1).sum(1),
    "where_masked_fill": lambda m: torch.where(m.a.detach() > 0, m.a, 0.5) + torch.where(m.c.detach() > 0, 1.0, m.c)
    + m.a.masked_fill(m.c.detach() < 0, 2.0) + torch.where(m.a.detach() < 0, m.a, m.c),
    "embedding": lambda m: F.embedding(torch.tensor([[0, 2], [1, 1]]), m.a) * m.b,
    "dropout_eval_and_casts": lambda m: F.dropout(m.a, 0.3, training=False).to(torch.float32).double().type_as(m.c)
    + m.c.to(m.c),
    "sum_mean_neg": lambda m: -m.a.sum(0) + m.c.mean(1, keepdim=True) + torch.neg(m.b).cumsum(0),
    "fallback_ops": lambda m: torch.sin(m.a) + torch.log_softmax(m.c, -1) + torch.clamp(m.a, -0.5, 0.5) + m.b.sinh(),
    "inplace": lambda m: _inplace_ops(m),
    "view_chains": lambda m: (m.a * 2).view(12)[1:].view(11, 1).t().expand(2, 11) @ m.c.view(12)[:11].unsqueeze(1)
    + (m.a + m.c).transpose(0, 1).unbind(1)[2].view(2, 2).sum(),
    "cat_of_an_empty_cache_then_write": lambda m: _empty_cache_cat(m),
    "lean_rules": lambda m: F.layer_norm(m.a, (4,), m.b, m.b) + F.linear(m.c, m.a.t() @ m.a, m.b)
    + torch.softmax(m.c, -1) * m.a,
}


def _empty_cache_cat(m):
    x = m.a * 2
    y = torch.cat([torch.zeros(0, 4, dtype=D), x])  # adds nothing but x: y's tangent is x's, shared
    x.mul_(m.c)  # so x's write must not reach y's tangent
    return x + y


def _inplace_ops(m):
    x = m.a * 2  # fresh: a tangent of its own
    x.add_(m.c).mul_(m.b)
    y = m.a + torch.zeros(3, 4, dtype=D)  # shares a's tangent: cloned before it is written
    y += m.c
    F.relu(y, inplace=True)
    z = torch.zeros(3, 4, dtype=D)  # no tangent until the write
    z[1:] = m.c[1:]
    w = torch.ones(3, 4, dtype=D)
    w.mul_(m.a)
    return x + y + z + w + m.a  # m.a's own tangent unchanged by the writes above


@pytest.mark.parametrize("name", CARRIED)
def test_carried_calls_match_torch_forward_ad(name):
    model = Ops()
    params = list(model.parameters())
    tangents = [randn(*p.shape) for p in params]
    closure = lambda: torch.cos(CARRIED[name](model).double() ** 2).sum()
    loss, c = ENGINES["lean"](model, params, lambda j: tangents[j], closure)
    ref_loss, ref_c = directional_derivative(model, params, lambda j: tangents[j], closure)
    assert ref_c != 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(c, ref_c, rtol=1e-10, atol=1e-12)


def test_carried_calls_without_duals():
    """The carried calls above make no forward-AD dual: torch's own rules run only for the fallback ops."""
    model = Ops()
    params = list(model.parameters())
    tangents = [randn(*p.shape) for p in params]
    for name in ("views", "add_sub_alpha", "matmul", "pow", "derivative_ops", "cat_stack_missing", "lean_rules"):
        counts = collections.Counter()

        class Counter(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))

        with Counter():
            ENGINES["lean"](model, params, lambda j: tangents[j], lambda: CARRIED[name](model).sum())
        # forward AD's bookkeeping for a dual made or unpacked: none here
        assert counts["aten._has_same_storage_numel"] == counts["aten.is_same_size"] == 0, name


def test_a_chain_of_views_costs_its_tangent_one_op():
    """A view of a view ... of an activation takes its tangent in one as_strided when it is read, not one op per view
    (Hugging Face attention's view, split, view, transpose): the lean pass dispatches the primal's view ops once."""
    model = Ops()
    params = list(model.parameters())
    tangents = [randn(*p.shape) for p in params]

    def closure():
        return (m_a_2 := model.a * 2).view(12)[1:].view(11, 1).t().reshape(11).mul(m_a_2.view(12)[:11]).sum()

    counts = []
    for run in (lambda: closure(), lambda: ENGINES["lean"](model, params, lambda j: tangents[j], closure)):
        counter = collections.Counter()

        class Counter(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))

        with torch.no_grad(), Counter():
            run()
        counts.append(counter)
    inference, lean_pass = counts
    for op in ("aten.view", "aten.slice", "aten.t", "aten._unsafe_view"):
        assert lean_pass[op] == inference[op], (op, inference, lean_pass)
    assert lean_pass["aten.as_strided"] == 2  # the tangents of the two views that are read: one op each


def test_inplace_on_a_view_is_refused_with_the_op_named():
    model = Ops()
    params = list(model.parameters())
    tangents = [randn(*p.shape) for p in params]

    def view_written():
        x = m_a2 = model.a * 2
        x[0].mul_(model.b)  # x[0] is a view of x: x's tangent would have to follow
        return m_a2.sum()

    def base_written():
        x = model.a * 2
        v = x[0]
        x.add_(model.c)  # v's tangent would have to follow
        return (v * 1.0).sum()

    for closure in (view_written, base_written):
        with pytest.raises(NotImplementedError, match=r"in-place (mul_|add_)"):
            ENGINES["lean"](model, params, lambda j: tangents[j], closure)
        # torch's forward AD follows views: the stock engine still takes it
        directional_derivative(model, params, lambda j: tangents[j], closure)
    assert lean._CARRIER is None  # the failed pass left nothing behind


def _hf_lm(config_name, attention, hf_loss=False, **config):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'fgfw[models]')")
    torch.manual_seed(22)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**config),
                                                          attn_implementation=attention).double().eval()
    tokens = torch.randint(0, config["vocab_size"], (2, 12))
    if hf_loss:  # Hugging Face's own loss, which takes the logits to float32 first
        return model, lambda m: m(input_ids=tokens, labels=tokens).loss
    return model, lambda m: F.cross_entropy(m(input_ids=tokens).logits[:, :-1].reshape(-1, config["vocab_size"]),
                                            tokens[:, 1:].reshape(-1))


def _torchvision(name):
    torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed (pip install 'fgfw[models]')")
    torch.manual_seed(23)
    if name == "resnet18":  # train mode: BatchNorm's batch statistics; ReLU(inplace=True), out += identity
        model, x = torchvision.models.resnet18(num_classes=5).double(), randn(2, 3, 32, 32)
    else:
        model = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                                     hidden_dim=16, mlp_dim=32, num_classes=5).double().eval()
        x = randn(2, 3, 16, 16)
    y = torch.randint(0, 5, (2,))
    return model, lambda m: F.cross_entropy(m(x), y)


REAL_MODELS = {
    "gpt2_sdpa": lambda: _hf_lm("GPT2Config", "sdpa", vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2),
    "gpt2_eager": lambda: _hf_lm("GPT2Config", "eager", vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2),
    "gpt2_hf_loss": lambda: _hf_lm("GPT2Config", "sdpa", hf_loss=True, vocab_size=97, n_positions=16, n_embd=32,
                                   n_layer=2, n_head=2),
    "llama_gqa": lambda: _hf_lm("LlamaConfig", "eager", vocab_size=97, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                max_position_embeddings=16),
    "resnet18": lambda: _torchvision("resnet18"),
    "vit": lambda: _torchvision("vit"),
}


@pytest.mark.parametrize("name", REAL_MODELS)
def test_lean_engine_on_real_models_matches_backprop(name):
    """The carried pass on models nobody here wrote (Hugging Face's loss, rotary embeddings, grouped-query attention,
    torchvision's in-place ReLU and residual add, nn.MultiheadAttention): c = <grad f, u> against backprop, float64."""
    model, loss_fn = REAL_MODELS[name]()
    params = list(model.parameters())
    tangents = stream_tangents(params)
    ref_loss, ref_c, _ = backprop_reference(model, list(range(len(params))), tangents, loss_fn)
    loss, c = ENGINES["lean"](model, params, lambda j: tangents[j], lambda: loss_fn(model))
    # float32 inside a float64 model, in both passes: Hugging Face's loss takes the logits to float32, LLaMA's
    # RMSNorm the hidden states (torch's stock forward AD is 2.3e-7 from backprop there, the carried pass 3.5e-9)
    float32_inside = name in ("gpt2_hf_loss", "llama_gqa")
    assert relative_error(c.double(), ref_c) <= (1e-6 if float32_inside else 1e-9)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6 if float32_inside else 1e-12, atol=0)


def test_a_calls_parameters_get_their_tangents_from_one_many():
    """A maker with ``many`` (the optimizers' draws a layer's tangents in one op): each call that reads a weight and a
    bias asks ``many`` once for both, a call with one parameter asks it for one, and the pass gives the loss and c of
    the same maker without ``many``, bit for bit."""
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3, bias=False)).double()
    params = list(model.parameters())
    tangents = [torch.randn_like(p) for p in params]
    x, y = randn(5, 6), torch.tensor([0, 2, 1, 1, 0])
    asked = []

    class Maker:
        def __call__(self, j):
            return tangents[j].clone()

        def many(self, js):
            asked.append(list(js))
            return [tangents[j].clone() for j in js]

    def closure():
        return F.cross_entropy(model(x), y)

    loss, c = lean.lean_directional_derivative(model, params, Maker(), closure)
    plain_loss, plain_c = lean.lean_directional_derivative(model, params, lambda j: tangents[j].clone(), closure)
    assert asked == [[0, 1], [2, 3], [4]]
    assert torch.equal(loss, plain_loss) and torch.equal(c, plain_c)
    _, ref = directional_derivative(model, params, lambda j: tangents[j].clone(), closure)  # torch's forward AD
    torch.testing.assert_close(c, ref, rtol=1e-10, atol=1e-12)
