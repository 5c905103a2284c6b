"""neuron-check's microbenchmarks and the pow2 kernel's schedule choice: in the interpreter they price both
scenarios (checked against the cost model's own rules) and write no calibration file; with device timings (here a
stand-in timer that runs the interpreter and reports one scenario's modelled time) they pick that scenario's
schedule and write the file ``kernels/schedule.py`` reads. The GpSimd/PSUM interpreter rule the kernel relies on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_moe_w8.kernels import schedule
from vllm_moe_w8.kernels.nki_api import BACKEND
from vllm_moe_w8.kernels.nki_cpu import NkiValidationError, cost, isa, language as nl, run
from vllm_moe_w8.kernels.nki_cpu import calibration as cal
from vllm_moe_w8.kernels.nki_cpu.runtime import jit
from vllm_moe_w8.neuron_glue import microbench as mb

pytestmark = pytest.mark.skipif(BACKEND != "interpreter", reason="the microbenchmarks are priced by the interpreter's counts")


@pytest.fixture(scope="module")
def interpreted():
    return mb.run_all(on_neuron=False)


def test_interpreter_run_prices_both_scenarios_and_measures_nothing(interpreted):
    by = {r.name: r for r in interpreted}
    assert set(by) == set(mb.BENCHES) and all(r.measured is None for r in interpreted)
    f, d = cal.FITTED.constants, cal.DOCUMENTED.constants
    # one matmul of a [128, 16] moving tile: fitted 16 + 616 cycles, documented max(16, 64)
    assert by["matmul"].modelled["fitted"] == pytest.approx((16 + f.matmul_fixed_cycles) / cal.TENSOR_HZ.value)
    assert by["matmul"].modelled["documented"] == pytest.approx(64 / cal.TENSOR_HZ.value)
    # VectorE tensor_scalar [128, 512] and ScalarE activation [128, 512]: serial in fitted, parallel in documented
    assert mb.overlap(interpreted, "fitted") == pytest.approx(1.0)
    v, s = 512 / cal.VECTOR_HZ.value, 512 / cal.SCALAR_HZ.value
    assert mb.overlap(interpreted, "documented") == pytest.approx(max(v, s) / (v + s))
    assert by["gpsimd_add"].modelled["fitted"] == pytest.approx(512 / cal.GPSIMD_HZ.value)
    small = 128 * mb.DMA_BYTES["dma_small"]
    assert by["dma_small"].modelled["fitted"] == pytest.approx(small / f.dma_bytes_per_s + f.dma_fixed_s)
    assert by["dma_small"].modelled["documented"] == pytest.approx(small / d.dma_bytes_per_s + d.dma_fixed_s)


def test_no_device_no_calibration_file(interpreted, tmp_path, capsys):
    target = tmp_path / "cal.json"
    with pytest.raises(ValueError, match="no device measurements"):
        mb.write_calibration(interpreted, target, "interpreter")
    record = mb.check(on_neuron=False, lnc=1, path=target)
    assert not target.exists() and "chosen" not in record
    out = capsys.readouterr().out
    assert "interpreter: no clock" in out and "not written" in out and "NKI interpreter" in out


def _stand_in_device(scenario: str):
    """A timer that reports the interpreter's counts priced in ``scenario`` (a device that behaves like it)."""
    def timer(kernel, tensors, constants, lnc):
        _out, stats = run(kernel, *tensors, **constants)
        return cost.estimate(stats, cal.SCENARIOS[scenario]).time_s
    return timer


@pytest.mark.parametrize("scenario", ["documented", "fitted"])
def test_device_measurements_choose_the_schedule_the_kernel_loads(tmp_path, monkeypatch, scenario):
    """A device where VectorE and ScalarE overlap gets the documented schedule; the fault twin (a device where they
    serialise) gets the fitted one. The written file is what kernels/schedule.py loads."""
    target = tmp_path / "neuron_calibration.json"
    record = mb.check(on_neuron=True, lnc=1, path=target, timer=_stand_in_device(scenario))
    assert record["chosen"] == scenario
    written = json.loads(target.read_text())
    assert written["scenario"] == scenario and written["vector_blocks"] == schedule.SCHEDULES[scenario]
    monkeypatch.setenv(schedule.CALIBRATION_ENV, str(target))
    loaded = schedule.load()
    assert (loaded.scenario, loaded.vector_blocks) == (scenario, schedule.SCHEDULES[scenario])
    assert str(target) in loaded.source


