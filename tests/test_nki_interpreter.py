"""The CPU NKI interpreter: each Trn2 rule it enforces rejects a kernel that breaks it, correct kernels
compute what numpy / ml_dtypes say, and the counters and cost model see what a kernel does."""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from vllm_moe_w8.kernels import nki_api
from vllm_moe_w8.kernels.nki_cpu import NkiValidationError, cost, run
from vllm_moe_w8.kernels.nki_cpu import isa as nisa
from vllm_moe_w8.kernels.nki_cpu import language as nl
from vllm_moe_w8.kernels.nki_cpu import jit

rng = np.random.default_rng(0)
NONE = np.zeros(1, np.float32)  # an unused kernel argument


def bf16(shape):
    return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)


def fp8_codes(shape):
    """Random finite Trn2 float8_e4m3 bytes (magnitude codes < 0x78)."""
    mag = rng.integers(0, 0x78, size=shape, dtype=np.uint8)
    return mag | (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)


def matmul_kernel(st_dtype=nl.bfloat16, mv_dtype=nl.bfloat16, k=128, m=128, n=512, dst_buffer=nl.psum,
                  dst_dtype=nl.float32, first_accumulate=False):
    @jit
    def kernel(a, b):
        sa = nl.ndarray((k, m), dtype=st_dtype, buffer=nl.sbuf)
        sb = nl.ndarray((k, n), dtype=mv_dtype, buffer=nl.sbuf)
        nisa.memset(dst=sa, value=1.0)
        nisa.memset(dst=sb, value=1.0)
        rows = min(m, 128)  # an over-wide stationary must be caught by nc_matmul, not by this allocation
        ps = nl.ndarray((rows, n), dtype=dst_dtype, buffer=dst_buffer)
        nisa.nc_matmul(dst=ps, stationary=sa, moving=sb, accumulate=first_accumulate)
        out = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.shared_hbm)
        res = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=ps)
        nisa.dma_copy(dst=out, src=res)
        return out

    return kernel


