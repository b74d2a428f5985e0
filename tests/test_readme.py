"""The Python examples of the README and of docs/ run against the code as it is: each ```python block is
executed with small stand-ins for the names it leaves to the reader (model, loader, x, y, ...). Every
optimizer a block builds then takes steps, and its parameters must stay in their set. A renamed argument, a
set that no longer accepts an example's radius rule, or an example that steps out of its set fails here."""
import ast
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fgfw

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the user documentation whose examples are run: the README and the pages it sends readers to
PAGES = [README, ROOT / "docs" / "usage.md", ROOT / "docs" / "models.md", ROOT / "docs" / "transformers.md"]


def python_blocks() -> list[str]:
    return [block for page in PAGES
            for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)]


def block_with(*names: str) -> str:
    """The one block that uses all of ``names`` (so that a test follows its block when blocks move)."""
    found = [b for b in python_blocks() if all(n in b for n in names)]
    assert len(found) == 1, f"expected one python block with {names} in the README and docs, found {len(found)}"
    return found[0]


def stand_ins(device="cpu") -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    batches = [(torch.randn(8, 12, device=device), torch.randint(0, 4, (8,), device=device)) for _ in range(2)]
    x, y = batches[0]
    return dict(torch=torch, F=F, fgfw=fgfw, model=model, loader=batches, x=x, y=y, loss_fn=F.cross_entropy,
                x_static=x.clone(), y_static=y.clone(),
                mixture_logits=torch.full((5,), 0.2, device=device, requires_grad=True),
                adapter=nn.Linear(10, 6).to(device), layer=nn.Linear(10, 6).to(device))


def is_fgfw_call(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "fgfw")


def run_collecting(code: str, namespace: dict) -> list:
    """Executes ``code``; returns every optimizer it builds, in order, kept or not: the value of each
    top-level ``fgfw.X(...)`` statement or assignment passes through ``_keep``."""
    made = []

    def keep(value):
        if isinstance(value, torch.optim.Optimizer):
            made.append(value)
        return value

    tree = ast.parse(code)
    for node in tree.body:
        if isinstance(node, (ast.Expr, ast.Assign)) and is_fgfw_call(node.value):
            node.value = ast.Call(func=ast.Name("_keep", ast.Load()), args=[node.value], keywords=[])
    namespace["_keep"] = keep
    exec(compile(ast.fix_missing_locations(tree), str(README), "exec"), namespace)
    return made


def statements(code: str) -> list[str]:
    """The top-level statements of a block, each as source."""
    return [ast.get_source_segment(code, node) for node in ast.parse(code).body]


def snapshot(namespace: dict) -> list[torch.Tensor]:
    return [p.detach().clone() for p in namespace["model"].parameters()]


def assert_moved(before: list[torch.Tensor], namespace: dict) -> None:
    """The block's steps changed the model (they ran, and did not leave it as it was)."""
    assert any(not torch.equal(a, p) for a, p in zip(before, namespace["model"].parameters())), "no step moved"


