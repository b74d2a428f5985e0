"""Data-parallel forward-gradient training over torch.distributed (gloo, CPU), 2 and 4 processes.

Each scenario runs in real processes (tests/distributed_worker.py), which save what they observed. The
properties: the replicas stay bit-identical (they start from rank 0's parameters and draw the same
tangents); they equal a single-process run over the union of the ranks' batches (float64; the only
difference is the rounding of the mean of the ranks' directional derivatives, so the tolerance is 1e-10
where the parameters are O(1)); a step sends 8 (K + 1) bytes; a non-finite rank makes every rank refuse
the step alike; a seed mismatch is refused at start; a checkpoint written by rank 0 resumes the same
trajectory; FrankWolfe under DistributedDataParallel works unchanged.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fgfw

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import distributed_worker as worker  # noqa: E402

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available in this torch build")


def run_ranks(scenario: str, world: int, tmp_path: Path) -> list[dict]:
    """Runs ``scenario`` on ``world`` processes; their results in rank order."""
    init_file = tmp_path / "init"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("FGFW_BACKEND", None)
    procs = [subprocess.Popen([sys.executable, str(HERE / "distributed_worker.py"), scenario, str(rank), str(world),
                               str(init_file), str(tmp_path / f"rank{rank}.pt")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append(out)
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]


def single_process(kind: str, world: int, unequal: bool = False) -> list[torch.Tensor]:
    """The same training in one process on the union of the ranks' batches (rank 0's starting model)."""
    m = worker.model(seed=100)
    opt = worker.make_optimizer(kind, m, seed=7, process_group=None)
    for x, y in worker.union_batches(sizes=worker.sizes_for(world, unequal)):
        opt.step(worker.closure_for(kind, m, x, y))
    return [p.detach().clone() for p in m.parameters()]


def assert_identical_across_ranks(results: list[dict], key: str = "params") -> None:
    for rank, result in enumerate(results[1:], start=1):
        for a, b in zip(results[0][key], result[key]):
            assert torch.equal(a, b), f"rank {rank}'s {key} differ from rank 0's"


@pytest.mark.parametrize("world", [2, 4])
def test_replicas_stay_identical_and_equal_one_process_on_the_union(world, tmp_path):
    results = run_ranks("train", world, tmp_path)
    assert_identical_across_ranks(results, "start")  # rank 0's model, broadcast: each rank built another one
    assert_identical_across_ranks(results)
    expected = single_process("afgfw", world)
    for got, want in zip(results[0]["params"], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # one all-reduce per step: K = 2 float64 derivatives and the batch weight
    k = 2
    assert all(bytes_ == 8 * (k + 1) for r in results for bytes_ in r["bytes_per_step"])


def test_unequal_batches_are_weighted_by_their_size(tmp_path):
    results = run_ranks("train_unequal", 2, tmp_path)
    assert_identical_across_ranks(results)
    expected = single_process("afgfw", 2, unequal=True)
    for got, want in zip(results[0]["params"], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_guided_tangents_need_no_more_communication(tmp_path):
    # v and the projected tangents are the same on every rank (bit-identical replicas): only the K directional
    # derivatives are averaged, as for the plain estimate, and the run equals one process on the union
    results = run_ranks("train_guided", 2, tmp_path)
    assert_identical_across_ranks(results)
    expected = single_process("guided", 2)
    for got, want in zip(results[0]["params"], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert all(bytes_ == 8 * (2 + 1) for r in results for bytes_ in r["bytes_per_step"])


def test_the_activity_estimate_is_averaged_like_a_gradient(tmp_path):
    # every rank gets the whole batch (the activity tangents depend on an example's place in the batch): the
    # mean of equal estimates is the estimate, exactly, so the run equals one process bit for bit
    results = run_ranks("train_activity", 2, tmp_path)
    assert_identical_across_ranks(results)
    m = worker.model(seed=100)
    opt = worker.make_optimizer("activity", m, seed=7, process_group=None)
    for x, y in worker.union_batches(sizes=worker.sizes_for(2, False)):
        opt.step(worker.closure_for("activity", m, x, y))
    for got, want in zip(results[0]["params"], m.parameters()):
        assert torch.equal(got, want.detach())
    numel = sum(p.numel() for p in m.parameters())
    assert all(b == 8 * (numel + 1) for r in results for b in r["bytes_per_step"])  # one float64 bucket


def test_dense_estimates_are_averaged_with_the_batch_weights(tmp_path):
    results = run_ranks("mean_dense", 2, tmp_path)
    weights = [2.0, 4.0]  # 2 (r + 1)
    want64 = (weights[0] * 1.0 + weights[1] * 2.0) / sum(weights)
    want32 = (weights[0] * 0.5 + weights[1] * 1.0) / sum(weights)
    for r in results:
        assert torch.equal(r["tensors"][0], torch.full((3, 2), want64, dtype=torch.float64))
        torch.testing.assert_close(r["tensors"][1], torch.full((5,), want32))
        assert sorted(r["bytes"]) == sorted([8 * (6 + 1), 4 * (5 + 1)])  # a bucket per dtype, weight appended


def test_a_non_finite_rank_makes_every_rank_refuse_the_step(tmp_path):
    results = run_ranks("nonfinite", 2, tmp_path)
    for r in results:
        assert r["outcome"][:2] == ["stepped", "stepped"]
        assert r["outcome"][2].startswith("raised (unchanged): the directional derivative <grad f, u> was not finite")
        assert r["outcome"][3] == "stepped"  # the next step goes on, alike on every rank
    assert_identical_across_ranks(results)


def test_a_seed_mismatch_is_refused_on_every_rank(tmp_path):
    results = run_ranks("seed_mismatch", 2, tmp_path)
    for r in results:
        assert r["error"] is not None and "rank 0 has 7, rank 1 has 8" in r["error"]


def test_ranks_without_a_seed_use_rank_0s(tmp_path):
    results = run_ranks("seed_agreed", 2, tmp_path)
    assert results[0]["seed"] == results[1]["seed"]


def test_diverged_replicas_are_detected_at_the_next_check(tmp_path):
    results = run_ranks("diverge", 2, tmp_path)
    for r in results:
        assert r["step"] == 2 and "the parameters differ across ranks after step 2" in r["error"]


def test_a_checkpoint_from_rank_0_resumes_the_same_trajectory(tmp_path):
    results = run_ranks("resume", 2, tmp_path)
    for r in results:
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
    assert_identical_across_ranks(results, "resumed")


def test_frank_wolfe_under_distributed_data_parallel(tmp_path):
    results = run_ranks("ddp_frank_wolfe", 2, tmp_path)
    assert_identical_across_ranks(results)
    m = worker.model(seed=100)
    opt = fgfw.FrankWolfe(m.parameters(), constraint=fgfw.L1Ball.relative_to_init(1.5), step_size=0.05, momentum=0.5)
    for x, y in worker.union_batches(sizes=worker.sizes_for(2, False)):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    for got, want in zip(results[0]["params"], m.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-10)


def test_without_torch_distributed_nothing_is_communicated():
    assert fgfw.distributed.resolve_group("auto") is None or dist.get_world_size() == 1
    with pytest.raises(ValueError, match="process_group must be 'auto', None or a torch.distributed ProcessGroup"):
        fgfw.AFGFW(worker.model(seed=1), constraint=fgfw.L1Ball(radius=10.0), process_group="world")
    with pytest.raises(ValueError, match="batch_size must be None or an integer >= 1"):
        m = worker.model(seed=1)
        fgfw.AFGFW(m, constraint=fgfw.L1Ball(radius=10.0)).step(lambda: m(torch.zeros(1, 12)).sum(), batch_size=0)


@pytest.mark.parametrize("world", [2, 4])
def test_the_torchrun_example_keeps_the_ranks_identical(world, tmp_path):
    """examples/ddp_mnist.py as docs/usage.md runs it (scikit-learn's digits instead of MNIST, 5 steps)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("FGFW_BACKEND", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                           str(HERE.parent / "examples" / "ddp_mnist.py"), "--data", "digits", "--steps", "5",
                           "--num-tangents", "3"], env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]

    lines = re.findall(r"rank (\d+) params_sha256 ([0-9a-f]{64}) allreduce_bytes_per_step (\d+)", output)
    assert sorted(int(r) for r, _, _ in lines) == list(range(world))
    assert len({digest for _, digest, _ in lines}) == 1  # bit-identical parameters on every rank
    assert {int(n) for _, _, n in lines} == {8 * (3 + 1)}
