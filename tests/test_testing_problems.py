"""fgfw.testing.problems builds every tensor on the device it is asked for, and certifies its optimum.

The CPU stands in for a GPU here: the problems are built with torch.device("meta") as the default device, so a
tensor that a helper makes without naming its device lands on meta, and the first operation mixing it with the
requested device's tensors fails. That is the failure a GPU run found (the least-squares matrix left on the CPU:
"mat is on cpu" in every feasibility test on CUDA and Triton), without a GPU.
"""
import pytest
import torch

import fgfw
from fgfw.testing import problems

SETS = [fgfw.L1Ball(radius=1.0), fgfw.L2Ball(radius=1.0), fgfw.LInfBall(radius=1.0),
        fgfw.KSparsePolytope(radius=1.0, k=5)]


@pytest.mark.parametrize("constraint", SETS, ids=lambda c: type(c).__name__)
def test_least_squares_over_lives_on_the_requested_device(constraint):
    with torch.device("meta"):
        problem = problems.least_squares_over(constraint, dim=20, iterations=500, device="cpu")
        assert {t.device.type for t in (problem.a, problem.b, problem.x_star)} == {"cpu"}
        # f(x*) = f* + certificate, evaluated on the problem's device
        assert problem.value(problem.x_star) == pytest.approx(problem.f_star + problem.certificate, rel=1e-12)
    assert abs(problem.certificate) < 1e-8 * problem.f_star  # the gap of x*, up to rounding
    assert float(constraint.gauge(problem.x_star)) == pytest.approx(1.0, rel=1e-9)  # active at the optimum


def test_least_squares_over_refuses_an_iterate_on_another_device():
    problem = problems.least_squares_over(fgfw.L2Ball(radius=1.0), dim=8, iterations=50)
    with pytest.raises(ValueError, match="device"):
        problem.value(torch.zeros(8, device="meta"))


def test_least_squares_problem_lives_on_the_requested_device():
    with torch.device("meta"):
        f, theta_star, f_star = problems.least_squares_problem(6, device="cpu")
        assert theta_star.device.type == "cpu"
        assert float(f(theta_star)) == f_star
    assert float(theta_star.abs().sum()) == pytest.approx(1.0)


def test_the_problems_depend_only_on_the_sets():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(problems.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0}
    assert imported == {"constraints"}, imported
