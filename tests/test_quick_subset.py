"""The quick subset (``pytest -m "not slow"``) reaches every module of the package.

Read statically from the sources (no import, no vLLM): a module counts as reached when a test outside the
``slow`` marker imports it, directly or through the package's own module-level imports. A new module that no
quick test reaches fails here, naming it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# Installed package name -> source folder (pyproject.toml [tool.setuptools.package-dir]).
PACKAGE_DIRS = {"vllm_moe_w8": REPO / "vllm_moe_w8", "vllm_moe_w8.kernels": REPO / "kernels"}


def package_modules() -> dict[str, Path]:
    """Every importable module of the package (``__init__`` as the package itself), by dotted name."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _is_slow(node: ast.AST) -> bool:
    """A function or module-level ``pytestmark`` carrying ``pytest.mark.slow``."""
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node))


def _imports(nodes, current: str | None, modules: dict[str, Path]) -> set[str]:
    """Dotted package modules named by the import statements among ``nodes`` (``from a import b``: a.b if a module)."""
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and current:  # relative import inside the package
                anchor = current.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if modules.get(current, Path()).name == "__init__.py" else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name:  # importing a.b.c loads a and a.b too
                if name in modules:
                    out.add(name)
                name = name.rpartition(".")[0]
    return out


def _quick_test_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node of a test file except those inside slow tests; nothing if the whole module is slow."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in stmt.targets) and _is_slow(stmt.value):
            return []
    nodes = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(_is_slow(d) for d in stmt.decorator_list):
            continue
        nodes.extend(ast.walk(stmt))
    return nodes


def test_every_module_is_reached_by_the_quick_subset():
    modules = package_modules()
    # The package's own module-level imports (what importing a module loads with it).
    graph = {name: _imports(ast.parse(path.read_text()).body, name, modules) for name, path in modules.items()}
    reached: set[str] = set()
    for test_file in sorted(TESTS.glob("*.py")):
        reached |= _imports(_quick_test_nodes(ast.parse(test_file.read_text())), None, modules)
    pending = list(reached)
    while pending:
        for dep in graph[pending.pop()] - reached:
            reached.add(dep)
            pending.append(dep)
    missing = sorted(set(modules) - reached)
    assert not missing, f"no test outside the slow marker imports {missing}: add a quick test for each"


def test_the_reach_check_sees_a_module_no_quick_test_imports(tmp_path):
    """The check above can fail: a module that only a slow test imports is not reached."""
    tree = ast.parse("import pytest\npytestmark = [pytest.mark.vllm, pytest.mark.slow]\nfrom vllm_moe_w8 import demo\n")
    assert _quick_test_nodes(tree) == []
    tree = ast.parse("import pytest\n@pytest.mark.slow\ndef test_a():\n    from vllm_moe_w8 import demo\n"
                     "def test_b():\n    from vllm_moe_w8.kernels import host\n")
    assert _imports(_quick_test_nodes(tree), None, package_modules()) == {"vllm_moe_w8", "vllm_moe_w8.kernels", "vllm_moe_w8.kernels.host"}
