"""The interpreter's rules that a kernel can break with one argument or one Python construct: each test runs a
legal kernel, then the same kernel changed in exactly one place, and the interpreter must refuse only the second.

Rules checked elsewhere (shapes, dtypes, capacity, never-written memory): tests/test_nki_interpreter.py."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_moe_w8.kernels.nki_cpu import NkiValidationError, jit, run
from vllm_moe_w8.kernels.nki_cpu import isa as nisa
from vllm_moe_w8.kernels.nki_cpu import language as nl

NONE = np.zeros(1, np.float32)  # an unused kernel argument


def around(instruction):
    """A legal kernel that sets up initialised tiles and calls ``instruction(a, b, col, st, mv, ps, pt)``:
    a, b [128, 512] fp32 SBUF; col [128, 1] fp32; st [128, 128] / mv [128, 512] bf16 matmul operands;
    ps [128, 1024] fp32 PSUM (two banks); pt [128, 2048] bf16 PSUM (two banks)."""

    @jit
    def kernel(x, y):
        a = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        col = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        st = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
        mv = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=a, value=1.0)
        nisa.memset(dst=b, value=2.0)
        nisa.memset(dst=col, value=0.5)
        nisa.memset(dst=st, value=1.0)
        nisa.memset(dst=mv, value=1.0)
        ps = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.psum)
        pt = nl.ndarray((128, 2048), dtype=nl.bfloat16, buffer=nl.psum)
        instruction(a, b, col, st, mv, ps, pt)
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)
        return out

    return kernel


def legal_then_refused(legal, broken, match, error=NkiValidationError):
    run(around(legal), NONE, NONE)
    with pytest.raises(error, match=match):
        run(around(broken), NONE, NONE)


def matmul(**extra):
    return lambda a, b, col, st, mv, ps, pt: nisa.nc_matmul(dst=ps[:, 0:512], stationary=st, moving=mv, accumulate=False, **extra)


# --- arguments outside the documented signatures are errors; documented ones are modelled (tests/test_nki_doc_rules*.py)

def test_dma_copy_refuses_an_unknown_oob_mode():
    """oob_mode is modelled (error / skip, tests/test_nki_dynamic_rules.py); any other value is refused."""
    legal_then_refused(_copy(oob_mode=nisa.oob_mode.error), _copy(oob_mode=nl.add), "oob_mode=.*use nisa.oob_mode")


def _copy(**extra):
    return lambda a, b, col, st, mv, ps, pt: nisa.dma_copy(dst=a, src=b, **extra)


def test_arguments_outside_the_documented_signature_are_errors():
    """dst_rmw_op is not a dma_copy argument in the API reference @81ce03ae: a TypeError, not silently ignored."""
    legal_then_refused(_copy(), _copy(dst_rmw_op=nl.add), "unexpected keyword argument 'dst_rmw_op'", error=TypeError)


def test_a_misspelt_argument_is_an_error():
    legal_then_refused(lambda a, b, col, st, mv, ps, pt: nisa.tensor_copy(dst=a, src=b, engine=nisa.engine.vector),
                       lambda a, b, col, st, mv, ps, pt: nisa.tensor_copy(dst=a, src=b, engin=nisa.engine.vector),
                       "unexpected keyword argument 'engin'", error=TypeError)


def test_jit_refuses_compiler_options_other_than_mode():
    assert jit()(lambda: None) is not None  # bare @jit() is fine
    assert jit(mode="simulation")(lambda: None) is not None  # mode changes nothing here: the kernel is executed
    with pytest.raises(NkiValidationError, match="nki.jit options \\['platform_target'\\] are not implemented"):
        jit(platform_target="trn2")


# --- operator legality on every path (reverse or not) -----------------------------------------------------

@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("slot", ["op0", "op1"])
def test_tensor_scalar_refuses_non_arithmetic_operators(slot, reverse):
    def ts(op0, op1):
        return lambda a, b, col, st, mv, ps, pt: nisa.tensor_scalar(
            dst=a, data=b, op0=op0, operand0=col, reverse0=reverse, op1=op1, operand1=2.0, reverse1=reverse)

    good = ts(nl.multiply, nl.add)
    bad = ts(nl.exp, nl.add) if slot == "op0" else ts(nl.multiply, nl.silu)
    legal_then_refused(good, bad, f"tensor_scalar {slot} nl\\.(exp|silu) is not an operator this instruction takes")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("slot", ["op0", "op1"])
def test_scalar_tensor_tensor_refuses_non_arithmetic_operators(slot, reverse):
    def stt(op0, op1):
        return lambda a, b, col, st, mv, ps, pt: nisa.scalar_tensor_tensor(
            dst=a, data=b, op0=op0, operand0=col, op1=op1, operand1=b, reverse0=reverse, reverse1=reverse)

    good = stt(nl.multiply, nl.add)
    bad = stt(nl.relu, nl.add) if slot == "op0" else stt(nl.multiply, nl.exp)
    legal_then_refused(good, bad, f"scalar_tensor_tensor {slot} nl\\.(relu|exp) is not an operator this instruction takes")


def test_tensor_scalar_op1_and_operand1_come_together():
    legal_then_refused(lambda a, b, col, st, mv, ps, pt: nisa.tensor_scalar(dst=a, data=b, op0=nl.add, operand0=1.0),
                       lambda a, b, col, st, mv, ps, pt: nisa.tensor_scalar(dst=a, data=b, op0=nl.add, operand0=1.0, op1=nl.add),
                       "op1 and operand1 must be given together")


def test_tensor_scalar_never_on_gpsimd():
    def ts(engine):
        return lambda a, b, col, st, mv, ps, pt: nisa.tensor_scalar(dst=a, data=b, op0=nl.multiply, operand0=col, engine=engine)

    run(around(ts(nisa.engine.scalar)), NONE, NONE)
    legal_then_refused(ts(nisa.engine.vector), ts(nisa.engine.gpsimd), "GpSimdE for tensor_scalar only for rsqrt")


# --- one PSUM bank per matmul / transpose result (reached: the moving size is legal) --------------------------

def test_matmul_result_must_lie_in_one_psum_bank():
    def mm(lo):
        return lambda a, b, col, st, mv, ps, pt: nisa.nc_matmul(dst=ps[:, lo:lo + 512], stationary=st, moving=mv, accumulate=False)

    run(around(mm(512)), NONE, NONE)  # the second bank exactly
    legal_then_refused(mm(0), mm(256), r"nc_matmul dst .*\(2048 B/partition at offset 1024\) must lie within one 2 KiB PSUM bank")


def test_transpose_result_must_lie_in_one_psum_bank():
    def tr(lo):
        return lambda a, b, col, st, mv, ps, pt: nisa.nc_transpose(dst=pt[:, lo:lo + 128], data=st)

    legal_then_refused(tr(1024), tr(960), "nc_transpose dst .* must lie within one 2 KiB PSUM bank")


# --- the traced-kernel Python subset ---------------------------------------------------------------------

def _kernel_with(construct: str):
    """A legal kernel, or the same kernel with one construct outside the traced subset."""

    @jit
    def plain(x, y):
        t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.0)
        out = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        assert t.shape == (128, 4)  # assert is part of the subset
        return out

    @jit
    def with_lambda(x, y):
        width = lambda: 4  # noqa: E731
        t = nl.ndarray((128, width()), dtype=nl.float32, buffer=nl.sbuf)
        return t

    @jit
    def with_raise(x, y):
        if x.shape[0] > 1:
            raise ValueError("shape")
        return None

    @jit
    def with_int_dict_key(x, y):
        sizes = {"T": 4, 0: 4}
        return sizes

    @jit
    def with_try(x, y):
        try:
            return None
        finally:
            pass

    @jit
    def with_nested_def(x, y):
        def helper():
            return 4
        return helper

    @jit
    def with_bad_helper(x, y):
        return _helper_that_raises(x)

    return locals()[construct]


def _helper_that_raises(x):
    if x.shape[0] > 1:
        raise ValueError("shape")
    return None


@pytest.mark.parametrize("construct, match", [
    ("with_lambda", "uses a lambda"),
    ("with_raise", "uses a raise statement"),
    ("with_int_dict_key", "uses a dictionary key 0 that is not a string"),
    ("with_try", "uses a try block"),
    ("with_nested_def", "uses a nested function"),
    ("with_bad_helper", "_helper_that_raises .called from kernel .*with_bad_helper. uses a raise statement"),
])
def test_traced_subset_is_enforced(construct, match):
    out, _ = run(_kernel_with("plain"), NONE, NONE)
    np.testing.assert_array_equal(out, np.ones((128, 4), np.float32))
    with pytest.raises(NkiValidationError, match=match):
        run(_kernel_with(construct), NONE, NONE)


def test_the_project_kernels_pass_the_subset_check():
    from vllm_moe_w8.kernels.moe_w8 import moe_w8_output_block, moe_w8_pow2
    from vllm_moe_w8.kernels.moe_w8_blocks import moe_w8_blocks_output_block, moe_w8_blocks_pow2
    from vllm_moe_w8.kernels.moe_w8_grouped import moe_w8_grouped_output_block, moe_w8_grouped_pow2
    from vllm_moe_w8.kernels.nki_cpu.subset import check_traced_subset

    for kernel in (moe_w8_pow2, moe_w8_output_block, moe_w8_grouped_pow2, moe_w8_grouped_output_block,
                   moe_w8_blocks_pow2, moe_w8_blocks_output_block):
        check_traced_subset(kernel.fn)  # raises on the first construct outside the subset


def _sibling_helper():
    return (lambda: 0)()


def _kernel_calling_sibling():
    _sibling_helper()


def test_the_subset_check_follows_helpers_of_sibling_kernel_modules(monkeypatch):
    """A helper imported from another module of the kernels package (kernels/projections.py) is traced too."""
    from vllm_moe_w8.kernels.nki_cpu.subset import check_traced_subset

    monkeypatch.setattr(_kernel_calling_sibling, "__module__", "vllm_moe_w8.kernels.moe_w8_blocks")
    monkeypatch.setattr(_sibling_helper, "__module__", "vllm_moe_w8.kernels.nki_api")
    check_traced_subset(_kernel_calling_sibling)  # the NKI binding and other packages are not traced helpers
    monkeypatch.setattr(_sibling_helper, "__module__", "vllm_moe_w8.kernels.projections")
    with pytest.raises(NkiValidationError, match="_sibling_helper .*called from kernel.* uses a lambda"):
        check_traced_subset(_kernel_calling_sibling)


def test_tensor_tensor_and_activation_refuse_operators_of_the_other_kind():
    legal_then_refused(lambda a, b, col, st, mv, ps, pt: nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.maximum),
                       lambda a, b, col, st, mv, ps, pt: nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.exp),
                       "op nl.exp is not an operator this instruction takes")
    legal_then_refused(lambda a, b, col, st, mv, ps, pt: nisa.activation(dst=a, op=nl.exp, data=b),
                       lambda a, b, col, st, mv, ps, pt: nisa.activation(dst=a, op=nl.add, data=b),
                       "activation op nl.add is not an activation function")
