"""ScalarE's activations are "approximated with piece-wise polynomials" on the device (aws-neuron-sdk @81ce03ae
``nki/api/nki.api.shared.rst``), exact float32 here; ``nki_cpu.perturbed(eps)`` gives every approximated function a
relative error of at most ``eps`` (plus the float32 rounding of the result) so accuracy gates can be run against a stated bound (AWS documents none). Here: the
mode keeps its bound and touches only the approximated functions, and the kernels' numerics gate
(``neuron_glue.kernel_check``) keeps a margin under it - passing with the perturbation the bound states
(``GATE_MARGIN_EPS``, measured in benchmarks/bench_activation_margin.py) and refusing a realistic larger error."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_moe_w8.kernels import nki_cpu
from vllm_moe_w8.kernels.nki_cpu import isa as nisa
from vllm_moe_w8.kernels.nki_cpu import jit, run
from vllm_moe_w8.kernels.nki_cpu import language as nl

GATE_MARGIN_EPS = 2.0**-9  # relative ScalarE error the kernel gate still passes (bench_activation_margin.json: up to 2**-8)
GATE_REFUSES_EPS = 2.0**-6  # a 1.6 % approximation error: refused


def _apply(op):
    @jit
    def kernel(x):
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        o = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=o, op=op, data=t)
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out

    return kernel


@pytest.mark.parametrize("mode", ["uniform", "high", "low"])
def test_perturbed_activations_keep_their_bound(mode):
    x = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32) * 4
    exact_silu, _ = run(_apply(nl.silu), x)
    exact_relu, _ = run(_apply(nl.relu), x)
    eps = 2.0**-7
    with nki_cpu.perturbed(eps, mode, seed=1):
        silu, _ = run(_apply(nl.silu), x)
        relu, _ = run(_apply(nl.relu), x)
    rel = np.abs(silu.astype(np.float64) - exact_silu) / np.maximum(np.abs(exact_silu), 1e-30)
    assert rel.max() <= eps + 2.0**-22 and rel.max() > eps / 4  # bounded (plus the fp32 rounding), and applied
    if mode != "uniform":
        assert np.all(np.sign(silu - exact_silu) * np.sign(exact_silu) == (1 if mode == "high" else -1)) or \
            np.all(exact_silu == 0)
    assert np.array_equal(relu, exact_relu)  # relu, copy, abs, sign, square are exact in a piece-wise polynomial
    again, _ = run(_apply(nl.silu), x)
    assert np.array_equal(again, exact_silu)  # outside the block: exact again


def test_a_negative_bound_is_an_error():
    with pytest.raises(ValueError):
        with nki_cpu.perturbed(-1.0):
            pass


@pytest.mark.parametrize("mode", ["uniform", "high"])
def test_the_kernel_gate_keeps_a_margin_and_refuses_a_real_approximation_error(mode):
    from vllm_moe_w8.neuron_glue import kernel_check as kc

    ckpt = kc.checkpoint_experts(4, 256, 256, seed=0)
    with nki_cpu.perturbed(GATE_MARGIN_EPS, mode):
        kept = kc.run_case("margin", ckpt, "pow2", 8, 4, 2)
    with nki_cpu.perturbed(GATE_REFUSES_EPS, mode):
        refused = kc.run_case("fault", ckpt, "pow2", 8, 4, 2)
    assert kept.passed and kept.err_over_bound < 1.0
    assert not refused.passed and refused.err_over_bound > 1.0
