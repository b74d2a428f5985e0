"""The package's modules import top-down: no module imports one that (directly or not) imports it back.

Read from the source with ast (module-level and function-level ``from . import`` / ``from .x import``
statements alike), so a cycle hidden in a function body, where it runs late, counts too.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "fgfw"


def _imports(path: Path) -> set[str]:
    """The fgfw modules that ``path`` imports (names relative to the package: 'optim', 'triton.ops', ...)."""
    here = path.relative_to(PACKAGE).with_suffix("").parts[:-1]  # the subpackage the file is in
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(here[:len(here) - (node.level - 1)] if node.level > 1 else here)
            if node.module:
                found.add(".".join(base + node.module.split(".")))
            else:  # from . import a, b
                found.update(".".join(base + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fgfw."):
            found.add(node.module[len("fgfw."):])
    return found


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        modules[name.removesuffix(".__init__") if name.endswith("__init__") else name] = path
    return {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}


def test_the_modules_import_without_cycles():
    graph = _graph()
    assert {"forward_grad", "lean", "forward_ad_engine", "optim"} <= set(graph)
    done, stack = set(), []

    def visit(module):
        if module in stack:
            cycle = stack[stack.index(module):] + [module]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        stack.append(module)
        for dependency in sorted(graph[module]):
            if dependency != "__init__" and dependency != module:
                visit(dependency)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        if module != "__init__":
            visit(module)


def test_the_engines_read_top_down():
    graph = _graph()
    assert {"lean", "forward_ad_engine"} <= graph["forward_grad"]
    assert "forward_ad_engine" in graph["lean"] and "forward_grad" not in graph["lean"]
    assert not {"forward_grad", "lean"} & graph["forward_ad_engine"]