def test_fp8_matmul_with_psum_accumulation_matches_numpy():
    """bf16 stationary x fp8 (uint8 codes viewed in SBUF) moving, K = 256 in two accumulating matmuls."""
    hidden_t = bf16((256, 64))
    codes = fp8_codes((256, 512))

    @jit
    def kernel(x_t, w):
        acc = nl.ndarray((64, 512), dtype=nl.float32, buffer=nl.psum)
        for k in range(2):
            xs = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
            ws = nl.ndarray((128, 512), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.dma_copy(dst=xs, src=x_t[k * 128:(k + 1) * 128, :])
            nisa.dma_copy(dst=ws, src=w[k * 128:(k + 1) * 128, :])
            nisa.nc_matmul(dst=acc, stationary=xs, moving=ws.view(nl.float8_e4m3), accumulate=(k > 0))
        res = nl.ndarray((64, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        out = nl.ndarray((64, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=res)
        return out

    out, stats = run(kernel, hidden_t, codes)
    x, w = hidden_t.astype(np.float64), codes.view(ml_dtypes.float8_e4m3).astype(np.float64)
    expect, magnitude = x.T @ w, np.abs(x).T @ np.abs(w)
    # bf16 x fp8 products are exact in fp32; summing K = 256 of them in fp32 errs by <= K * 2**-24 of their magnitudes
    assert (np.abs(out - expect) <= 256 * 2.0**-24 * magnitude).all()
    assert stats.matmuls[(128, 64, 512, "bfloat16", "float8_e4m3")] == 2
    assert stats.hbm_read_bytes == hidden_t.nbytes + codes.nbytes
    assert stats.hbm_write_bytes == out.nbytes
    assert stats.peak_psum_banks == 1


def test_engine_instructions_compute_in_fp32_and_cast():
    data = rng.standard_normal((128, 256)).astype(np.float32)
    scale = rng.standard_normal((128, 1)).astype(np.float32)

    @jit
    def kernel(x, s):
        xs = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.sbuf)
        ss = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs, src=x)
        nisa.dma_copy(dst=ss, src=s)
        act = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=act, op=nl.silu, data=xs, scale=ss)
        fused = nl.ndarray((128, 256), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=fused, data=xs, op0=nl.multiply, operand0=ss, op1=nl.add, operand1=act)
        o1 = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((128, 256), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o1, src=act)
        nisa.dma_copy(dst=o2, src=fused)
        return o1, o2

    (o1, o2), stats = run(kernel, data, scale)
    z = data * scale
    silu = z / (1 + np.exp(-z))
    np.testing.assert_allclose(o1, silu, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(o2, (z + silu).astype(ml_dtypes.bfloat16))
    assert stats.engine_ops[("scalar", "activation", 128, 256)] == 1
    assert stats.engine_ops[("vector", "scalar_tensor_tensor", 128, 256)] == 1


# --- each Trn2 rule rejects a kernel that breaks it ----------------------------------------------------

def _expect(kernel, match, *args):
    with pytest.raises(NkiValidationError, match=match):
        run(kernel, *(args or (np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))))


def test_rejects_partition_dim_over_128():
    @jit
    def kernel(a, b):
        nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)

    _expect(kernel, "partition dim")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(m=129), "stationary free size 129 > 128"),
        (dict(n=513), "moving free size 513 > 512"),
        (dict(dst_buffer=nl.sbuf), "must be in psum"),
        (dict(dst_dtype=nl.bfloat16), "float32 on NeuronCore-v3"),
        (dict(st_dtype=nl.float8_e4m3fn), "float8_e4m3fn.*Trn3"),
        (dict(mv_dtype=nl.float8_e4m3fn), "float8_e4m3fn.*Trn3"),
        (dict(st_dtype=nl.float32), "pair only with float32/tfloat32"),
        (dict(first_accumulate=True), "no initialising matmul"),
    ],
)
def test_rejects_illegal_matmuls(kwargs, match):
    _expect(matmul_kernel(**kwargs), match)


def test_accepts_legal_mixed_and_fp32_matmuls():
    for st, mv in ((nl.bfloat16, nl.float8_e4m3), (nl.float8_e5m2, nl.bfloat16), (nl.float32, nl.float32)):
        out, _ = run(matmul_kernel(st_dtype=st, mv_dtype=mv, k=64, m=32, n=16), NONE, NONE)
        np.testing.assert_array_equal(out, np.full((32, 16), 64.0, np.float32))


def test_rejects_unequal_partition_sizes():
    @jit
    def kernel(a, b):
        sa = nl.ndarray((64, 32), dtype=nl.bfloat16, buffer=nl.sbuf)
        sb = nl.ndarray((128, 32), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=sa, value=0.0)
        nisa.memset(dst=sb, value=0.0)
        ps = nl.ndarray((32, 32), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=sa, moving=sb, accumulate=False)

    _expect(kernel, "contraction .partition. sizes differ")


def test_transpose_keeps_the_dtype_and_is_exact():
    data = bf16((64, 128))

    def make(dst_dtype):
        @jit
        def kernel(x):
            t = nl.ndarray((64, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            ps = nl.ndarray((128, 64), dtype=dst_dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=ps, data=t)
            res = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=ps)
            out = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=res)
            return out

        return kernel

    out, stats = run(make(nl.bfloat16), data)
    np.testing.assert_array_equal(out, data.T)
    assert stats.transposes[(64, 128, "bfloat16")] == 1
    _expect(make(nl.float32), "must have the input's data type", data)


def test_rejects_psum_over_eight_banks():
    @jit
    def kernel(a, b):
        tiles = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(8)]  # 8 x 2 KiB: full
        extra = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.psum)
        for t in tiles + [extra]:
            nisa.memset(dst=t, value=0.0)  # all nine in use together
        for t in tiles:
            nisa.tensor_copy(dst=t, src=t)

    _expect(kernel, "PSUM overflow")


