"""nki-library's BF16 dense kernels (the QKV and output projections), executed unmodified in the interpreter as the
BF16 side of ``benchmarks/bench_linear.py``.

nki-library @d2ad3a57 (``benchmarks/aws_differential/case.LIBRARY``) is imported from a local folder with only the NKI
module paths mapped (``aws_differential.loader``), as ``bench_aws_moe`` does. ``output_projection_tkg`` /
``output_projection_cte`` are ``@nki.jit`` kernels launched as they are. The QKV kernels are entered one level down:
``qkv.qkv`` is decorated ``@nki.jit(mode="auto", debug_kernel=True, show_compiler_tb=True, experimental_flags=...)``,
compiler options the interpreter does not implement (rule JIT-OPTIONS), so :func:`qkv_tkg_entry` /
:func:`qkv_cte_entry` (our ``@nki.jit`` wrappers, nothing else in them) call ``qkv_tkg.qkv_tkg`` / ``qkv_cte.qkv_cte``
as ``qkv.qkv`` would for these inputs: no fused residual add or norm, no bias, BSD output; ``qkv_tkg`` for S <= 96 and
B * S <= 128, ``qkv_cte`` beyond (qkv.py's own dispatch rule).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import ml_dtypes
import numpy as np

from benchmarks.aws_differential import loader
from benchmarks.aws_differential.case import LIBRARY
from vllm_moe_w8.kernels.nki_cpu import jit

PKG = "nkilib_src.nkilib.core"
QKV_TKG_PATH = "src/nkilib_src/nkilib/core/qkv/qkv_tkg.py"
SEQLEN_THRESHOLD_FOR_QKV_CTE = 96  # nki-library qkv.py: qkv_cte for S above this (or B * S > 128)
BF16 = ml_dtypes.bfloat16
HEAD = 128  # output_projection_*: D <= 128, so K is passed as K/128 heads of 128 (the same [K, N] matmul)

_impl: dict = {}


@jit
def qkv_tkg_entry(hidden, qkv_w):
    return _impl["qkv_tkg"](hidden, qkv_w, norm_type=_impl["no_norm"])


@jit
def qkv_cte_entry(hidden, qkv_w):
    return _impl["qkv_cte"](hidden, qkv_w, fused_norm_type=_impl["no_norm"])


def load(folder: Path) -> dict:
    """The kernels (call inside ``loader.nki_mapped()``): {"qkv_tkg", "qkv_cte", "out_tkg", "out_cte"}."""
    path = loader.source_path(folder, LIBRARY[0], LIBRARY[1], QKV_TKG_PATH)
    root = Path(str(path)[: -len(QKV_TKG_PATH)]) / "src"
    tkg = loader.load_package(root, f"{PKG}.qkv.qkv_tkg")
    cte = importlib.import_module(f"{PKG}.qkv.qkv_cte")
    types = importlib.import_module(f"{PKG}.utils.common_types")
    out_tkg = importlib.import_module(f"{PKG}.output_projection.output_projection_tkg")
    out_cte = importlib.import_module(f"{PKG}.output_projection.output_projection_cte.output_projection_cte")
    _impl.update(qkv_tkg=tkg.qkv_tkg, qkv_cte=cte.qkv_cte, no_norm=types.NormType.NO_NORM)
    return {"qkv_tkg": qkv_tkg_entry, "qkv_cte": qkv_cte_entry, "out_tkg": out_tkg.output_projection_tkg,
            "out_cte": out_cte.output_projection_cte}


def qkv_kernel(tokens: int) -> str:
    return "qkv_tkg" if tokens <= SEQLEN_THRESHOLD_FOR_QKV_CTE and tokens <= 128 else "qkv_cte"


def out_kernel(tokens: int) -> str:
    """output_projection_tkg takes B * S <= 128 (its docstring); the CTE kernel beyond."""
    return "out_tkg" if tokens <= 128 else "out_cte"


def call(kernels: dict, role: str, x: np.ndarray, w_t: np.ndarray) -> tuple[str, tuple, dict]:
    """(kernel name, positional args, keyword args) of one BF16 projection ``x [T, K] @ w_t [K, N]``: ``role`` is
    "fused" (q+k+v, in_proj_qkv+z: the QKV kernel) or "out" (o_proj, out_proj: the output projection kernel)."""
    t, k = x.shape
    if role == "fused":
        name = qkv_kernel(t)
        return name, (x.reshape(1, t, k), w_t), {}
    name = out_kernel(t)
    heads = k // HEAD
    att = x.reshape(1, t, heads, HEAD)
    att = att.transpose(3, 0, 2, 1) if name == "out_tkg" else att.transpose(0, 2, 3, 1)  # [D,B,N,S] / [B,N,D,S]
    return name, (np.ascontiguousarray(att), w_t), {}
