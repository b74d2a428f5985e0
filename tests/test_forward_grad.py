"""The forward-gradient engine against backprop: c = <grad f, u> must equal sum_j <p_j.grad, u_j>.

Tangents come from the project's own tangent stream (reference.tangent, Gaussian unless a test says
otherwise), each parameter at its offset in the flat index space, as the optimizer draws them.
"""
import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

from fgfw import reference
from fgfw.forward_ad_engine import _check_params, _registered_param_ids
from fgfw.forward_grad import DEFAULT_ENGINE, ENGINES, directional_derivative

SEED, STEP = 1234, 7


def stream_tangents(params, distribution=reference.GAUSSIAN, tangent_id=0):
    """u_j for each parameter from the tangent stream, cast to the parameter's dtype."""
    tangents, offset = [], 0
    for p in params:
        u = reference.tangent(p.numel(), SEED, STEP, tangent_id, offset, distribution)
        tangents.append(u.to(p.dtype).view_as(p))
        offset += p.numel()
    return tangents


def backprop_reference(model, selected, tangents, loss_fn):
    """(loss, sum_j <grad_j, u_j>) by ordinary backprop on a deep copy of ``model``.

    ``selected`` are indices into ``list(model.parameters())``; the copy keeps ties and order.
    Returns the copy too, so tests can compare its buffers after one ordinary forward.
    """
    clone = copy.deepcopy(model)
    clone_params = list(clone.parameters())
    loss = loss_fn(clone)
    grads = torch.autograd.grad(loss, [clone_params[i] for i in selected], allow_unused=True)
    c = sum(((g * u).sum() for g, u in zip(grads, tangents) if g is not None),
            torch.zeros((), dtype=loss.dtype))
    return loss.detach(), c, clone


def run_engine(model, selected, tangents, loss_fn):
    params = list(model.parameters())
    return directional_derivative(model, [params[i] for i in selected], lambda j: tangents[j],
                                  lambda: loss_fn(model))


def relative_error(a, b):
    return float((a - b).abs() / b.abs().clamp_min(1e-300))


def mlp():
    torch.manual_seed(0)
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 5))
    return model, x, y


def cnn():
    torch.manual_seed(1)
    x, y = torch.randn(6, 3, 10, 10), torch.randint(0, 4, (6,))
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(5, 6, 3, padding=1),
                          nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(6 * 2 * 2, 4))
    return model, x, y


def batchnorm_cnn():
    torch.manual_seed(2)
    x, y = torch.randn(8, 2, 6, 6), torch.randint(0, 3, (8,))
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 10), nn.BatchNorm1d(10, momentum=None), nn.ReLU(),
                          nn.Linear(10, 3))
    return model.train(), x, y


class TiedLM(nn.Module):
    """Embedding and output projection share one Parameter (classic weight tying)."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


def tied():
    torch.manual_seed(3)
    x, y = torch.randint(0, 11, (9,)), torch.randint(0, 11, (9,))
    return TiedLM(), x, y


def transformer():
    torch.manual_seed(4)
    x, y = torch.randn(3, 5, 8), torch.randint(0, 8, (3 * 5,))
    model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return model, x, y


def transformer_eval():
    model, x, y = transformer()
    return model.eval(), x, y


def lstm():
    torch.manual_seed(5)
    x, y = torch.randn(3, 4, 5), torch.randint(0, 6, (3 * 4,))
    return nn.LSTM(5, 6, batch_first=True), x, y


def logits_of(model, x):
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(-1, out.shape[-1])


MODELS = {"mlp": mlp, "cnn": cnn, "batchnorm": batchnorm_cnn, "tied": tied, "transformer": transformer,
          "transformer_eval": transformer_eval, "lstm": lstm}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("distribution", [reference.GAUSSIAN, reference.RADEMACHER])
def test_matches_backprop_float64(name, distribution):
    model, x, y = MODELS[name]()
    model.double()
    x = x.double() if x.is_floating_point() else x
    loss_fn = lambda m: F.cross_entropy(logits_of(m, x), y)
    selected = list(range(len(list(model.parameters()))))
    tangents = stream_tangents(list(model.parameters()), distribution)

    ref_loss, ref_c, _ = backprop_reference(model, selected, tangents, loss_fn)
    loss, c = run_engine(model, selected, tangents, loss_fn)

    assert relative_error(c, ref_c) <= 1e-10
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    assert loss.dim() == 0 and c.dim() == 0 and c.dtype == torch.float64


def test_loss_equals_plain_forward_and_outputs_have_no_graph():
    model, x, y = mlp()
    with torch.no_grad():
        plain = F.cross_entropy(model(x), y)
    params = list(model.parameters())
    tangents = stream_tangents(params)
    loss, c = directional_derivative(model, params, lambda j: tangents[j],
                                     lambda: F.cross_entropy(model(x), y))
    assert torch.equal(loss, plain)
    for out in (loss, c):
        assert out.grad_fn is None and not out.requires_grad
    assert all(p.grad is None for p in params)


def test_batchnorm_running_stats_match_one_plain_forward():
    model, x, y = batchnorm_cnn()
    model.double()
    x = x.double()
    loss_fn = lambda m: F.cross_entropy(m(x), y)
    selected = list(range(len(list(model.parameters()))))
    tangents = stream_tangents(list(model.parameters()))
    buffers_before = dict(model.named_buffers())

    _, _, clone = backprop_reference(model, selected, tangents, loss_fn)
    run_engine(model, selected, tangents, loss_fn)

    expected = dict(clone.named_buffers())
    for name, buf in model.named_buffers():
        assert buf is buffers_before[name]
        assert torch.equal(buf, expected[name]), name
    assert int(model[1].num_batches_tracked) == 1
    with fwAD.dual_level():
        assert all(fwAD.unpack_dual(b).tangent is None for b in model.buffers())


class ActivationEMA(nn.Module):
    """A buffer updated in place from an activation: the tangent reaching it must not survive."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("ema", torch.zeros(dim))

    def forward(self, x):
        h = self.lin(x)
        self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h


