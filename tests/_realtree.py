"""The real-tree mode of the Neuron glue tests: a local folder of real vllm-neuron files, checked and assembled.

Public vllm-neuron code is never committed. What is committed is ``tests/neuron_realtree/MANIFEST.toml`` (each
file's repository, path, commit, length and sha256, and the family trees that use it) and the labelled stubs in
``tests/neuron_realtree/stubs/`` (our own code, each naming what it replaces and why: Neuron hardware, or a file no
public tree has). A user fills a folder ``<folder>/<owner>/<repo>/<path>`` from the public repositories at the
manifest's commits (how: tests/neuron_realtree/README.md) and names it with ``--vllm-neuron-tree=<folder>`` or
``VLLM_MOE_W8_VLLM_NEURON_TREE=<folder>``; without it the real-tree tests are skipped naming the option.

* :func:`verify` - every manifest file present with its length and sha256 (a list of problems, empty when good);
* :func:`assemble` - one family's importable tree: the stubs, then the real files over them, into a fresh folder
  whose path goes first on ``sys.path`` (one tree per process: the families come from different repositories).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent / "neuron_realtree"
MANIFEST = HERE / "MANIFEST.toml"
STUBS = HERE / "stubs"
OPTION = "--vllm-neuron-tree"
ENV = "VLLM_MOE_W8_VLLM_NEURON_TREE"
SKIP_REASON = (f"real-tree mode off: name a folder of real vllm-neuron files with {OPTION}=<folder> or {ENV}=<folder> "
               "(tests/neuron_realtree/README.md says how to fill it)")


@dataclass(frozen=True)
class RealFile:
    repo: str
    path: str
    commit: str
    chars: int
    sha256: str
    trees: tuple[str, ...]
    note: str = ""

    def location(self, folder: Path) -> Path:
        return folder / self.repo / self.path


def manifest() -> list[RealFile]:
    data = tomllib.loads(MANIFEST.read_text())
    return [RealFile(f["repo"], f["path"], f["commit"], int(f["chars"]), f["sha256"], tuple(f["trees"]), f.get("note", ""))
            for f in data["file"]]


def trees() -> list[str]:
    return sorted({t for f in manifest() for t in f.trees})


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify(folder: Path) -> list[str]:
    """Problems of ``folder`` against the manifest: missing files, other lengths or hashes (empty: all good)."""
    problems = []
    for f in manifest():
        p = f.location(folder)
        if not p.is_file():
            problems.append(f"missing {f.repo} {f.path} @{f.commit[:7]} (expected at {p})")
            continue
        text = p.read_text(encoding="utf-8")
        if len(text) != f.chars or file_sha256(p) != f.sha256:
            problems.append(f"{p}: {len(text)} characters, sha256 {file_sha256(p)[:12]}; the manifest has {f.repo} "
                            f"{f.path} @{f.commit[:7]}: {f.chars} characters, sha256 {f.sha256[:12]}")
    return problems


def folder_from(config) -> Path | None:
    value = config.getoption(OPTION) if config is not None else None
    value = value or os.environ.get(ENV)
    return Path(value).expanduser().resolve() if value else None


def assemble(folder: Path, tree: str, dest: Path) -> Path:
    """Build ``tree`` under ``dest`` (stubs first, real files over them); return the folder to put on sys.path."""
    files = [f for f in manifest() if tree in f.trees]
    if not files:
        raise ValueError(f"no real-tree {tree!r}; the manifest has {trees()}")
    root = dest / tree
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(STUBS, root, ignore=shutil.ignore_patterns("__pycache__"))
    for f in files:
        target = root / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f.location(folder), target)
    return root


def sources(tree: str) -> list[str]:
    """``repo path @commit`` of every real file of ``tree`` (for messages and the report)."""
    return [f"{f.repo} {f.path} @{f.commit[:7]}" for f in manifest() if tree in f.trees]
