"""Row-scope radii and feasibility, taken for all rows of a tensor at once (Constraint.resolve_radii,
Constraint.make_feasible_), against the per-row loops they replaced (written out here) and plain per-row math."""
import math
import warnings

import pytest
import torch
from torch import nn

import fgfw
from fgfw import constraints
from fgfw.optim import settings

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SETS = {
    "l1": fgfw.L1Ball, "l2": fgfw.L2Ball, "linf": fgfw.LInfBall,
    "lp3": lambda *a, **kw: fgfw.LpBall(*a, p=3.0, **kw),
    "lp1.5": lambda *a, **kw: fgfw.LpBall(*a, p=1.5, **kw),
    "ksparse": lambda *a, **kw: fgfw.KSparsePolytope(*a, k=3, **kw),
    "simplex": fgfw.Simplex, "nonneg_l1": fgfw.NonnegativeL1Ball,
}


def make_set(kind, rule, value):
    cls = SETS[kind]
    if rule == "radius":
        return cls(value, scope="row")
    if rule == "relative_to_init":
        return cls(None, scope="row", _relative_scale=value)
    return cls(None, scope="row", _relative_scale=value, _rule="init_diameter")


# -- the per-row loops as they were, on the sets' per-ball primitives ------------------------------------------
def legacy_radii(c, params):
    if c.radius is not None:
        return [[c.radius] * len(c.rows(p)) for p in params]
    out = []
    for i, p in enumerate(params):
        rows = c.rows(p)
        draws = constraints.init_draws(p) if any(not bool(row.any()) for row in rows) else []
        out.append([c._rule_radius([row], f"row {j} of parameter {i} (shape {tuple(p.shape)})",
                                   [[c.rows(d)[j]] for d in draws])
                    for j, row in enumerate(rows)])
    return out


def legacy_make_feasible_(c, params, radii, what="initial parameters"):
    """The old loop; returns the warning it gave, or None."""
    rows = [row for p in params for row in c.rows(p)]
    flat = [r for per_tensor in radii for r in per_tensor]
    moved = []
    for row, r in zip(rows, flat):
        excess = c._excess([row], r)
        if not excess:
            continue
        before = c.norm([row])
        c.shrink_into_([row], r)
        if excess > 1e-6 and not c._shrinks_by_rule():
            moved.append((before, r, [row]))
    if not moved:
        return None
    message = c._moved_message(*moved[0], what)
    if len(moved) > 1:
        message += f" [the first of {len(moved)} balls of the {len(rows)} (row scope) moved]"
    return message


# -- plain math, one row at a time ----------------------------------------------------------------------------
def plain_norm(kind, row):
    x = row.detach().reshape(-1).double()
    if kind in ("l1", "simplex", "nonneg_l1"):  # the simplices' relative rule takes the sum of |theta|
        return float(x.abs().sum())
    if kind == "l2":
        return float(torch.linalg.vector_norm(x))
    if kind == "linf":
        return float(x.abs().max()) if x.numel() else 0.0
    if kind.startswith("lp"):
        return float(torch.linalg.vector_norm(x, ord=float(kind[2:])))
    return max(float(x.abs().sum()) / min(3, x.numel()), float(x.abs().max()))


def tensors(dtype, seed=0, zero_row=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(6, 10, generator=g), torch.randn(4, 3, 2, generator=g) * 5, torch.randn(5, generator=g),
           torch.randn(7, 1, generator=g), torch.randn(3, 17, generator=g) * 1e-3]
    if zero_row:
        out[0][2] = 0
        out[1][0] = 0
    return [t.to(dtype) for t in out]


def run_both(c, params, radii=None, what="initial parameters"):
    """(new radii, old radii, new params, old params, new warning, old warning) from copies of params."""
    new_params, old_params = [p.clone() for p in params], [p.clone() for p in params]
    new_radii = c.resolve_radii(new_params) if radii is None else radii
    old_radii = legacy_radii(c, old_params) if radii is None else radii
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.make_feasible_(new_params, new_radii, what)
    new_warning = [str(w.message) for w in caught]
    old_warning = legacy_make_feasible_(c, old_params, old_radii, what)
    return new_radii, old_radii, new_params, old_params, new_warning, [] if old_warning is None else [old_warning]


def assert_same(new, old):
    for a, b in zip(new, old):
        assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(SETS))
@pytest.mark.parametrize("rule, value", [("relative_to_init", 0.5), ("relative_to_init", 2.0), ("radius", 0.05),
                                         ("radius", 1e3), ("init_diameter", 0.3), ("init_diameter", 3.0)])
def test_radii_and_feasibility_match_the_per_row_loop(dtype, kind, rule, value):
    c = make_set(kind, rule, value)
    for zero_row in (False, True):
        params = tensors(dtype, zero_row=zero_row)
        try:
            legacy_radii(c, params)
        except ValueError as err:  # a simplex's one-element rows have no diameter: the same error
            with pytest.raises(ValueError) as new:
                c.resolve_radii(params)
            assert str(new.value) == str(err)
            params = params[:3]
        new_radii, old_radii, new_p, old_p, new_w, old_w = run_both(c, params)
        assert [list(r) for r in new_radii] == old_radii  # bit for bit: the same floats
        assert_same(new_p, old_p)
        assert new_w == old_w
        if rule == "radius" and value < 1 and kind not in ("simplex", "nonneg_l1"):
            assert new_w and "balls of the" in new_w[0]  # every row was moved, and said so