def test_buffer_updated_from_activation_keeps_primal_values_only():
    torch.manual_seed(6)
    model = ActivationEMA(4).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    loss_fn = lambda m: m(x).pow(2).sum()
    tangents = stream_tangents(list(model.parameters()))

    ref_loss, ref_c, clone = backprop_reference(model, [0, 1], tangents, loss_fn)
    loss, c = run_engine(model, [0, 1], tangents, loss_fn)

    assert relative_error(c, ref_c) <= 1e-10
    assert torch.equal(model.ema, clone.ema)
    with fwAD.dual_level():
        assert fwAD.unpack_dual(model.ema).tangent is None


def test_subset_of_params_others_are_constants():
    model, x, y = cnn()
    model.double()
    x = x.double()
    loss_fn = lambda m: F.cross_entropy(m(x), y)
    params = list(model.parameters())
    tangents = stream_tangents(params)
    everything = list(range(len(params)))
    selected = [0, 3, len(params) - 1]
    chosen = [tangents[i] for i in selected]

    _, ref_c, _ = backprop_reference(model, selected, chosen, loss_fn)
    _, c = run_engine(model, selected, chosen, loss_fn)
    assert relative_error(c, ref_c) <= 1e-10

    # the same tangents on every parameter give another value: the unselected ones were held constant
    _, c_all = run_engine(model, everything, tangents, loss_fn)
    _, ref_c_all, _ = backprop_reference(model, everything, tangents, loss_fn)
    assert relative_error(c_all, ref_c_all) <= 1e-10
    assert relative_error(c, c_all) > 1e-3


def test_tied_parameter_counts_both_uses():
    model, x, y = tied()
    model.double()
    assert model.out.weight is model.embed.weight
    params = list(model.parameters())
    tied_index = next(i for i, p in enumerate(params) if p is model.embed.weight)
    tangents = stream_tangents([params[tied_index]])
    loss_fn = lambda m: F.cross_entropy(m(x), y)

    ref_loss, ref_c, _ = backprop_reference(model, [tied_index], tangents, loss_fn)
    loss, c = run_engine(model, [tied_index], tangents, loss_fn)
    assert relative_error(c, ref_c) <= 1e-10

    # both uses matter: the embedding path alone gives a different value
    with torch.no_grad():
        only_embedding = copy.deepcopy(model)
        only_embedding.out.weight = nn.Parameter(model.embed.weight.clone())
    _, c_one_use, _ = backprop_reference(only_embedding, [tied_index], tangents, loss_fn)
    assert relative_error(c_one_use, ref_c) > 1e-3


def test_parameter_captured_by_the_closure_gets_its_tangent():
    model, x, y = mlp()
    model.double()
    x = x.double()
    weight = model[0].weight  # captured directly, not reached through the module
    loss_fn = lambda m: F.cross_entropy(m(x), y) + 0.3 * weight.pow(2).sum()
    tangents = stream_tangents(list(model.parameters()))
    selected = list(range(len(tangents)))

    ref_loss, ref_c, _ = backprop_reference(model, selected, tangents,
                                            lambda m: F.cross_entropy(m(x), y) + 0.3 * m[0].weight.pow(2).sum())
    loss, c = run_engine(model, selected, tangents, loss_fn)
    assert relative_error(c, ref_c) <= 1e-10


def test_loss_not_depending_on_params_gives_zero():
    model, x, y = mlp()
    params = list(model.parameters())
    tangents = stream_tangents(params)

    def closure():
        model(x)
        return x.pow(2).sum()

    loss, c = directional_derivative(model, params, lambda j: tangents[j], closure)
    assert torch.equal(loss, x.pow(2).sum())
    assert c.dim() == 0 and c.dtype == loss.dtype and float(c) == 0.0

    loss, c = directional_derivative(model, [], lambda j: tangents[j], lambda: F.cross_entropy(model(x), y))
    assert float(c) == 0.0


def snapshot(model):
    return ([(id(m), name, id(p)) for m in model.modules() for name, p in m._parameters.items()],
            [p.detach().clone() for p in model.parameters()])


