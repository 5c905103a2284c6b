"""The differential harness (benchmarks/aws_differential) judges kernels as it says it does, on kernels written here
(AWS's code is never in the repository: the real run takes a local folder, DEVELOPING.md), and its pinned list is the
one DEVELOPING.md publishes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from benchmarks.aws_differential import case as C
from benchmarks.aws_differential import loader
from benchmarks.aws_differential import references as R
from benchmarks.aws_differential.__main__ import CASES

REPO = Path(__file__).resolve().parents[1]

OWN_KERNELS = '''
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def add(a, b):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    x = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
    y = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)
    nisa.dma_copy(dst=y, src=b)
    nisa.tensor_tensor(dst=x, data1=x, data2=y, op=nl.add)
    nisa.dma_copy(dst=out, src=x)
    return out


@nki.jit
def add_on_scalar_engine_max(a, b):
    x = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)
    nisa.tensor_scalar(dst=x, data=x, op0=nl.maximum, operand0=0.0, engine=nisa.engine.scalar)
    return a


@nki.jit
def uses_a_name_nki_lacks(a, b):
    return nl.no_such_function(a)
'''


def _case(cid, kernel, legal=True, path="k.py"):
    def make(_module, rng):
        return (rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)), {}

    return C.Case(cid, C.SDK, path, kernel, make, lambda outs, args, kw: R.bit_exact(outs[0], args[0] + args[1]), legal=legal)


def test_verdicts(tmp_path):
    folder = tmp_path / "aws-neuron-sdk@81ce03a"
    folder.mkdir()
    (folder / "k.py").write_text(OWN_KERNELS)
    assert C.run(_case("exact", "add"), tmp_path)["verdict"] == "exact"
    wrong = C.Case("wrong", C.SDK, "k.py", "add", _case("w", "add").make,
                   lambda outs, args, kw: R.bit_exact(outs[0], args[0] - args[1]))
    assert C.run(wrong, tmp_path)["verdict"] == "wrong"
    legal = C.run(_case("legal", "add_on_scalar_engine_max", legal=True), tmp_path)
    assert legal["verdict"] == "refused, legal per docs" and "VE-TS-SCALARE" in legal["detail"]
    assert C.run(_case("illegal", "add_on_scalar_engine_max", legal=False), tmp_path)["verdict"] == "refused (illegal per docs)"
    gap = C.run(_case("gap", "uses_a_name_nki_lacks"), tmp_path)
    assert gap["verdict"] == "unsupported" and "no_such_function" in gap["detail"]
    assert C.run(_case("missing", "add", path="absent.py"), tmp_path)["verdict"] == "missing"


def test_the_nki_modules_are_mapped_only_while_a_case_runs():
    import sys

    before = {name: sys.modules.get(name) for name in loader.NKI_MODULES}
    with loader.nki_mapped():
        import nki.language as nl  # noqa: F401  (resolved to the interpreter)

        assert sys.modules["nki.isa"].__name__ == "vllm_moe_w8.kernels.nki_cpu.isa"
    assert {name: sys.modules.get(name) for name in loader.NKI_MODULES} == before


def test_doc_examples_are_the_code_blocks_of_docstrings(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text('def api():\n    r"""Text.\n\n    .. code-block:: python\n\n        @nki.jit\n        def example(a):\n'
                    '            return a\n\n    :param a: after the block"""\n')
    blocks = loader.doc_blocks(stub)
    assert blocks == ["@nki.jit\ndef example(a):\n    return a\n"]
    with loader.nki_mapped():
        module = loader.load_doc_example(stub, "example", "stub_example")
    assert module.example.__name__ == "example"


def test_the_matmul_bound_refuses_the_accumulate_default_bug():
    """The fault the issue found: accumulate=None overwriting on every call leaves the last K tile only (~70 % of the
    output's magnitude off); the tutorial cases' bound refuses it while the correct fp32-accumulated result passes."""
    rng = np.random.default_rng(0)
    a, b = rng.random((512, 64)).astype(np.float32), rng.random((512, 128)).astype(np.float32)
    ref, mag = R.matmul_t(a, b)
    right = (a.T @ b).astype(np.float32)
    overwritten = (a[384:].T @ b[384:]).astype(np.float32)
    bound = R.matmul_bound(mag, 512, np.float32, ref)
    assert R.within(right, ref, bound)[0]
    ok, worst, _ = R.within(overwritten, ref, bound)
    assert not ok and worst > 1e4


def test_the_pinned_list_is_the_one_developing_md_publishes():
    text = (REPO / "DEVELOPING.md").read_text()
    section = text[text.index("## AWS kernels as the interpreter's acceptance test"):]
    section = section[:section.index("\n## ", 10)]
    for c in CASES:
        row = next((line for line in section.splitlines() if line.startswith(f"| {c.repo} | {c.commit} |")), None)
        assert row is not None, f"{c.id}: {c.repo} @ {c.commit} is not in DEVELOPING.md's table"
        assert c.path.split("/")[-1] in row or (c.load.startswith("package:") and c.source_root in row), \
            f"{c.id}: {c.path} is not named in DEVELOPING.md's row for {c.repo}"
        if not c.load.startswith("package:"):
            assert re.search(rf"`{re.escape(c.kernel)}`", row), f"{c.id}: kernel {c.kernel} missing from DEVELOPING.md"


AWS_SOURCES = os.environ.get("VLLM_MOE_W8_AWS_SOURCES")  # the harness's local folder; unset: skipped (no AWS code here)


@pytest.mark.slow
@pytest.mark.skipif(not AWS_SOURCES, reason="set VLLM_MOE_W8_AWS_SOURCES to the harness's local folder of AWS sources")
def test_the_fork_fused_kernel_executed_counts_what_its_restatement_counts(monkeypatch):
    """bench_glm_kernels --fork-folder prices the fork's moe_fused_fp8_kernel executed; its restatement
    (glm_dataflows.fused_fp8), used without the folder, must count the same (the executed one wins)."""
    from benchmarks import bench_glm_kernels as G
    from vllm_moe_w8.kernels.nki_cpu import glm_dataflows

    monkeypatch.setattr(G, "FORK_FOLDER", [Path(AWS_SOURCES)])
    for routed in ([1], [3, 1, 2], [8] * 9, [130, 5]):
        restated = glm_dataflows.fused_fp8(routed, 4096, 2048, 2, True, [])
        assert G.same_counters(G.executed_fused(routed, 4096, 2048, 2), restated)
