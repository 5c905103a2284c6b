"""``vllm-moe-w8 neuron-check``. On this CPU host for real: the inventory, every kernel case through the
launch wrapper (interpreter) against the reference, what is missing, exit 2; a corrupted layer makes it
exit 1. The Neuron branch with stand-in host probes (monkeypatched device / nki / wrap_nki / serving):
the decision logic only - the trn2 run is the real check."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_moe_w8.tools import cli
from vllm_moe_w8.neuron_glue import kernel_check, kernel_launch, neuron_check

SMALL = dict(hidden=256, inter=256, experts_neuron=4, experts_cpu=3, top_k=4)  # interpreter time on 2 shared cores


@pytest.fixture
def small_layer(monkeypatch):
    monkeypatch.setattr(neuron_check, "LAYER", SMALL)
    # the GLM case's Neuron-host width too (its CPU width is already small): a child priced "as on Neuron" stays quick
    monkeypatch.setattr(neuron_check, "GLM_LAYER", neuron_check.GLM_LAYER | dict(hidden=512, inter=256, experts_neuron=3, top_k=3,
                                                                              swiglu_limit=0.28))
    kernel_launch.backend.cache_clear()
    yield
    kernel_launch.backend.cache_clear()


def test_cpu_host_runs_every_kernel_reports_what_is_missing_and_exits_2(small_layer, capsys, tmp_path, monkeypatch):
    if kernel_launch.neuron_device_present()[0]:
        pytest.skip("a Neuron device is present")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    out_json = tmp_path / "check.json"
    assert cli.main(["neuron-check", "--json-out", str(out_json)]) == neuron_check.EXIT_NOT_NEURON
    text = capsys.readouterr().out
    for line in ("versions:", "model_runner:", "registry_entries_wrapped:", "platform_quantization:", "lnc: 2",
                 "kernels_run_on: no Neuron device"):
        assert line in text
    record = json.loads(out_json.read_text())
    cases = record["kernels"]
    assert [c["name"] for c in cases] == [c[0] for c in neuron_check.CASES + neuron_check.GLM_CASES]
    assert all(c["passed"] and c["lnc"] == 2 and c["modelled_s"] > 0 for c in cases)
    assert {c["kernel"] for c in cases} == {"selective", "dense", "blocks"}
    assert "compiled_with: torch.compile(fullgraph=True, dynamic=False), backend eager" in text
    assert "measured (interpreter wall, not device time)" in text
    assert any("a Neuron device" in m for m in record["missing"]) and any("serving a tiny model" in m for m in record["missing"])


def test_a_kernel_outside_the_bound_fails_the_check(small_layer, capsys, monkeypatch):
    """Fault injection: the kernel-side weights get one expert's gate scale tile doubled (the reference keeps
    the right one) -> exit 1, naming the case."""
    from vllm_moe_w8.kernels import host

    real = host.to_kernel_layout

    def corrupted(*args):
        kw = real(*args)
        kw.w13_scales = kw.w13_scales.clone()  # the layout may alias the caller's fp32 scales
        kw.w13_scales[0, 0, 0] *= 2
        return kw

    monkeypatch.setattr(host, "to_kernel_layout", corrupted)
    monkeypatch.setattr(neuron_check, "CASES", neuron_check.CASES[:1])
    assert neuron_check.run(lnc=1) == neuron_check.EXIT_FAILED
    assert "outside the bound: selective pow2 (decode)" in capsys.readouterr().out


# --- the GLM-5.3-Flash case (issue #22): the clamp, against the float64 reference ----------------------

def _clamped_fraction(g: dict) -> float:
    """Share of gate and up pre-activations the case's swiglu_limit clamps (float64, the case's own layer and input)."""
    from vllm_moe_w8.op.reference import dequantize_w13

    w13, s13, _w2, _s2, block = kernel_check.repacked(kernel_check.checkpoint_experts(g["experts"], g["hidden"], g["inter"], seed=1), "pow2")
    x = torch.randn(8, g["hidden"], generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).double()
    gate, up = dequantize_w13(w13, s13, 0, block, "e4m3")
    gate, up = x @ gate.double().T, x @ up.double().T
    return float(((gate > g["swiglu_limit"]).sum() + (up.abs() > g["swiglu_limit"]).sum()) / (gate.numel() + up.numel()))


def test_the_glm_case_clamps_and_passes_the_gate_against_float64():
    results = neuron_check.run_glm_kernels(lnc=2, on_neuron=False)
    assert [r.name for r in results] == [c[0] for c in neuron_check.GLM_CASES]
    assert {r.kernel for r in results} == {"selective", "blocks"}
    assert all(r.passed and r.lnc == 2 and r.modelled_s > 0 for r in results), [(r.name, r.err_over_bound) for r in results]
    assert _clamped_fraction(neuron_check.glm_shape(False)) > 0.2  # the clamp binds: the check sees it
    full = neuron_check.glm_shape(True)
    assert (full["hidden"], full["inter"], full["experts"]) == (4096, 2048, 9)  # GLM-5.3-Flash seed rank, TP=32/EP=32


def test_the_glm_case_fails_when_the_kernel_drops_the_swiglu_limit(capsys, monkeypatch):
    """Fault injection: the launch runs without the model's clamp (the reference keeps it) -> exit 1 naming the case."""
    real = kernel_launch.run_routed_experts

    def unclamped(*args, swiglu_limit=0.0, **kwargs):
        return real(*args, swiglu_limit=0.0, **kwargs)

    monkeypatch.setattr(kernel_launch, "run_routed_experts", unclamped)
    monkeypatch.setattr(neuron_check, "CASES", ())
    monkeypatch.setattr(neuron_check, "GLM_CASES", neuron_check.GLM_CASES[:1])
    assert neuron_check.run(lnc=1) == neuron_check.EXIT_FAILED
    assert f"outside the bound: {neuron_check.GLM_CASES[0][0]}" in capsys.readouterr().out


