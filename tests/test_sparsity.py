"""fgfw.sparsity against independent references: which entries prune_ zeros, global vs per-layer,
accuracy_curve's restore, and the errors."""
import copy

import pytest
import torch
from torch import nn

from fgfw.sparsity import accuracy_curve, count_zeros, magnitude_masks, prunable, prune_, sparsity_report


def _reference_pruned(values: list[float], ratio: float) -> set[int]:
    """Positions of the round(ratio * n) smallest |v|, ties to the lower position: plain Python sorting."""
    order = sorted(range(len(values)), key=lambda i: (abs(values[i]), i))
    return set(order[:round(ratio * len(values))])


def _tensors(seed=0, shapes=((7, 5), (4, 9), (13,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5, 0.7, 0.9, 0.97])
def test_global_prunes_exactly_the_smallest_entries_and_leaves_the_rest(ratio):
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    flat = [float(v) for t in before for v in t.reshape(-1)]
    expected = _reference_pruned(flat, ratio)

    pruned = prune_(tensors, ratio, scope="global")

    after = [float(v) for t in tensors for v in t.reshape(-1)]
    assert pruned == round(ratio * len(flat)) == len(expected)
    for i, (a, b) in enumerate(zip(after, flat)):
        assert a == (0.0 if i in expected else b)  # untouched entries keep their exact value
    assert count_zeros(tensors) == (len(expected), len(flat))  # randn has no zeros of its own


@pytest.mark.parametrize("ratio", [0.3, 0.8])
def test_layer_scope_prunes_the_ratio_of_every_tensor(ratio):
    tensors = _tensors(seed=1)
    before = [t.clone() for t in tensors]
    pruned = prune_(tensors, ratio, scope="layer")
    total = 0
    for t, b in zip(tensors, before):
        values = [float(v) for v in b.reshape(-1)]
        expected = _reference_pruned(values, ratio)
        total += len(expected)
        got = [float(v) for v in t.reshape(-1)]
        assert [i for i, v in enumerate(got) if v == 0.0] == sorted(expected)
        assert all(got[i] == values[i] for i in range(len(values)) if i not in expected)
    assert pruned == total


def test_global_and_layer_differ_when_layers_have_different_scales():
    # a tensor of large weights and one of small ones: a global threshold prunes the small tensor first
    big, small = torch.linspace(1, 2, 100), torch.linspace(0.01, 0.02, 100)
    g = [big.clone(), small.clone()]
    prune_(g, 0.5, scope="global")
    assert count_zeros([g[0]]) == (0, 100) and count_zeros([g[1]]) == (100, 100)
    layer = [big.clone(), small.clone()]
    prune_(layer, 0.5, scope="layer")
    assert count_zeros([layer[0]]) == (50, 100) and count_zeros([layer[1]]) == (50, 100)
    # per layer, each keeps its own 50 largest
    assert torch.equal(layer[0][50:], big[50:]) and torch.equal(layer[1][50:], small[50:])


def test_ties_are_broken_by_position_deterministically():
    a, b = torch.ones(6), torch.ones(4)
    assert prune_([a, b], 0.5) == 5
    # the earlier tensor, then the lower index, goes first
    assert a.tolist() == [0, 0, 0, 0, 0, 1] and b.tolist() == [1, 1, 1, 1]
    c = torch.tensor([-2.0, 1.0, 2.0, -1.0, 2.0])
    prune_(c, 0.6)  # 3 of 5: both |1|, then the first |2|
    assert c.tolist() == [0.0, 0.0, 2.0, 0.0, 2.0]


def test_existing_zeros_count_among_the_pruned_and_masks_match():
    t = torch.tensor([0.0, 3.0, -0.5, 0.0, 2.0, 1.0, -4.0, 0.25])
    masks = magnitude_masks([t], 0.5)
    expected = _reference_pruned(t.tolist(), 0.5)  # the two zeros, 0.25 and -0.5
    assert {i for i, keep in enumerate(masks[0].tolist()) if not keep} == expected == {0, 2, 3, 7}
    prune_([t], 0.5)
    assert t.tolist() == [0.0, 3.0, 0.0, 0.0, 2.0, 1.0, -4.0, 0.0]


def test_prune_is_in_place_without_autograd_on_parameters_and_half_precision():
    layer = nn.Linear(20, 10)
    weight = layer.weight
    prune_(layer, 0.9)  # a module: its 2-D weight only, the bias stays dense
    assert layer.weight is weight and layer.weight.requires_grad and layer.weight.grad_fn is None
    assert count_zeros([layer.weight]) == (180, 200) and int((layer.bias == 0).sum()) == 0
    h = torch.randn(50, dtype=torch.float16)
    ref = _reference_pruned(h.tolist(), 0.4)
    prune_(h, 0.4)
    assert {i for i, v in enumerate(h.tolist()) if v == 0} == ref


def test_prunable_takes_weights_of_two_or_more_dimensions():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 3))
    assert [tuple(p.shape) for p in prunable(model)] == [(4, 1, 3, 3), (3, 4)]
    rows = sparsity_report(model)
    assert [r["name"] for r in rows] == ["0.weight", "3.weight", "total"]
    assert rows[-1]["numel"] == 36 + 12 and rows[-1]["zeros"] == 0