def assert_in_sets(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        constraint, params, radii = group["constraint"], group["params"], group["radii"]
        if isinstance(constraint, fgfw.Unconstrained):
            continue
        if constraint.scope == "global":
            balls = [(torch.cat([p.detach().reshape(-1) for p in params]), radii[0])]
        elif constraint.scope == "row":
            balls = [(row, r) for p, rs in zip(params, radii) for row, r in zip(type(constraint).rows(p.detach()), rs)]
        else:
            balls = [(p.detach(), r) for p, r in zip(params, radii)]
        for values, r in balls:
            assert constraint.contains(values, r, rtol=1e-5), f"{constraint} left its ball of radius {r}"


def take_steps(opt: torch.optim.Optimizer, namespace: dict) -> None:
    """Two steps on the stand-in batch: a closure for the forward-gradient optimizers, backward otherwise."""
    x, y = namespace["x"], namespace["y"]
    params = [p for g in opt.param_groups for p in g["params"]]
    for _ in range(2):
        if isinstance(opt, fgfw.FrankWolfe):
            opt.zero_grad()
            if any(p is q for p in params for q in namespace["model"].parameters()):
                loss = F.cross_entropy(namespace["model"](x), y)
            else:  # a stand-in tensor of its own: any differentiable loss of it
                loss = sum(((p - 1) ** 2).sum() for p in params)
            loss.backward()
            opt.step()
        else:
            # the activity estimator takes the per-example losses, the others a scalar (as the README says)
            reduction = "none" if getattr(opt, "estimator", None) == "activity" else "mean"
            loss = opt.step(lambda: F.cross_entropy(namespace["model"](x), y, reduction=reduction))
            assert torch.isfinite(loss).all()
        assert_in_sets(opt)


@pytest.mark.filterwarnings("ignore:initial parameters have")
def test_quick_start_examples_run_and_stay_in_their_sets():
    ns = stand_ins()
    before = snapshot(ns)
    made = run_collecting(block_with('estimator="activity"', "fgfw.FrankWolfe("), ns)
    assert len(made) == 3
    assert_moved(before, ns)
    for opt in made:
        assert_in_sets(opt)
        take_steps(opt, ns)


def test_the_first_quick_start_learns_as_the_readme_says():
    """The README's first block trains an MLP on scikit-learn's digits with AFGFW: the loss it prints falls from
    above 2.2 (chance: ln 10 = 2.30) to below 0.4, as the README states, and the weights stay in their balls."""
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (the 'demo' extra)")
    ns = {}
    made = run_collecting(block_with("load_digits", "loss_before"), ns)
    assert len(made) == 1 and isinstance(made[0], fgfw.AFGFW)
    assert ns["loss_before"] > 2.2 and ns["loss_after"] < 0.4, (ns["loss_before"], ns["loss_after"])
    assert "from 2.33 to below 0.4" in README.read_text()
    assert_in_sets(made[0])


def test_the_fine_tuning_recipe_steps_like_sgd_from_the_centre():
    """docs/usage.md's forward-gradient fine-tuning block: from the pre-trained weights (the centre of its L2 balls)
    its first step is SGD's, theta_1 - theta_0 = -alpha v_1 with v_1 the momentum the step stored (rescale="gradient":
    min(alpha ||v|| / r, 1) (s - theta) with s - theta = -r v / ||v||), and its steps stay in the balls."""
    ns = stand_ins()
    ns["params"] = list(ns["model"].parameters())
    start = snapshot(ns)
    (opt,) = run_collecting(block_with('rescale="gradient"', "averaging_weight=0.01"), ns)
    alpha = opt.param_groups[0]["step_size"]
    x, y = ns["x"], ns["y"]
    opt.step(lambda: F.cross_entropy(ns["model"](x), y))
    for p, p0 in zip(ns["params"], start):
        v = opt.state[p]["momentum"]
        assert v.abs().sum() > 0
        torch.testing.assert_close(p.detach() - p0, -alpha * v, rtol=1e-4, atol=1e-7)
    take_steps(opt, ns)


@pytest.mark.filterwarnings("ignore:initial parameters have")
def test_every_set_example_builds_an_optimizer_that_steps_in_its_set():
    kinds = set()
    for line in statements(block_with("KSparsePolytope", "NuclearNormBall", "Simplex")):
        ns = stand_ins()  # each example on a model of its own: they all constrain the same names
        made = run_collecting(line, ns)
        assert len(made) == 1, line
        assert_in_sets(made[0])
        take_steps(made[0], ns)
        kinds |= {type(g["constraint"]).__name__ for g in made[0].param_groups}
    assert kinds == {"L2Ball", "LInfBall", "LpBall", "KSparsePolytope", "Simplex", "NuclearNormBall", "GroupL1Ball",
                     "SpectralNormBall", "ColumnNormBall", "Unconstrained"}


@pytest.mark.filterwarnings("ignore:initial parameters have")
def test_torch_compile_example_runs():
    ns = stand_ins()
    before = snapshot(ns)
    made = run_collecting(block_with("torch.compile("), ns)
    assert len(made) == 2
    assert_moved(before, ns)
    for opt in made:
        assert_in_sets(opt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA graph example needs one")
def test_cuda_graph_example_runs():
    ns = stand_ins("cuda")
    before = snapshot(ns)
    made = run_collecting(block_with("torch.cuda.CUDAGraph()"), ns)
    assert len(made) == 1
    assert_moved(before, ns)
    assert_in_sets(made[0])


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="torch.distributed with gloo is not available in this torch build")
@pytest.mark.filterwarnings("ignore:initial parameters have")
def test_data_parallel_example_runs_in_a_one_process_group(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                            GLOO_SOCKET_IFNAME="lo").items():
        monkeypatch.setenv(name, value)
    ns = stand_ins()
    ns["dist"] = dist
    before = snapshot(ns)
    try:
        made = run_collecting(block_with("init_process_group"), ns)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert len(made) == 1
    assert_moved(before, ns)
    assert_in_sets(made[0])


@pytest.mark.filterwarnings("ignore:initial parameters have")
def test_the_quick_start_trains_a_hugging_face_gpt2():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")
    code = block_with("GPT2LMHeadModel", "fgfw.param_groups")
    torch.manual_seed(0)
    vocab = transformers.GPT2Config().vocab_size
    ns = dict(loader=[torch.randint(0, vocab, (2, 12)) for _ in range(2)])
    made = run_collecting(code, ns)
    assert len(made) == 1
    model = ns["model"]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the block stepped through its loader: the weights moved and every constrained ball holds
    assert_in_sets(made[0])
    loss = made[0].step(lambda: model(ns["loader"][0], labels=ns["loader"][0]).loss)
    assert torch.isfinite(loss)
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert_in_sets(made[0])