def test_rejects_sbuf_over_224_kib_per_partition_and_frees_dead_tiles():
    @jit
    def fits(a, b):
        for _ in range(4):  # each 100 KiB tile is dead after its last use: the compiler reuses its bytes
            t = nl.ndarray((128, 100 * 1024), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.memset(dst=t, value=0)
        return None

    _, stats = run(fits, NONE, NONE)
    assert stats.peak_sbuf_bytes == 100 * 1024

    @jit
    def overflows(a, b):
        keep = nl.ndarray((128, 200 * 1024), dtype=nl.uint8, buffer=nl.sbuf)
        more = nl.ndarray((128, 25 * 1024), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=keep, value=0)
        nisa.memset(dst=more, value=0)
        nisa.tensor_copy(dst=keep, src=keep)

    _expect(overflows, "SBUF overflow")


def test_dma_reinterprets_with_view_and_converts_between_dtypes():
    """Same bytes through .view (bit-exact), different dtypes converted through float32 (DMA-CONVERT): uint8 codes
    copied into a float8_e4m3 tile become the float8 value of each code's integer, not the code's bits."""
    codes = fp8_codes((128, 64))

    def make(view):
        @jit
        def kernel(w):
            t = nl.ndarray((128, 64), dtype=nl.float8_e4m3, buffer=nl.sbuf)
            nisa.dma_copy(dst=t.view(nl.uint8) if view else t, src=w)
            out = nl.ndarray((128, 64), dtype=nl.uint8, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=t.view(nl.uint8))
            return out

        return kernel

    out, _ = run(make(True), codes)
    np.testing.assert_array_equal(out, codes)
    converted, _ = run(make(False), codes)
    want = codes.astype(np.float32).astype(ml_dtypes.float8_e4m3).view(np.uint8)
    np.testing.assert_array_equal(converted, want)


def test_computing_on_never_written_memory_reads_the_simulators_sentinels():
    """MEM-UNWRITTEN: garbage is legal on the device; an instruction reading never-written elements gets AWS's
    simulator sentinels (NaN for floats, 4 for integers), so they show in the result, and Stats counts them."""
    @jit
    def kernel(a, b):
        t = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t[:, 0:4], value=1.0)
        i = nl.ndarray((128, 8), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=i[:, 0:4], value=7)
        u = nl.ndarray((128, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u[:, 0:8], src=t)
        nisa.tensor_copy(dst=u[:, 8:16], src=i)
        out = nl.ndarray((128, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=u)
        return out

    out, stats = run(kernel, NONE, NONE)
    assert (out[:, 0:4] == 1.0).all() and np.isnan(out[:, 4:8]).all()
    assert (out[:, 8:12] == 7.0).all() and (out[:, 12:16] == 4.0).all()
    assert stats.unwritten_reads == 2 * 128 * 4


def test_a_kernel_outputs_never_written_elements_as_garbage():
    """Uninitialised device memory is garbage: a returned HBM output's never-written elements are bytes 0xFF (NaN in
    every float dtype), so a host step that reads them unmasked computes NaN (routing.combine's masks)."""
    @jit
    def half_written(a, b):
        out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.5)
        nisa.dma_copy(dst=out[0:2, :], src=t)
        return out

    out, _ = run(half_written, None, None)
    assert np.array_equal(out[0:2], np.full((2, 4), 1.5, np.float32)) and np.isnan(out[2:]).all()


def test_rejects_two_psum_inputs_and_out_of_bounds_slices():
    @jit
    def kernel(a, b):
        p1 = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        p2 = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=p1, value=0.0)
        nisa.memset(dst=p2, value=0.0)
        nisa.tensor_tensor(dst=p1, data1=p1, data2=p2, op=nl.add)

    _expect(kernel, "both in PSUM")

    @jit
    def oob(a, b):
        t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        return t[:, 2:6]

    _expect(oob, "out of bounds")


# --- counters and cost model ----------------------------------------------------------------------------