# --- stand-in: the Neuron branch's decisions with monkeypatched host probes ------------------------------

def _stand_in_neuron_host(monkeypatch, nki=True):
    import types



    monkeypatch.setattr(kernel_launch, "neuron_device_present", lambda: (True, "1 Neuron device(s) (stand-in)"))
    monkeypatch.setattr(kernel_launch, "real_nki",
                        lambda: (types.SimpleNamespace(__version__="0.5.0"), "AWS nki 0.5.0 (stand-in)") if nki
                        else (None, "not importable (stand-in)"))

    def wrap_nki(kernel):  # the interpreter's traceable launcher under the real wrap_nki's signature
        from vllm_moe_w8.neuron_glue import interpreter_hop

        return interpreter_hop.wrap_nki(kernel, kernel_launch.KERNELS[kernel.__name__][1])

    monkeypatch.setattr(kernel_launch, "import_wrap_nki", lambda: (wrap_nki, "stand_in.nki_hop"))


def test_stand_in_neuron_host_that_cannot_launch_stops_before_any_kernel(small_layer, capsys, monkeypatch):
    _stand_in_neuron_host(monkeypatch, nki=False)
    monkeypatch.setattr(neuron_check, "run_kernels", lambda *a, **k: pytest.fail("kernels ran on a broken Neuron host"))
    assert neuron_check.run(lnc=2) == neuron_check.EXIT_FAILED
    assert "the Neuron path cannot start" in capsys.readouterr().out


@pytest.mark.parametrize("served,expected", [(0, neuron_check.EXIT_OK), (1, neuron_check.EXIT_FAILED)])
def test_stand_in_neuron_host_serves_the_tiny_model_after_the_kernels(small_layer, capsys, monkeypatch, served, expected):
    _stand_in_neuron_host(monkeypatch)
    monkeypatch.setattr(neuron_check, "CASES", neuron_check.CASES[:1])
    calls = []
    monkeypatch.setattr(neuron_check, "serve_tiny_model", lambda: calls.append("serve") or served)
    monkeypatch.setattr(neuron_check, "modelled_in_interpreter", lambda lnc, experts: {neuron_check.CASES[0][0]: 1e-3})
    assert neuron_check.run(lnc=2, device="cpu") == expected
    assert calls == ["serve"]
    text = capsys.readouterr().out
    assert "measured (device)" in text and "1.000 ms" in text  # the modelled column from the interpreter's pricing


@pytest.mark.slow
def test_modelled_times_come_from_an_interpreter_child_process(small_layer):
    """What a Neuron host uses to price the kernels it ran on the device: a child process forced onto the
    interpreter (here for real, at the small layer) gives every case a positive cost-model time."""
    modelled = neuron_check.modelled_in_interpreter(lnc=2, experts=2)
    assert set(modelled) == {c[0] for c in neuron_check.CASES + neuron_check.GLM_CASES} and all(v > 0 for v in modelled.values())


def test_forcing_the_interpreter_is_explicit_and_logged(monkeypatch, caplog):
    """Stand-in device: VLLM_MOE_W8_NKI=interpreter is the one way a Neuron host runs the interpreter."""
    kernel_launch.backend.cache_clear()
    monkeypatch.setattr(kernel_launch, "neuron_device_present", lambda: (True, "1 Neuron device(s) (stand-in)"))
    monkeypatch.setenv("VLLM_MOE_W8_NKI", "interpreter")
    with caplog.at_level("WARNING", logger="vllm.neuron_w8"):
        assert kernel_launch.backend().name == "interpreter"
    assert "forced" in caplog.text
    kernel_launch.backend.cache_clear()


def test_the_inventory_lists_the_registry_entries_the_glue_wraps():
    """Without vllm-neuron each entry says so; with the labelled stand-in of vllm-neuron on the path the entries are
    present, and after the glue's install() (what register() does on the Neuron platform) they read 'wrapped'."""
    import _neuron_standin as st

    from vllm_moe_w8.neuron_glue import interfaces, registration

    factories = [".".join(t.factory) for t in interfaces.TARGETS]
    lines = neuron_check.registry_entries()
    assert len(lines) == len(interfaces.TARGETS) + len(interfaces.NOT_REPLACED)
    for factory in factories:
        assert any(factory in line and line.endswith("vllm-neuron not installed") for line in lines), lines
    st.put_standin_on_path()
    try:
        from vllm_neuron.vllm.platform import NeuronPlatform

        lines = neuron_check.registry_entries()
        assert all(any(f in line and "not wrapped (vllm_moe_w8.register() has not run here" in line for line in lines)
                   for f in factories), lines
        assert any("registry lists Qwen3MoeForCausalLM)" in line for line in lines), lines
        registration.install(NeuronPlatform)
        lines = neuron_check.registry_entries()
        assert all(any(f in line and line.endswith(")") and ": wrapped (vllm-neuron" in line for line in lines)
                   for f in factories), lines
        assert any(line.startswith("Qwen3_5MoeForCausalLM: not wrapped") for line in lines)
    finally:
        st.drop_standin()
