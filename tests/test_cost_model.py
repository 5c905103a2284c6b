"""The calibrated Trn2 cost model: reproduces the published figures within its band, the recorded JSON is what
the model gives now, the constants are what the fit returns, and the gate fails when a modelled cost is dropped."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from benchmarks.common import RESULTS
from vllm_moe_w8.kernels.nki_cpu import calibrate, calibration, cost
from vllm_moe_w8.kernels.nki_cpu import moe_dataflows as md
from vllm_moe_w8.kernels.nki_cpu.machine import Stats

RECORD = RESULTS / "cost_model.json"
# The recorded JSON is the same float arithmetic re-run (JSON keeps a float's repr exactly): equal up to rounding noise.
RECOMPUTE_RTOL = 1e-12
# calibration.CALIBRATED keeps 5 significant digits of what fit() returns.
CONSTANTS_RTOL = 1e-3


@pytest.fixture(scope="module")
def record() -> dict:
    if not RECORD.exists():
        pytest.fail(f"{RECORD} is missing: run `.venv/bin/python -m benchmarks.bench_cost_model`")
    return json.loads(RECORD.read_text())


def test_recorded_calibration_is_within_the_band(record):
    rows = record["calibration"]["rows"]
    assert {(r["figure"], r["kernel"], r["T"]) for r in rows} == {(p.figure, p.kernel, p.tokens) for p in calibration.PUBLISHED}
    for r in rows:
        assert r["published"] == calibration.published(r["figure"], r["kernel"], r["T"])
        assert abs(r["modelled"] / r["published"] - 1) <= calibration.BAND, r
    predictions = [r for r in rows if r["role"] == "prediction"]
    assert len(predictions) >= 12, "most figures must be predictions, not fits"


def test_model_now_gives_the_recorded_calibration(record):
    now = {(r["figure"], r["kernel"], r["T"]): r["modelled"] for r in calibrate.comparison()}
    for r in record["calibration"]["rows"]:
        assert now[(r["figure"], r["kernel"], r["T"])] == pytest.approx(r["modelled"], rel=RECOMPUTE_RTOL), r


def test_calibrated_constants_are_what_the_fit_returns():
    fitted, _rest = calibrate.fit()
    for f in fields(calibration.Constants):
        assert getattr(calibration.CALIBRATED, f.name) == pytest.approx(getattr(fitted, f.name), rel=CONSTANTS_RTOL), f.name
    for name in calibration.SOURCES:
        assert calibration.SOURCES[name].startswith(("fitted", "AWS")), name


def _out_of_band(**fault) -> set[tuple]:
    c, rest = calibrate.fit()
    rows = calibrate.comparison(c.replace(**fault), rest)
    return {(r["figure"], r["kernel"], r["T"]) for r in rows if not r["within_band"]}


def test_fault_dropping_the_dma_fixed_cost_leaves_the_band():
    assert ("dma_active_s", "first_pow2", 32) in _out_of_band(dma_fixed_s=0.0)


def test_fault_dropping_descriptor_generation_leaves_the_band():
    bad = _out_of_band(dge_per_dma_s=0.0)
    assert ("device_s", "first_pow2", 32) in bad and ("gpsimd_s", "first_pow2", 32) in bad


def test_fault_dropping_the_launch_overhead_leaves_the_band():
    bad = _out_of_band(launch_s=0.0)
    assert ("call_s", "coalesced_output_block", 128) in bad and ("call_s", "coalesced_pow2", 128) in bad


def test_fault_without_per_dma_costs_the_model_ranks_the_kernels_wrongly():
    """On hardware the first pow2 kernel (28k DMAs) took 2.5x the coalesced one (5.5k) at equal bytes. Without
    the per-DMA costs the model ranks them the other way round."""
    c, _ = calibrate.fit()
    no_dma_costs = c.replace(dma_fixed_s=0.0, dge_per_dma_s=0.0)

    def device(kernel, constants):
        return cost.estimate(calibrate.kernel_stats(kernel, 32), constants).time_s

    assert device("first_pow2", c) > 2 * device("coalesced_pow2", c)
    assert device("first_pow2", no_dma_costs) < device("coalesced_pow2", no_dma_costs)


def _counters(s: Stats) -> tuple:
    return (s.hbm_read_bytes, s.hbm_write_bytes, s.dma_count, dict(s.dma_runs), dict(s.matmuls), dict(s.transposes),
            dict(s.engine_ops))


@pytest.mark.parametrize("mode", md.MODES)
@pytest.mark.parametrize("tokens", [16, 256])
def test_scaling_from_one_and_two_experts_equals_a_direct_run(mode, tokens):
    assert _counters(md.kernel_stats(mode, 3, 256, 256, tokens)) == _counters(md.interpreted(mode, 3, 256, 256, tokens))


def test_kernel_choice_rows_come_from_the_model(record):
    shape = record["shapes"]["Qwen3.5-35B-A3B EP=8"]
    row = next(r for r in record["kernel_choice"] if r["model"] == "Qwen3.5-35B-A3B EP=8" and r["phase"] == "decode"
               and r["T"] == 32 and r["weights"] == "fp8 output-block")
    stats = md.decode("output-block", shape["E"], shape["H"], shape["I"], 32, shape["swiglu_limit"])
    assert cost.estimate(stats).time_s * 1e3 == pytest.approx(row["device_ms"], rel=RECOMPUTE_RTOL)
    assert stats.dma_count == row["dma_transfers"]


def test_estimate_keeps_its_fields_and_overlap_rule():
    s = calibrate.kernel_stats("coalesced_pow2", 32)
    est = cost.estimate(s)
    for name in ("hbm_s", "tensor_s", "vector_s", "scalar_s", "gpsimd_s", "time_s", "serial_s", "bound_by", "engines"):
        assert hasattr(est, name)
    assert est.time_s == max(est.dma_s, est.hbm_s, est.tensor_s, est.gpsimd_s, est.vector_s + est.scalar_s)
    assert est.serial_s >= est.time_s
    assert est.call_s == est.time_s + calibration.CALIBRATED.launch_s
