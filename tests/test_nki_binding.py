"""The Neuron binding off-device: it says why it is unavailable, and its pieces that run anywhere
(static-shape affinities, the load-time re-layout cache) agree with the host helpers."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_w8.neuron_glue import binding as neuron_binding
from vllm_moe_w8.kernels import host, nki_api


def test_unavailable_here_with_a_reason_the_op_can_log():
    ok, reason = neuron_binding.available()
    if nki_api.BACKEND == "interpreter":
        assert not ok
        assert "NKI unavailable" in reason and nki_api.REASON in reason
    assert isinstance(reason, str) and reason


def test_the_op_relays_the_binding_and_survives_its_failure(monkeypatch):
    from vllm_moe_w8.op import custom_op as moe_op

    monkeypatch.setattr(neuron_binding, "available", lambda: (True, "a stub device"))
    assert moe_op.neuron_status() == (True, "a stub device")
    assert moe_op.compute_path("cpu")[1].endswith("Neuron path available but unused")

    def broken():
        raise RuntimeError("driver missing")

    monkeypatch.setattr(neuron_binding, "available", broken)
    assert moe_op.neuron_status() == (False, "neuron_glue.binding.available() raised RuntimeError: driver missing")


def test_static_shape_affinities_match_the_host_helper():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, 6, (37, 4), generator=gen)
    ids[3, 1] = ids[3, 0] = 2  # duplicate route
    weights = torch.rand(37, 4, generator=gen)
    torch.testing.assert_close(neuron_binding.dense_affinities(weights, ids, 6), host.dense_affinities(weights, ids, 6),
                               rtol=0, atol=1e-7)


def test_prepare_weights_caches_one_relayout_per_layer():
    w13 = torch.randint(0, 0x78, (2, 256, 128), dtype=torch.uint8)
    w2 = torch.randint(0, 0x78, (2, 128, 128), dtype=torch.uint8)
    s13, s2 = torch.ones(2, 2, 1), torch.ones(2, 1, 1)
    a = neuron_binding.prepare_weights(w13, s13, w2, s2, 128, 128, "e4m3")
    b = neuron_binding.prepare_weights(w13, s13, w2, s2, 128, 128, "e4m3")
    assert a is b and a.mode == "pow2" and tuple(a.w13.shape) == (2, 128, 1, 256)


def test_supports_names_the_kernel_or_the_reason():
    assert neuron_binding.supports(128, 128, "e4m3") == (True, "pow2")
    assert neuron_binding.supports(128, 0, "e4m3") == (True, "output-block")
    ok, why = neuron_binding.supports(64, 128, "e4m3")
    assert not ok and "torch path" in why


def test_refuses_what_the_kernels_do_not_implement():
    x = torch.zeros(2, 128)
    args = (x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, 256, 128, dtype=torch.uint8),
            torch.ones(1, 2, 1), torch.zeros(1, 128, 128, dtype=torch.uint8), torch.ones(1, 1, 1), 128, 128)
    with pytest.raises(ValueError, match="swiglu_limit"):
        neuron_binding.fused_moe_neuron(*args, "e4m3", "silu", -1.0)
    with pytest.raises(ValueError, match="activation"):
        neuron_binding.fused_moe_neuron(*args, "e4m3", "gelu")
    with pytest.raises(ValueError, match="lut"):
        neuron_binding.fused_moe_neuron(*args, "e4m3fn")


def test_hardware_script_refuses_to_run_without_a_device():
    import subprocess
    import sys
    from pathlib import Path

    if neuron_binding.available()[0]:
        pytest.skip("a Neuron device is present: the script would run for real")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "trn2_hardware_run.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "refusing to run" in proc.stderr and "NKI unavailable" in proc.stdout