def test_cost_model_charges_each_engine_from_the_counters():
    out, stats = run(matmul_kernel(k=128, m=128, n=512), NONE, NONE)
    est = cost.estimate(stats)
    assert stats.matmul_count == 1
    fixed = cost.cal.CALIBRATED.matmul_fixed_cycles  # per-matmul issue/fill cost (calibration.py)
    assert est.tensor_s == pytest.approx((512 + fixed) / cost.TENSOR_HZ)
    # memset x2 on VectorE (512 and 128 free elements), tensor_copy of [128, 512]
    assert est.vector_s == pytest.approx((512 + 128 + 512) / cost.VECTOR_HZ)
    assert est.hbm_s == pytest.approx(out.nbytes / cost.HBM_BYTES_PER_S)
    assert est.time_s == max(est.lanes.values()) and est.dma_count == 1
    assert est.dma_s == pytest.approx(out.nbytes / cost.cal.CALIBRATED.dma_bytes_per_s + cost.cal.CALIBRATED.dma_fixed_s)
    assert est.serial_s == pytest.approx(sum(v for k, v in est.engines.items() if k != "hbm"))


    @jit
    def column_halves(a):
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
        for half in range(2):  # each row of each DMA is a 256 B run in HBM: charged as 512 B
            nisa.dma_copy(dst=out[:, half * 64:(half + 1) * 64], src=t)
        return out

    out, short_runs = run(column_halves, NONE)
    assert short_runs.dma_runs == {256: out.nbytes}
    assert cost.hbm_seconds(short_runs) == pytest.approx(2 * out.nbytes / cost.HBM_BYTES_PER_S)


# --- which NKI the kernels get -------------------------------------------------------------------------------

def test_placeholder_nki_is_not_mistaken_for_the_real_one(monkeypatch):
    placeholder = types.ModuleType("nki")
    monkeypatch.setitem(sys.modules, "nki", placeholder)
    monkeypatch.delenv("VLLM_MOE_W8_NKI", raising=False)
    mod, reason = nki_api._real_nki()
    assert mod is None and "nki" in reason

    real = types.ModuleType("nki")
    real.jit = lambda f: f
    lang = types.ModuleType("nki.language")
    lang.ndarray = object
    isa_mod = types.ModuleType("nki.isa")
    isa_mod.nc_matmul = object
    real.language, real.isa = lang, isa_mod
    monkeypatch.setitem(sys.modules, "nki", real)
    monkeypatch.setitem(sys.modules, "nki.language", lang)
    monkeypatch.setitem(sys.modules, "nki.isa", isa_mod)
    assert nki_api._real_nki()[0] is real
    monkeypatch.setenv("VLLM_MOE_W8_NKI", "interpreter")
    assert nki_api._real_nki()[0] is None


def test_the_backend_follows_detection(tmp_path):
    """In fresh interpreters: a package shaped like AWS's NKI is picked up, the override and its absence are not."""
    import subprocess

    fake = tmp_path / "nki"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '9.9-test'\ndef jit(f):\n    return f\n")
    (fake / "language.py").write_text("ndarray = object\n")
    (fake / "isa.py").write_text("nc_matmul = object\n")
    probe = "from vllm_moe_w8.kernels import nki_api as a; print(a.BACKEND, '|', a.REASON)"

    def backend(env_extra, with_fake):
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_MOE_W8_NKI", "PYTHONPATH")}
        env.update(env_extra)
        if with_fake:
            env["PYTHONPATH"] = str(tmp_path)
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120, check=True)
        return proc.stdout.strip()

    assert backend({}, with_fake=True) == "nki | AWS nki 9.9-test"
    assert backend({"VLLM_MOE_W8_NKI": "interpreter"}, with_fake=True).startswith("interpreter | VLLM_MOE_W8_NKI=interpreter")
    if importlib.util.find_spec("nki") is None:  # a machine without AWS's package (this one, CI)
        assert backend({}, with_fake=False).startswith("interpreter | AWS nki is not importable")
