"""Kernels of aws-neuron/aws-neuron-sdk @81ce03ae: the NKI tutorials' kernels (``nki/examples``) and the kernels in
the code examples of the API reference (``nki/api/nki/isa/__init__.py``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import references as R
from .case import SDK, Case

BF16 = ml_dtypes.bfloat16
ISA_DOC = "nki/api/nki/isa/__init__.py"
MATMUL = "nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py"


def _bf16(rng, shape):
    return rng.random(shape).astype(np.float32).astype(BF16)


def _matmul_case(cid, kernel, k, m, n, bound_k=None):
    def make(_module, rng):
        return (_bf16(rng, (k, m)), _bf16(rng, (k, n))), {}

    def check(outs, args, _kw):
        ref, mag = R.matmul_t(*args)
        return R.within(outs[0], ref, R.matmul_bound(mag, bound_k or k, BF16, ref))

    return Case(cid, SDK, MATMUL, kernel, make, check, bound="fp32 accumulation (K 2^-24 sum|a||b|) + bf16 output rounding")


def _tensor_add():
    def make(_m, rng):
        a = rng.standard_normal((256, 1024)).astype(np.float32)
        return (a, rng.standard_normal((256, 1024)).astype(np.float32)), {}

    return Case("sdk-tensor-add", SDK, "nki/examples/tensor_addition/tensor_addition_nki_kernels.py", "nki_tensor_add",
                make, lambda outs, args, kw: R.bit_exact(outs[0], args[0] + args[1]))


def _transpose2d():
    def make(_m, _rng):
        return (np.arange(5 * 12, dtype=np.int8).reshape(5, 12), (3, 4)), {}

    return Case("sdk-transpose2d", SDK, "nki/examples/transpose2d/transpose2d_nki_kernels.py", "tensor_transpose2D_kernel_",
                make, lambda outs, args, kw: R.bit_exact(outs[0], R.transpose2d(*args)))


def _avgpool():
    def make(_m, _rng):
        return (np.arange(2 * 6 * 6, dtype=np.float16).reshape(2, 6, 6), 2), {}

    def check(outs, args, _kw):
        ref = R.avgpool2d(*args)
        return R.within(outs[0], ref, 2 * R.U["float16"] * np.abs(ref))

    return Case("sdk-avgpool2d", SDK, "nki/examples/average_pool2d/average_pool2d_nki_kernels.py", "tensor_avgpool_kernel",
                make, check, bound="fp32 sum, 2 fp16 roundings (the sum tile and the output)")


def _mamba(version):
    def make(_m, rng):
        b, c, s, n = 1, 256, 512, 4
        delta = (rng.random((b, c, s)) * 0.1).astype(np.float32)
        u = rng.standard_normal((b, c, s)).astype(np.float32)
        a = -rng.random((c, n)).astype(np.float32)
        return (delta, u, a, rng.standard_normal((b, n, s)).astype(np.float32),
                rng.standard_normal((b, n, s)).astype(np.float32)), {}

    def check(outs, args, _kw):
        ref, mag = R.mamba(*args)
        # fp32 throughout: exp (ScalarE, an approximation on hardware: none modelled here), the scan's seq_len-long
        # recurrence and the state sum each round at 2^-24 per step; 4 * seq_len steps of margin
        return R.within(outs[0], ref, 4 * 512 * R.U["float32"] * (mag + np.abs(ref)))

    return Case(f"sdk-mamba-{version}", SDK, "nki/examples/fused_mamba/mamba_nki_kernels.py", f"mamba_{version}", make, check,
                bound="fp32: 4 x seq_len roundings of 2^-24 on sum|C||scan|")


def _doc_matmul_accumulate():
    def make(_m, rng):
        return (_bf16(rng, (512, 128)), _bf16(rng, (512, 512))), {}

    def check(outs, args, _kw):
        ref, mag = R.matmul_t(*args)
        return R.within(outs[0], ref, R.matmul_bound(mag, 512, np.float32, ref))

    return Case("doc-nc-matmul-accumulate", SDK, ISA_DOC, "nc_matmul_accumulate_kernel", make, check, load="doc",
                bound="fp32 accumulation + fp32 output")


def _doc_gather():
    def make(_m, rng):
        data = rng.standard_normal((300, 64)).astype(np.float32)
        return (data, rng.permutation(300)[:128].astype(np.uint32).reshape(128, 1)), {}

    return Case("doc-dma-indirect-gather", SDK, ISA_DOC, "indirect_gather_kernel", make,
                lambda outs, args, kw: R.bit_exact(outs[0], args[0][args[1][:, 0]]), load="doc")


def _doc_scatter():
    def make(_m, rng):
        src = rng.standard_normal((128, 64)).astype(np.float32)
        idx = rng.permutation(300)[:128].astype(np.uint32).reshape(128, 1)
        return (src, idx, rng.standard_normal((300, 64)).astype(np.float32)), {}

    def check(outs, args, _kw):
        src, idx, before = args
        ref = before.copy()
        ref[idx[:, 0]] = src
        return R.bit_exact(outs[0], ref)

    return Case("doc-dma-indirect-scatter", SDK, ISA_DOC, "indirect_scatter_kernel", make, check, load="doc")


def _doc_nonzero():
    def make(_m, rng):
        return ((rng.random((128, 16)) < 0.4).astype(np.float32) * rng.standard_normal((128, 16)).astype(np.float32),), {}

    def check(outs, args, _kw):
        ref, mask = R.nonzero_with_count(args[0])
        return R.bit_exact(outs[0], ref, mask=mask)

    return Case("doc-nonzero-with-count", SDK, ISA_DOC, "nonzero_with_count_kernel", make, check, load="doc",
                bound="bit-exact on partitions 0, 16, ..., 112 (the only ones the instruction writes)")


def _doc_activate2():
    def make(_m, rng):
        return (rng.standard_normal((128, 64)).astype(np.float32),), {}

    return Case("doc-activate2", SDK, ISA_DOC, "activate2_scale_bias_kernel", make,
                lambda outs, args, kw: R.within(outs[0], R.gelu(2 * R.f64(args[0]) + 0.5), 1e-6), load="doc", legal=False,
                why="nki.isa.activate2: 'Available only on NeuronCore-v4 and newer' (Trn2 is NeuronCore-v3)")


CASES = [
    _tensor_add(),
    _matmul_case("sdk-matmul-basic", "nki_matmul_basic_", 128, 64, 512),
    _matmul_case("sdk-matmul-tiled", "nki_matmul_tiled_", 512, 256, 1024),
    _matmul_case("sdk-matmul-hoist-load", "nki_matmul_hoist_load_", 512, 256, 1024),
    _matmul_case("sdk-matmul-block-free", "nki_matmul_block_free_dimension_", 512, 256, 1024),
    _matmul_case("sdk-matmul-fully-optimized", "nki_matmul_fully_optimized_", 1024, 2048, 1024),
    _transpose2d(),
    _avgpool(),
    _mamba("v1"),
    _mamba("v2"),
    _mamba("v3"),
    _doc_matmul_accumulate(),
    _doc_gather(),
    _doc_scatter(),
    _doc_nonzero(),
    _doc_activate2(),
]
