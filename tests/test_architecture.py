"""The shape of the house, checked on the source (no import is executed).

Every module of ``vllm_moe_w8`` and of ``kernels/`` (shipped as ``vllm_moe_w8.kernels``) is parsed with ``ast``,
every import statement counted wherever it sits (module level, inside a function, behind a guard), plus
``importlib.import_module`` / ``__import__`` calls with a literal name. From that: the import graph between
project modules has no cycle; the codec and the op import neither vLLM nor a Neuron package; only the Neuron
glue and the kernels import Neuron packages; no module is longer than ``MAX_MODULE_LINES``. Each rule is also
run on a small synthetic tree with the fault planted, to show the checker catches it.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Import name -> source folder, as pyproject's package-dir maps them.
PROJECT_ROOTS = {"vllm_moe_w8": REPO / "vllm_moe_w8", "vllm_moe_w8.kernels": REPO / "kernels", "vllm_moe_w8.configs": REPO / "configs"}
NEURON_PACKAGES = ("nki", "torch_neuronx", "libtorch_neuronx_lite", "vllm_neuron", "nkilib", "neuronxcc")
NEURON_ROOMS = ("vllm_moe_w8.neuron_glue", "vllm_moe_w8.kernels")
VLLM_FREE_ROOMS = ("vllm_moe_w8.codec", "vllm_moe_w8.op")
MAX_MODULE_LINES = 400  # "small legible modules": a module longer than this is split by concern


def find_modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under each root (a folder's __init__ is the package)."""
    modules = {}
    for base, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([base, *parts])] = path
    return modules


def _literal_import_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                yield node.args[0].value


def imported_names(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every dotted name ``module`` imports, made absolute; ``from X import a`` is X.a when that is a module, else X."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                base = package.split(".")
                origin = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            names.update(f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names)
    names.update(_literal_import_calls(tree))
    return names


def project_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    return {m: {n for n in imported_names(m, p, modules) if n in modules and n != m} for m, p in modules.items()}


def import_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a list of modules, or None."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def third_party_violations(modules: dict[str, Path], rooms: tuple[str, ...], forbidden: tuple[str, ...], *, inside: bool) -> list[str]:
    """Modules inside (``inside=True``) or outside ``rooms`` that import any of the ``forbidden`` top-level packages."""
    found = []
    for module, path in modules.items():
        in_room = any(module == r or module.startswith(r + ".") for r in rooms)
        if in_room != inside:
            continue
        bad = sorted({n for n in imported_names(module, path, modules) if n and n.split(".")[0] in forbidden})
        if bad:
            found.append(f"{module} imports {bad}")
    return found


def long_modules(modules: dict[str, Path], limit: int = MAX_MODULE_LINES) -> list[str]:
    return [f"{m} ({n} lines)" for m, p in modules.items() if (n := len(p.read_text().splitlines())) > limit]


# ---- the project -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def modules():
    found = find_modules(PROJECT_ROOTS)
    assert "vllm_moe_w8.op.custom_op" in found and "vllm_moe_w8.kernels.moe_w8" in found
    return found


def test_the_import_graph_has_no_cycle(modules):
    edges = project_edges(modules)
    assert sum(len(t) for t in edges.values()) > 20, "the graph is suspiciously empty: is the parser seeing imports?"
    assert import_cycle(edges) is None, f"import cycle: {' -> '.join(import_cycle(edges))}"


def test_codec_and_op_import_neither_vllm_nor_neuron(modules):
    assert third_party_violations(modules, VLLM_FREE_ROOMS, ("vllm", *NEURON_PACKAGES), inside=True) == []


def test_only_the_neuron_glue_and_the_kernels_import_neuron_packages(modules):
    assert third_party_violations(modules, NEURON_ROOMS, NEURON_PACKAGES, inside=False) == []
    # The rule is not vacuous: the Neuron glue and the kernels do name them.
    assert third_party_violations(modules, NEURON_ROOMS, NEURON_PACKAGES, inside=True)


def test_the_codec_imports_no_other_room(modules):
    codec = {m: p for m, p in modules.items() if m.startswith("vllm_moe_w8.codec")}
    edges = project_edges(modules)
    outside = {m: sorted(t for t in edges[m] if not t.startswith(("vllm_moe_w8.codec", "vllm_moe_w8.about"))) for m in codec}
    assert {m: t for m, t in outside.items() if t} == {}


def test_no_module_is_over_the_line_limit(modules):
    assert long_modules(modules) == []


# ---- the checker catches planted faults ------------------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return find_modules({"pkg": root})


def test_a_lazy_import_circle_is_caught(tmp_path):
    mods = _tree(tmp_path, {
        "__init__.py": "",
        "room/__init__.py": "",
        "room/config.py": "def method():\n    from pkg.room.method import Method\n    return Method\n",
        "room/method.py": "from pkg.room import config\n\nclass Method:\n    pass\n",
        "leaf.py": "X = 1\n",
    })
    cycle = import_cycle(project_edges(mods))
    assert cycle is not None and set(cycle) == {"pkg.room.config", "pkg.room.method"}


def test_a_relative_import_circle_is_caught(tmp_path):
    mods = _tree(tmp_path, {"__init__.py": "", "a.py": "from . import b\n", "b.py": "from .a import thing\n"})
    assert import_cycle(project_edges(mods)) is not None


def test_importing_sibling_modules_through_their_package_is_no_circle(tmp_path):
    mods = _tree(tmp_path, {
        "__init__.py": "def register():\n    from pkg.glue import hook\n",
        "glue/__init__.py": "", "glue/hook.py": "from pkg.glue import names\n", "glue/names.py": "N = 1\n",
    })
    assert import_cycle(project_edges(mods)) is None


def test_a_neuron_import_outside_its_room_is_caught(tmp_path):
    mods = _tree(tmp_path, {
        "__init__.py": "",
        "codec/__init__.py": "",
        "codec/fp8.py": "def f():\n    import importlib\n    return importlib.import_module('torch_neuronx')\n",
        "op/__init__.py": "", "op/cpu.py": "try:\n    import nki.language as nl\nexcept ImportError:\n    nl = None\n",
    })
    found = third_party_violations(mods, ("pkg.neuron_glue",), NEURON_PACKAGES, inside=False)
    assert any("pkg.codec.fp8" in f for f in found) and any("pkg.op.cpu" in f for f in found)
    assert third_party_violations(mods, ("pkg.codec",), ("vllm", *NEURON_PACKAGES), inside=True)


def test_an_over_long_module_is_caught(tmp_path):
    mods = _tree(tmp_path, {"__init__.py": "", "short.py": "x = 1\n" * MAX_MODULE_LINES,
                            "long.py": "x = 1\n" * (MAX_MODULE_LINES + 1)})
    assert long_modules(mods) == [f"pkg.long ({MAX_MODULE_LINES + 1} lines)"]
