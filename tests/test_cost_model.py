"""The calibrated Trn2 cost model in both scenarios (fitted, documented): reproduces the published figures within
its band, the recorded JSON is what the model gives now, the constants are what the fit returns, the gate fails
when a modelled cost is dropped, and the recorded kernel choice meets what the pow2 kernel was built for."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from benchmarks.common import RESULTS
from vllm_moe_w8.kernels import schedule
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


SCENARIOS = list(calibration.SCENARIOS)
# The documented scenario's one figure outside the band: with matmuls at max(N, 64) cycles the model cannot give
# the first pow2 kernel's published 18 % TensorE occupancy (a prediction there; the fitted scenario fits it).
DOCUMENTED_OUT_OF_BAND = {("tensor_occupancy", "first_pow2", 32)}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_recorded_calibration_is_checked_against_the_band(record, scenario):
    rows = record["calibration"][scenario]["rows"]
    assert {(r["figure"], r["kernel"], r["T"]) for r in rows} == {(p.figure, p.kernel, p.tokens) for p in calibration.PUBLISHED}
    outside = set()
    for r in rows:
        assert r["published"] == calibration.published(r["figure"], r["kernel"], r["T"])
        assert r["within_band"] == (abs(r["modelled"] / r["published"] - 1) <= calibration.BAND), r
        if not r["within_band"]:
            outside.add((r["figure"], r["kernel"], r["T"]))
            assert r["role"] == "prediction", f"a fitted figure outside the band: {r}"
    assert outside == (set() if scenario == "fitted" else DOCUMENTED_OUT_OF_BAND)
    predictions = [r for r in rows if r["role"] == "prediction"]
    assert len(predictions) >= 12, "most figures must be predictions, not fits"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_model_now_gives_the_recorded_calibration(record, scenario):
    rules = calibration.SCENARIOS[scenario].rules
    now = {(r["figure"], r["kernel"], r["T"]): r["modelled"] for r in calibrate.comparison(rules=rules)}
    for r in record["calibration"][scenario]["rows"]:
        assert now[(r["figure"], r["kernel"], r["T"])] == pytest.approx(r["modelled"], rel=RECOMPUTE_RTOL), r


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_calibrated_constants_are_what_the_fit_returns(scenario):
    sc = calibration.SCENARIOS[scenario]
    fitted, _rest = calibrate.fit(sc.rules)
    for f in fields(calibration.Constants):
        assert getattr(sc.constants, f.name) == pytest.approx(getattr(fitted, f.name), rel=CONSTANTS_RTOL), f.name
    for name in (f.name for f in fields(calibration.Constants)):
        assert sc.sources[name].startswith(("fitted", "AWS", "assumed")), (scenario, name)
    for name, value in sc.rules.items():  # the documented constants are AWS's, not fitted
        assert getattr(sc.constants, name) == value and sc.sources[name].startswith("AWS"), name


def test_scenarios_differ_exactly_in_the_documented_rules():
    f, d = calibration.FITTED.constants, calibration.DOCUMENTED.constants
    differ = {x.name for x in fields(calibration.Constants) if getattr(f, x.name) != getattr(d, x.name)}
    assert differ == set(calibration.DOCUMENTED_RULES)
    s = calibrate.kernel_stats("coalesced_pow2", 32)
    est = cost.estimate(s, calibration.DOCUMENTED)
    assert est.time_s == max(est.dma_s, est.hbm_s, est.tensor_s, est.gpsimd_s, est.vector_s, est.scalar_s)
    # one [16-column] matmul: documented issue interval 64 cycles, fitted 16 + 616
    assert cost.matmul_cycles(16, 1, calibration.DOCUMENTED) == 64
    assert cost.matmul_cycles(16, 1, calibration.FITTED) == pytest.approx(16 + f.matmul_fixed_cycles)


def _out_of_band(scenario="fitted", **fault) -> set[tuple]:
    rules = calibration.SCENARIOS[scenario].rules
    c, rest = calibrate.fit(rules)
    rows = calibrate.comparison(c.replace(**fault), rest, rules)
    return {(r["figure"], r["kernel"], r["T"]) for r in rows if not r["within_band"]}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault_dropping_the_dma_fixed_cost_leaves_the_band(scenario):
    assert ("dma_active_s", "first_pow2", 32) in _out_of_band(scenario, dma_fixed_s=0.0)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault_dropping_descriptor_generation_leaves_the_band(scenario):
    bad = _out_of_band(scenario, dge_per_dma_s=0.0)
    assert ("device_s", "first_pow2", 32) in bad and ("gpsimd_s", "first_pow2", 32) in bad


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault_dropping_the_launch_overhead_leaves_the_band(scenario):
    bad = _out_of_band(scenario, launch_s=0.0)
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


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_kernel_choice_rows_come_from_the_model(record, scenario):
    shape = record["shapes"]["Qwen3.5-35B-A3B EP=8"]
    rows = [r for r in record["kernel_choice"] if r["model"] == "Qwen3.5-35B-A3B EP=8" and r["phase"] == "decode"
            and r["T"] == 32 and r["scenario"] == scenario]
    out_block = next(r for r in rows if r["weights"] == "fp8 output-block")
    stats = md.decode("output-block", shape["E"], shape["H"], shape["I"], 32, shape["swiglu_limit"])
    assert cost.estimate(stats, calibration.SCENARIOS[scenario]).time_s * 1e3 == pytest.approx(out_block["device_ms"], rel=RECOMPUTE_RTOL)
    assert stats.dma_count == out_block["dma_transfers"]
    pow2 = next(r for r in rows if r["weights"] == "fp8 pow2")
    assert pow2["schedule"] == scenario
    stats = md.decode("pow2", shape["E"], shape["H"], shape["I"], 32, shape["swiglu_limit"], schedule.SCHEDULES[scenario])
    assert cost.estimate(stats, calibration.SCENARIOS[scenario]).time_s * 1e3 == pytest.approx(pow2["device_ms"], rel=RECOMPUTE_RTOL)


# What the pow2 kernel's dataflow was built for (issue #21), on the recorded rows (which the test above ties to
# the model): faster than BF16 at every decode T in both scenarios (each with its own schedule, and the default
# schedule in the documented one too); in the documented scenario <= 0.8x BF16 and within 2x the HBM time of the
# weights. The fitted scenario cannot reach 0.8x: there TensorE alone (the same 128x512 matmul stream BF16 runs,
# 616 fitted cycles each, plus transposes) is ~0.84x BF16's time (docs/cost-model.md).
POW2_VS_BF16_DOCUMENTED = 0.8
POW2_VS_BF16_FITTED = 0.9
POW2_VS_HBM_DOCUMENTED = 2.0


def _decode_pairs(record):
    by = {}
    for r in record["kernel_choice"]:
        if r["phase"] == "decode":
            by.setdefault((r["model"], r["T"], r["scenario"]), {})[r["weights"]] = r
    return by


def test_recorded_pow2_decode_beats_bf16_in_both_scenarios(record):
    pairs = _decode_pairs(record)
    assert {t for (_m, t, _s) in pairs} >= {1, 8, 32, 64, 128} and {s for (_m, _t, s) in pairs} == set(SCENARIOS)
    for (model, t, scenario), by in pairs.items():
        ratio = by["fp8 pow2"]["device_ms"] / by["bf16"]["device_ms"]
        limit = POW2_VS_BF16_DOCUMENTED if scenario == "documented" else POW2_VS_BF16_FITTED
        assert ratio <= limit, (model, t, scenario, ratio)
        if scenario == "documented":
            assert by["fp8 pow2"]["device/roofline"] <= POW2_VS_HBM_DOCUMENTED, (model, t, by["fp8 pow2"]["device/roofline"])
            assert by["fp8 pow2 (default schedule)"]["device_ms"] < by["bf16"]["device_ms"], (model, t)


def test_fault_the_old_pow2_dataflow_would_fail_the_goal():
    """Fault twin of the goal check: all block scale-adds on VectorE (the schedule that overloads one engine, like
    the old ScalarE-scale + VectorE-add dataflow) is slower than BF16 in the fitted scenario."""
    shape = {"E": 32, "H": 2048, "I": 512}
    stats = md.decode("pow2", shape["E"], shape["H"], shape["I"], 16, 0.0, vector_blocks=schedule.BLOCK_PERIOD)
    bf16 = md.bf16_decode(shape["E"], shape["H"], shape["I"], 16)
    assert cost.estimate(stats, calibration.FITTED).time_s > cost.estimate(bf16, calibration.FITTED).time_s


def test_estimate_keeps_its_fields_and_overlap_rule():
    s = calibrate.kernel_stats("coalesced_pow2", 32)
    est = cost.estimate(s)
    for name in ("hbm_s", "tensor_s", "vector_s", "scalar_s", "gpsimd_s", "time_s", "serial_s", "bound_by", "engines"):
        assert hasattr(est, name)
    assert est.time_s == max(est.dma_s, est.hbm_s, est.tensor_s, est.gpsimd_s, est.vector_s + est.scalar_s)
    assert est.serial_s >= est.time_s
    assert est.call_s == est.time_s + calibration.CALIBRATED.launch_s
