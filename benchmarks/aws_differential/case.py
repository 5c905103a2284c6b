"""One pinned AWS kernel: where its source is, how it is loaded and called, and what it must compute."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import loader

SDK = ("aws-neuron/aws-neuron-sdk", "81ce03ae261e12925e53437a0f690478e6366155")
LIBRARY = ("aws-neuron/nki-library", "d2ad3a579498d1888aa8740af97fd325dd5f2740")
SAMPLES_LEGACY = ("aws-neuron/nki-samples", "7af4e4d0210b2baf98cfa2bd033b06fc8ac60355")
SAMPLES = ("aws-neuron/nki-samples", "6905a68a122f937e68403727759f035ddd144f95")


@dataclass(frozen=True)
class Case:
    """``load``: ``file`` (execute the file), ``doc`` (the docstring code block defining ``kernel``) or
    ``package:<dotted module>`` (import it with ``source_root``, a folder of the repository, on ``sys.path``).
    ``make(module, rng) -> (args, kwargs)``; ``check(outputs, args, kwargs) -> (ok, worst, detail)``.
    ``legal``: whether AWS's docs allow what the kernel does on Trn2 (NeuronCore-v3); ``why``: the citation."""

    id: str
    source: tuple[str, str]
    path: str
    kernel: str
    make: Callable
    check: Callable
    load: str = "file"
    source_root: str = ""
    grid: int = 1
    legal: bool = True
    why: str = ""
    bound: str = "bit-exact"
    tags: tuple = field(default=())

    @property
    def repo(self) -> str:
        return self.source[0]

    @property
    def commit(self) -> str:
        return self.source[1]


def _module(case: Case, folder: Path):
    if case.load == "file":
        return loader.load_file(loader.source_path(folder, case.repo, case.commit, case.path), f"aws_case_{case.id.replace('-', '_')}")
    if case.load == "doc":
        return loader.load_doc_example(loader.source_path(folder, case.repo, case.commit, case.path), case.kernel,
                                       f"aws_doc_{case.id.replace('-', '_')}")
    if case.load.startswith("package:"):
        pinned = loader.source_path(folder, case.repo, case.commit, case.path)  # the pinned file must be there
        root = Path(str(pinned)[: -len(case.path)]) / case.source_root
        return loader.load_package(root, case.load.split(":", 1)[1])
    raise ValueError(case.load)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return f"{Path(last.filename).name}:{last.lineno}" if last else ""


def run(case: Case, folder: Path, seed: int = 0) -> dict:
    """Load, run and judge one case; never raises (the verdict says what happened)."""
    from vllm_moe_w8.kernels import nki_cpu

    record = {"id": case.id, "repo": case.repo, "commit": case.commit, "path": case.path, "kernel": case.kernel,
              "grid": case.grid, "legal_per_docs": case.legal, "why": case.why, "bound": case.bound}
    with loader.nki_mapped():
        try:
            module = _module(case, folder)
            fn = getattr(module, case.kernel)
            args, kwargs = case.make(module, np.random.default_rng(seed))
        except loader.SourceMissing as exc:
            return {**record, "verdict": "missing", "detail": str(exc)}
        except Exception as exc:  # noqa: BLE001  (the verdict records it)
            return {**record, "verdict": "unsupported", "stage": "load",
                    "detail": f"{type(exc).__name__}: {exc}"[:400], "where": _where(exc)}
        try:
            out, _stats = nki_cpu.launch(fn, (case.grid,), *args, **kwargs)
        except nki_cpu.NkiValidationError as exc:
            verdict = "refused, legal per docs" if case.legal else "refused (illegal per docs)"
            return {**record, "verdict": verdict, "detail": str(exc)[:400], "where": _where(exc)}
        except Exception as exc:  # noqa: BLE001
            return {**record, "verdict": "unsupported", "stage": "run", "detail": f"{type(exc).__name__}: {exc}"[:400],
                    "where": _where(exc)}
    if not case.legal:
        return {**record, "verdict": "accepted though illegal per docs", "detail": "the interpreter ran it"}
    outs = out if isinstance(out, (tuple, list)) else (out,)
    try:
        ok, worst, detail = case.check(outs, args, kwargs)
    except Exception as exc:  # noqa: BLE001
        return {**record, "verdict": "wrong", "detail": f"output not comparable: {type(exc).__name__}: {exc}"[:400]}
    return {**record, "verdict": "exact" if ok else "wrong", "worst_over_bound": worst, "detail": detail}