def test_sparsity_report_counts_per_tensor():
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 2))
    with torch.no_grad():
        model[0].weight[:3] = 0  # 30 zeros
        model[2].weight[0, :5] = 0  # 5 zeros
    rows = sparsity_report(model)
    assert [(r["name"], r["zeros"], r["numel"]) for r in rows] == [("0.weight", 30, 100), ("2.weight", 5, 20),
                                                                    ("total", 35, 120)]
    assert rows[0]["zero_fraction"] == 0.3 and count_zeros(model) == (35, 120)


def _classifier(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(200, 8)
    y = model(x).argmax(1).detach()  # labels the unpruned model gets right: accuracy 1 at ratio 0
    return model, x, y


def _accuracy(x, y):
    @torch.no_grad()
    def evaluate(model):
        return float((model(x).argmax(1) == y).double().mean())
    return evaluate


def test_accuracy_curve_restores_the_model_bit_for_bit_and_matches_pruning_a_copy():
    model, x, y = _classifier()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ratios = [0.0, 0.5, 0.9, 0.99]
    rows = accuracy_curve(model, None, ratios, _accuracy(x, y))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]) and v.view(torch.int32).equal(state[k].view(torch.int32))
    assert [r["ratio"] for r in rows] == ratios
    assert rows[0]["metric"] == _accuracy(x, y)(model) == 1.0
    # every ratio starts from the original weights: the same as pruning a fresh copy once
    for r in rows:
        twin = copy.deepcopy(model)
        prune_(twin, r["ratio"])
        assert r["metric"] == _accuracy(x, y)(twin)
        assert r["zeros"] == r["pruned"] == round(r["ratio"] * (8 * 16 + 16 * 3)) == count_zeros(twin)[0]
    assert rows[-1]["total"] == 8 * 16 + 16 * 3


def test_accuracy_curve_zero_ratio_is_the_unpruned_metric_and_dict_metrics_merge():
    model, x, y = _classifier(seed=3)
    with torch.no_grad():
        model[0].weight.mul_(torch.rand_like(model[0].weight) > 0.5)  # not every label right after this
    unpruned = _accuracy(x, y)(model)
    rows = accuracy_curve(model, [model[0].weight], [0.0, 0.5], lambda m: {"acc": _accuracy(x, y)(m), "n": 1},
                          scope="layer")
    assert rows[0]["acc"] == unpruned and rows[0]["n"] == 1 and "metric" not in rows[0]
    assert rows[1]["pruned"] == 64 and rows[1]["total"] == 128


def test_accuracy_curve_restores_when_evaluate_raises():
    model, x, y = _classifier()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def evaluate(m):
        calls.append(1)
        if len(calls) == 2:
            assert count_zeros(m)[0] > 0  # pruned while evaluated
            raise RuntimeError("boom")
        return 0.0

    with pytest.raises(RuntimeError, match="boom"):
        accuracy_curve(model, None, [0.0, 0.8, 0.9], evaluate)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5, float("nan"), float("inf")])
def test_ratio_outside_zero_one_is_a_value_error(ratio):
    t = torch.randn(10)
    with pytest.raises(ValueError, match="ratio must be in"):
        prune_([t], ratio)
    model, x, y = _classifier()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="ratio must be in"):
        accuracy_curve(model, None, [0.5, ratio], _accuracy(x, y))  # checked before any pruning
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_errors():
    t = torch.randn(4, 4)
    with pytest.raises(ValueError, match="empty"):
        prune_([], 0.5)
    with pytest.raises(ValueError, match="empty"):
        prune_(nn.Sequential(nn.ReLU()), 0.5)  # no weights to prune
    with pytest.raises(ValueError, match="scope"):
        prune_([t], 0.5, scope="row")
    with pytest.raises(TypeError, match="ratio"):
        prune_([t], "0.5")
    with pytest.raises(TypeError, match="ratio"):
        prune_([t], True)
    with pytest.raises(TypeError, match="tensor"):
        prune_([t, 3.0], 0.5)
    with pytest.raises(ValueError, match="floating-point"):
        prune_([torch.arange(10)], 0.5)
    with pytest.raises(ValueError, match="more than once"):
        prune_([t, t], 0.5)
    with pytest.raises(ValueError, match="NaN"):
        prune_([torch.tensor([1.0, float("nan"), 2.0])], 0.5)
    model, x, y = _classifier()
    with pytest.raises(ValueError, match="ratios is empty"):
        accuracy_curve(model, None, [], _accuracy(x, y))
    with pytest.raises(TypeError, match="evaluate"):
        accuracy_curve(model, None, [0.5], None)
    with pytest.raises(TypeError, match="nn.Module"):
        accuracy_curve([t], None, [0.5], _accuracy(x, y))