@pytest.mark.parametrize("kind", list(SETS))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_relative_radii_are_the_plain_row_norms(kind, dtype):
    params = tensors(dtype)
    radii = make_set(kind, "relative_to_init", 1.5).resolve_radii(params)
    for p, per_tensor in zip(params, radii):
        rows = list(p.unbind(0)) if p.dim() >= 2 else [p]
        assert list(per_tensor) == [1.5 * plain_norm(kind, row) for row in rows]
    if kind == "simplex":
        params = params[:3]  # a one-element simplex has no diameter (test_radii_and_feasibility_...: the error)
    radii = make_set(kind, "init_diameter", 1.5).resolve_radii(params)
    for p, per_tensor in zip(params, radii):
        rows = list(p.unbind(0)) if p.dim() >= 2 else [p]
        unit = [make_set(kind, "radius", 1.0).l2_diameter(tuple(row.shape), 1.0) for row in rows]
        assert list(per_tensor) == [2.0 * 1.5 * math.sqrt(float(row.double().pow(2).sum())) / u
                                    for row, u in zip(rows, unit)]


@pytest.mark.parametrize("kind", ["l1", "l2", "linf"])
def test_scaled_up_start_is_rescaled_row_by_row_with_one_warning(kind):
    """Radii from the weights, then the weights scaled up: every row outside its ball, moved in, counted once."""
    params = tensors(torch.float32)
    c = make_set(kind, "relative_to_init", 1.0)
    radii = c.resolve_radii(params)
    scaled = [p * 3 for p in params]
    new_radii, _, new_p, old_p, new_w, old_w = run_both(c, scaled, radii)
    assert_same(new_p, old_p)
    rows = sum(c.row_count(p) for p in params)
    assert new_w == old_w and len(new_w) == 1
    assert f"[the first of {rows} balls of the {rows} (row scope) moved]" in new_w[0]
    for p, per_tensor in zip(new_p, new_radii):
        for row, r in zip(list(p.unbind(0)) if p.dim() >= 2 else [p], per_tensor):
            assert plain_norm(kind, row) <= r
            assert plain_norm(kind, row) > r * (1 - 1e-5)  # rescaled onto the sphere, not further in


def test_feasible_rows_are_untouched_and_not_counted():
    params = tensors(torch.float32)
    c = fgfw.L1Ball(radius=1.0, scope="row")
    before = [p.clone() for p in params]
    new_radii, _, new_p, old_p, new_w, old_w = run_both(c, params, [[1.0] * c.row_count(p) for p in params])
    assert_same(new_p, old_p)
    moved = sum(plain_norm("l1", row) > 1.0 for p in before for row in (p.unbind(0) if p.dim() >= 2 else [p]))
    assert 0 < moved < sum(c.row_count(p) for p in params)
    assert f"[the first of {moved} balls of the" in new_w[0] and new_w == old_w
    for p, p0 in zip(new_p, before):
        for row, row0 in zip(p.unbind(0) if p.dim() >= 2 else [p], p0.unbind(0) if p0.dim() >= 2 else [p0]):
            if plain_norm("l1", row0) <= 1.0:
                assert torch.equal(row, row0)


@pytest.mark.parametrize("kind", ["l1", "l2", "linf", "ksparse"])
def test_empty_tensors(kind):
    c = make_set(kind, "radius", 0.5)
    params = [torch.zeros(0, 4), torch.zeros(3, 0), torch.zeros(0), torch.randn(2, 3)]
    new_radii, old_radii, new_p, old_p, new_w, old_w = run_both(c, params)
    assert [list(r) for r in new_radii] == old_radii == [[], [0.5] * 3, [0.5], [0.5] * 2]
    assert_same(new_p, old_p)
    assert new_w == old_w
    rel = make_set(kind, "relative_to_init", 1.0)
    assert rel.resolve_radii([torch.zeros(0, 4)]) == [[]]
    for empty_rows in (torch.zeros(3, 0), torch.zeros(0)):  # no norm to take a radius from: the same error
        with pytest.raises(ValueError) as new:
            rel.resolve_radii([empty_rows])
        with pytest.raises(ValueError) as old:
            legacy_radii(rel, [empty_rows])
        assert str(new.value) == str(old.value)


def test_zero_rows_take_their_modules_draws():
    torch.manual_seed(0)
    model = nn.Linear(8, 5)
    with torch.no_grad():
        model.weight[1] = 0
        model.weight[3] = 0
    constraints.register_modules(model)
    for kind in ("l1", "l2", "linf"):
        c = make_set(kind, "relative_to_init", 2.0)
        new = c.resolve_radii([model.weight])
        assert [list(r) for r in new] == legacy_radii(c, [model.weight])
        draws = constraints.init_draws(model.weight)
        assert new[0][1] == sum(2.0 * plain_norm(kind, d[1]) for d in draws) / len(draws)


