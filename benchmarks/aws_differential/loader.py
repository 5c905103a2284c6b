"""Loading AWS-written kernels from a local folder with only the NKI module paths mapped onto the interpreter.

Nothing of AWS's code is changed: a kernel file is executed as it is (``importlib`` from its path), a package is
imported by its own dotted name from its own source root, and an API-doc example is the text of one
``.. code-block:: python`` block of a docstring, executed as written. The only intervention is
:data:`NKI_MODULES`: while a case loads and runs, ``import nki`` / ``nki.language`` / ``nki.isa`` /
``nki.isa.constants`` resolve to ``vllm_moe_w8.kernels.nki_cpu`` and its modules (restored afterwards).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import re
import sys
import textwrap
import types
from pathlib import Path

# The NKI module path -> the interpreter module it is mapped to (nothing else is mapped).
NKI_MODULES = {
    "nki": "vllm_moe_w8.kernels.nki_cpu",
    "nki.language": "vllm_moe_w8.kernels.nki_cpu.language",
    "nki.isa": "vllm_moe_w8.kernels.nki_cpu.isa",
    "nki.isa.constants": "vllm_moe_w8.kernels.nki_cpu.isa",
    "nki.typing": "vllm_moe_w8.kernels.nki_cpu.language",  # the tutorials' annotation ``from nki.typing import tensor``
}


class SourceMissing(FileNotFoundError):
    """A pinned AWS file is not in the local folder."""


def source_path(folder: Path, repo: str, commit: str, path: str) -> Path:
    """``<folder>/<repo name>@<commit[:7]>/<path>``, refusing a missing file with what to extract."""
    name = repo.split("/")[-1]
    p = Path(folder) / f"{name}@{commit[:7]}" / path
    if not p.is_file():
        raise SourceMissing(f"{p} is missing: extract {path} of https://github.com/{repo} at {commit} into "
                            f"{Path(folder) / f'{name}@{commit[:7]}'} (see DEVELOPING.md, AWS kernels)")
    return p


@contextlib.contextmanager
def nki_mapped():
    """``nki``, ``nki.language``, ``nki.isa``, ``nki.isa.constants`` -> the interpreter, for the duration."""
    saved = {name: sys.modules.get(name) for name in NKI_MODULES}
    env = dict(os.environ)
    try:
        for name, target in NKI_MODULES.items():
            sys.modules[name] = importlib.import_module(target)
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        os.environ.clear()
        os.environ.update(env)  # some AWS example files set NEURON_* variables at import


def load_file(path: Path, module_name: str) -> types.ModuleType:
    """Execute one AWS kernel file as a module (inside :func:`nki_mapped`)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def load_package(source_root: Path, dotted: str) -> types.ModuleType:
    """Import ``dotted`` from the package tree under ``source_root`` (inside :func:`nki_mapped`); the tree's own
    ``__init__`` files run as they are. Modules already imported from that root are dropped first, so every case
    imports the package against the interpreter as it is now."""
    root = str(Path(source_root).resolve())
    top = dotted.split(".")[0]
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        return importlib.import_module(dotted)
    finally:
        sys.path.remove(root)


def _blocks_of(doc: str) -> list[str]:
    """The ``.. code-block:: python`` blocks of one docstring: the lines after the directive that are blank or
    indented deeper than it, dedented."""
    lines, blocks, i = doc.splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)\.\. code-block:: python\s*$", lines[i])
        i += 1
        if not m:
            continue
        depth, body = len(m.group(1)), []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > depth):
            body.append(lines[i])
            i += 1
        blocks.append(textwrap.dedent("\n".join(body)).strip("\n") + "\n")
    return blocks


def doc_blocks(path: Path) -> list[str]:
    """Every ``.. code-block:: python`` block in the docstrings of a Python API stub, as written."""
    tree = ast.parse(path.read_text())
    blocks = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                blocks += _blocks_of(doc)
    return blocks


def load_doc_example(path: Path, kernel: str, module_name: str) -> types.ModuleType:
    """The module made by executing the one doc code block that defines ``def <kernel>(`` (inside
    :func:`nki_mapped`). The block is written to a file first so the interpreter can read the kernel's source."""
    found = [b for b in doc_blocks(path) if re.search(rf"^\s*def {re.escape(kernel)}\(", b, re.M)]
    if len(found) != 1:
        raise LookupError(f"{path}: {len(found)} code blocks define {kernel!r} (expected one)")
    text = found[0]
    if "import nki" not in text:  # the API reference's blocks assume its usual imports when they omit them
        text = "import nki\nimport nki.isa as nisa\nimport nki.language as nl\n" + text
    cache = Path(os.environ.get("TMPDIR", "/tmp")) / "vllm_moe_w8_aws_doc_examples"
    cache.mkdir(parents=True, exist_ok=True)
    file = cache / f"{module_name}.py"
    file.write_text(text)
    return load_file(file, module_name)