def assert_restored(model, before):
    ids, values = snapshot(model)
    assert ids == before[0]
    assert all(torch.equal(a, b) for a, b in zip(values, before[1]))
    with fwAD.dual_level():
        assert all(fwAD.unpack_dual(p).tangent is None for p in model.parameters())
    assert torch.backends.mha.get_fastpath_enabled()


def test_parameters_restored_after_call_and_after_raise():
    model, x, y = tied()
    params = list(model.parameters())
    tangents = stream_tangents(params)
    before = snapshot(model)

    directional_derivative(model, params, lambda j: tangents[j], lambda: F.cross_entropy(model(x), y))
    assert_restored(model, before)

    class Boom(Exception):
        pass

    def failing_closure():
        model(x)
        raise Boom

    with pytest.raises(Boom):
        directional_derivative(model, params, lambda j: tangents[j], failing_closure)
    assert_restored(model, before)

    def failing_tangent(j):
        if j == 1:
            raise Boom
        return tangents[j]

    with pytest.raises(Boom):
        directional_derivative(model, params, failing_tangent, lambda: F.cross_entropy(model(x), y))
    assert_restored(model, before)

    # the dual level was closed: the engine runs again
    _, c = directional_derivative(model, params, lambda j: tangents[j], lambda: F.cross_entropy(model(x), y))
    assert torch.isfinite(c)


def test_float32_model():
    model, x, y = cnn()
    loss_fn = lambda m: F.cross_entropy(m(x), y)
    selected = list(range(len(list(model.parameters()))))
    tangents = stream_tangents(list(model.parameters()))

    ref_loss, ref_c, _ = backprop_reference(model, selected, tangents, loss_fn)
    loss, c = run_engine(model, selected, tangents, loss_fn)
    assert c.dtype == torch.float32 and loss.dtype == torch.float32
    assert relative_error(c.double(), ref_c.double()) <= 1e-4
    torch.testing.assert_close(loss, ref_loss)


def test_works_under_inference_mode():
    model, x, y = mlp()
    model.double()
    x = x.double()
    loss_fn = lambda m: F.cross_entropy(m(x), y)
    selected = list(range(len(list(model.parameters()))))
    tangents = stream_tangents(list(model.parameters()))
    _, ref_c, _ = backprop_reference(model, selected, tangents, loss_fn)
    with torch.inference_mode():
        _, c = run_engine(model, selected, tangents, loss_fn)
    assert relative_error(c, ref_c) <= 1e-10


@pytest.mark.parametrize("result, error", [
    (3.0, TypeError),
    (torch.tensor(3), TypeError),
    (torch.ones(2), ValueError),
])
def test_closure_must_return_a_scalar_floating_tensor(result, error):
    model, x, _ = mlp()
    params = list(model.parameters())
    tangents = stream_tangents(params)
    with pytest.raises(error, match="closure"):
        directional_derivative(model, params, lambda j: tangents[j], lambda: result)


def test_bad_params_and_tangents_are_named():
    model, x, y = mlp()
    params = list(model.parameters())
    tangents = stream_tangents(params)
    closure = lambda: F.cross_entropy(model(x), y)

    with pytest.raises(ValueError, match=r"params\[1\].*params\[0\]"):
        directional_derivative(model, [params[0], params[0]], lambda j: tangents[0], closure)
    stranger = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"params\[0\].*not a parameter of module"):
        directional_derivative(model, list(stranger.parameters()), lambda j: tangents[j], closure)
    with pytest.raises(ValueError, match=r"make_tangent\(0\)"):
        directional_derivative(model, params, lambda j: tangents[j].double(), closure)
    with pytest.raises(ValueError, match=r"make_tangent\(0\)"):
        directional_derivative(model, params, lambda j: tangents[j].t(), closure)
    with pytest.raises(TypeError, match=r"make_tangent\(0\)"):
        directional_derivative(model, params, lambda j: 1.0, closure)


def test_params_check_walks_the_registries_and_asks_the_module_for_the_rest():
    """The parameter check reads the modules' registries (a module registered twice or inside itself, an
    empty slot), and a module whose parameters() yields one it does not register still passes it."""
    layer = nn.Linear(3, 2)
    model = nn.Sequential(layer, nn.ReLU(), layer)
    model.itself = model
    model.register_module("empty", None)
    assert _registered_param_ids(model) == {id(p) for p in model.parameters()}
    _check_params(model, list(model.parameters()))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = [nn.Linear(3, 2)]  # not registered

        def parameters(self, recurse=True):
            return iter(self.hidden[0].parameters())

    wrapper = Wrapper()
    _check_params(wrapper, list(wrapper.parameters()))
    with pytest.raises(ValueError, match=r"params\[0\].*not a parameter of module"):
        _check_params(wrapper, list(layer.parameters()))


def test_engine_registry():
    assert ENGINES["forward_ad"] is directional_derivative
    assert DEFAULT_ENGINE == "lean" and DEFAULT_ENGINE in ENGINES