def test_a_row_that_gives_no_radius_names_itself():
    c = fgfw.L1Ball.relative_to_init(1.0, scope="row")
    p = torch.randn(4, 3, dtype=torch.float64)
    p[2, 0] = math.inf
    with pytest.raises(ValueError, match=r"row 2 of parameter 0 \(shape \(4, 3\)\)"):
        c.resolve_radii([p])
    simplex = fgfw.Simplex.from_init_diameter(1.0, scope="row")  # one-element rows have no diameter
    with pytest.raises(ValueError) as new:
        simplex.resolve_radii([torch.rand(3, 1)])
    with pytest.raises(ValueError) as old:
        legacy_radii(simplex, [torch.rand(3, 1)])
    assert str(new.value) == str(old.value)


@pytest.mark.parametrize("kind", ["l1", "l2", "lp3"])
def test_long_rows_match_with_two_threads(kind):
    """Rows over ROW_BATCH_MAX elements are reduced one at a time, as before (torch splits such a reduction
    across threads, which can change its last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(3)
        params = [torch.randn(2, constraints.ROW_BATCH_MAX + 5000, generator=g)]
        for rule, value in (("relative_to_init", 0.5), ("init_diameter", 0.2)):
            new_radii, old_radii, new_p, old_p, new_w, old_w = run_both(make_set(kind, rule, value), params)
            assert [list(r) for r in new_radii] == old_radii
            assert_same(new_p, old_p)
            assert new_w == old_w
    finally:
        torch.set_num_threads(threads)


def test_non_contiguous_tensor():
    c = fgfw.L2Ball(radius=0.5, scope="row")
    base = torch.randn(10, 6)
    new, old = base.clone().t(), base.clone().t()
    radii = [[0.5] * 6]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        c.make_feasible_([new], radii)
    legacy_make_feasible_(c, [old], radii)
    assert torch.equal(new, old)


@pytest.mark.parametrize("dtype", DTYPES)
def test_optimizer_construction(dtype):
    """Through FrankWolfe: the group's radii and rescaled start as the per-row loops give them, one warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 4)).to(dtype)
    start = [p.detach().clone() for p in model.parameters()]
    c = fgfw.L1Ball(radius=0.3, scope="row")
    with pytest.warns(UserWarning, match=r"\[the first of 15 balls of the 15 \(row scope\) moved\]"):
        opt = fgfw.FrankWolfe([{"params": list(model.parameters()), "constraint": c}], constraint=c)
    assert opt.param_groups[0]["radii"] == [(0.3,) * 9, (0.3,), (0.3,) * 4, (0.3,)]
    legacy_make_feasible_(c, start, [[0.3] * c.row_count(p) for p in start])
    assert_same([p.detach() for p in model.parameters()], start)

    rel = fgfw.L2Ball.relative_to_init(0.5, scope="row")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a shrink by the rule is silent
        opt = fgfw.FrankWolfe([{"params": list(model.parameters()), "constraint": rel}], constraint=rel)
    assert [list(r) for r in opt.param_groups[0]["radii"]] == legacy_radii(rel, start)


def test_centred_balls():
    """center="init": the radii from the start, and a later smaller radius moves theta - c row by row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 4))
    start = [p.detach().clone() for p in model.parameters()]
    rel = fgfw.L1Ball.relative_to_init(2.0, scope="row")
    opt = fgfw.FrankWolfe([{"params": list(model.parameters()), "constraint": rel, "center": "init"}],
                          constraint=rel)
    assert [list(r) for r in opt.param_groups[0]["radii"]] == legacy_radii(rel, start)
    assert_same([p.detach() for p in model.parameters()], start)  # a centred start is not moved
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    moved = [p.detach().clone() for p in model.parameters()]
    small = fgfw.L1Ball(radius=0.1, scope="row")
    opt.param_groups[0]["constraint"] = small
    with pytest.warns(UserWarning, match="less their centre"):
        settings.apply_setting_changes(opt)
    deltas = [m - s for m, s in zip(moved, start)]
    legacy_make_feasible_(small, deltas, [[0.1] * small.row_count(p) for p in start])
    assert_same([p.detach() for p in model.parameters()], [s + d for s, d in zip(start, deltas)])


@pytest.mark.parametrize("kind", ["l1", "l2", "linf", "simplex"])
def test_rows_taken_in_small_blocks(kind, monkeypatch):
    """The rows of a tensor are taken a block at a time (ROW_BLOCK_ELEMENTS): the same values with tiny blocks."""
    monkeypatch.setattr(constraints, "ROW_BLOCK_ELEMENTS", 25)
    for rule, value in (("relative_to_init", 0.5), ("radius", 0.05), ("init_diameter", 1.0)):
        params = tensors(torch.float32, zero_row=True)[:3]
        new_radii, old_radii, new_p, old_p, new_w, old_w = run_both(make_set(kind, rule, value), params)
        assert [list(r) for r in new_radii] == old_radii
        assert_same(new_p, old_p)
        assert new_w == old_w