def test_schedule_default_and_bad_files(tmp_path):
    absent = schedule.load(tmp_path / "none.json")
    assert absent.scenario == "fitted" and absent.vector_blocks == schedule.SCHEDULES["fitted"] and "default" in absent.source
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*neuron-check"):
        schedule.load(bad)
    bad.write_text(json.dumps({"scenario": "optimistic"}))
    with pytest.raises(ValueError, match="'optimistic' is not one of"):
        schedule.load(bad)


@pytest.mark.parametrize("vector_blocks", range(schedule.BLOCK_PERIOD + 1))
def test_schedule_spreads_vector_blocks_evenly(vector_blocks):
    picks = [schedule.on_vector(b, vector_blocks) for b in range(4 * schedule.BLOCK_PERIOD)]
    assert sum(picks) == 4 * vector_blocks
    for start in range(0, len(picks), schedule.BLOCK_PERIOD):
        assert sum(picks[start:start + schedule.BLOCK_PERIOD]) == vector_blocks


@jit
def _gpsimd_add(x, from_psum=0):
    a = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    isa.dma_copy(dst=a, src=x)
    src = a
    if from_psum:
        src = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum)
        isa.tensor_copy(dst=src, src=a, engine=isa.engine.vector)
    acc = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    isa.tensor_tensor(dst=acc, data1=a, data2=src, op=nl.add, engine=isa.engine.gpsimd)
    out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    isa.dma_copy(dst=out, src=acc)
    return out


def test_rule_gpsimd_cannot_access_psum():
    x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    out, stats = run(_gpsimd_add, x)
    assert np.array_equal(out, 2 * x) and stats.engine_ops[("gpsimd", "tensor_tensor", 128, 64)] == 1
    with pytest.raises(NkiValidationError, match="GpSimdE cannot access PSUM"):
        run(_gpsimd_add, x, from_psum=1)


def test_neuron_check_on_cpu_prints_the_microbenchmarks(monkeypatch, tmp_path, capsys):
    """The hook in neuron-check: the CPU run shows the section (interpreter, both scenarios) and records it."""
    from vllm_moe_w8.neuron_glue import kernel_launch, neuron_check

    if kernel_launch.neuron_device_present()[0]:
        pytest.skip("a Neuron device is present")
    monkeypatch.setattr(neuron_check, "LAYER", dict(hidden=256, inter=256, experts_neuron=2, experts_cpu=2, top_k=2))
    monkeypatch.setattr(neuron_check, "CASES", neuron_check.CASES[:1])
    monkeypatch.setenv(schedule.CALIBRATION_ENV, str(tmp_path / "cal.json"))
    out_json = tmp_path / "check.json"
    assert neuron_check.run(lnc=1, json_path=str(out_json)) == neuron_check.EXIT_NOT_NEURON
    assert "== microbenchmarks" in capsys.readouterr().out
    section = json.loads(out_json.read_text())["microbenchmarks"]
    assert section["ran_on"].startswith("NKI interpreter") and "chosen" not in section
    assert not (tmp_path / "cal.json").exists()


def test_on_a_real_nki_host_the_pricing_runs_in_an_interpreter_child(monkeypatch, interpreted):
    """Where the kernels are bound to AWS's nki, the interpreter's counts come from a child process forced onto the
    interpreter; it gives the same figures as this process."""
    from vllm_moe_w8.kernels import nki_api

    monkeypatch.setattr(nki_api, "BACKEND", "nki")
    child = mb.modelled_table()
    for r in interpreted:
        for scenario, value in r.modelled.items():
            assert child[r.name][scenario] == pytest.approx(value, rel=1e-12)
