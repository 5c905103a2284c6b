"""Fit the cost model's constants to the reference implementation's published figures and compare every figure.

The 2-layer profile is a whole decoder graph; the MoE kernels are two of its calls. Whatever the graph spends
outside them (attention, DeltaNet, router, shared expert, LM head) is :class:`RestOfGraph`, fitted from one
column and then held fixed for the others:

1. ``dge_per_dma_s`` = GPSIMD active / DMA transfers of the coalesced column (all GpSimd time is taken to be
   descriptor generation; the first-pow2 and BF16 GPSIMD times are then predictions).
2. DMA queue time ``bytes / rate + transfers * fixed``: two equations, the two FP8 columns (equal bytes,
   27,962 vs 5,531 transfers) give ``dma_fixed_s`` and ``dma_bytes_per_s``; BF16 is a prediction.
3. Rest-of-graph transfers from the coalesced column, HBM reads and DMA bytes from the BF16 column.
4. TensorE busy (occupancy x device time) of the two FP8 columns gives the rest-of-graph TensorE time and
   ``matmul_fixed_cycles``; BF16 occupancy is a prediction.
5. ``launch_s`` = the output-block per-call time minus its modelled kernel; the three pow2 per-call times are
   predictions.
6. Rest-of-graph device time from the BF16 column; the two FP8 device times are predictions.

``instruction_overhead_cycles`` is AWS's documented figure, not fitted.

The documented scenario (:data:`.calibration.DOCUMENTED`) holds the rules AWS documents fixed
(``calibration.DOCUMENTED_RULES``: matmul cost ``max(N, 64)``, VectorE ‖ ScalarE, two-input VectorE 2N) and fits
the rest the same way, except step 4: with the matmul cost given, the rest-of-graph TensorE time comes from the
coalesced column alone and the first-pow2 occupancy becomes a prediction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import calibration as cal
from . import cost
from .machine import Stats
from .reference_dataflows import KERNELS, combine

FIT_FIGURES = {  # (figure, kernel, tokens) that determine a constant; every other figure is a prediction
    ("gpsimd_s", "coalesced_pow2", 32), ("dma_active_s", "first_pow2", 32), ("dma_active_s", "coalesced_pow2", 32),
    ("dma_transfers", "coalesced_pow2", 32), ("hbm_read_bytes", "bf16", 32), ("dma_bytes", "bf16", 32),
    ("tensor_occupancy", "first_pow2", 32), ("tensor_occupancy", "coalesced_pow2", 32),
    ("call_s", "coalesced_output_block", 128), ("device_s", "bf16", 32),
}


@dataclass(frozen=True)
class RestOfGraph:
    """The 2-layer profile outside the MoE kernels (fitted)."""

    device_s: float
    hbm_read_bytes: float
    dma_bytes: float
    dma_transfers: float
    tensor_busy_s: float


def fit_figures(rules: dict | None = None) -> set[tuple[str, str, int]]:
    """The figures a scenario's fit uses (the rest are predictions)."""
    if rules and "matmul_fixed_cycles" in rules:
        return FIT_FIGURES - {("tensor_occupancy", "first_pow2", 32)}
    return set(FIT_FIGURES)


def kernel_stats(kernel: str, tokens: int, layers: int = 1) -> Stats:
    shape = cal.REFERENCE_SHAPE
    return combine([(layers, KERNELS[kernel](tokens, shape["E"], shape["H"], shape["I"]))])


def _moe_bytes(s: Stats) -> int:
    return s.hbm_read_bytes + s.hbm_write_bytes


def _tensor_terms(s: Stats) -> tuple[float, int]:
    """(moving-column cycles, instruction count) of TensorE: busy cycles = columns + count * fixed."""
    zero = cal.CALIBRATED.replace(matmul_fixed_cycles=0.0)
    count = sum(s.matmuls.values()) + sum(s.transposes.values())
    return cost.tensor_cycles(s, zero), count


def fit(rules: dict | None = None) -> tuple[cal.Constants, RestOfGraph]:
    """Fit the constants to the published figures; ``rules`` holds constants fixed (a scenario's documented ones)."""
    rules = dict(rules or {})
    pub, layers = cal.published, cal.PROFILE_LAYERS
    moe = {k: kernel_stats(k, 32, layers) for k in ("bf16", "first_pow2", "coalesced_pow2")}

    dge = pub("gpsimd_s", "coalesced_pow2") / pub("dma_transfers", "coalesced_pow2")
    (a1, n1, b1), (a2, n2, b2) = [(pub("dma_active_s", k), pub("dma_transfers", k), pub("dma_bytes", k))
                                  for k in ("first_pow2", "coalesced_pow2")]
    per_byte, dma_fixed = _solve_dma(a1, n1, b1, a2, n2, b2)
    dma_rate = 1.0 / per_byte

    busy = {k: pub("tensor_occupancy", k) * pub("device_s", k) for k in ("first_pow2", "coalesced_pow2")}
    hz = cost.TENSOR_HZ
    if "matmul_fixed_cycles" in rules:  # documented: the matmul cost is given, one column fixes the rest of the graph
        mm_fixed = rules.pop("matmul_fixed_cycles")
        given = cal.CALIBRATED.replace(matmul_fixed_cycles=mm_fixed, **{k: v for k, v in rules.items() if k.startswith("matmul")})
        rest_tensor = busy["coalesced_pow2"] - layers * cost.tensor_cycles(kernel_stats("coalesced_pow2", 32), given) / hz
    else:
        (c1, m1), (c2, m2) = _tensor_terms(moe["first_pow2"]), _tensor_terms(moe["coalesced_pow2"])
        # busy_k = rest + (c_k + m_k * fixed) / hz for k in (first, coalesced)
        mm_fixed = ((busy["first_pow2"] - busy["coalesced_pow2"]) * hz - (c1 - c2)) / (m1 - m2)
        rest_tensor = busy["coalesced_pow2"] - (c2 + m2 * mm_fixed) / hz

    base = cal.Constants(dma_bytes_per_s=dma_rate, dma_fixed_s=dma_fixed, dge_per_dma_s=dge, matmul_fixed_cycles=mm_fixed,
                         instruction_overhead_cycles=cal.CALIBRATED.instruction_overhead_cycles, launch_s=0.0, **rules)
    c = _with_launch(base)
    rest = RestOfGraph(
        device_s=pub("device_s", "bf16") - layers * cost.estimate(kernel_stats("bf16", 32), c).time_s,
        hbm_read_bytes=pub("hbm_read_bytes", "bf16") - moe["bf16"].hbm_read_bytes,
        dma_bytes=pub("dma_bytes", "bf16") - _moe_bytes(moe["bf16"]),
        dma_transfers=pub("dma_transfers", "coalesced_pow2") - moe["coalesced_pow2"].dma_count,
        tensor_busy_s=rest_tensor,
    )
    return c, rest


def _with_launch(c: cal.Constants) -> cal.Constants:
    """``launch_s`` = the published output-block per-call time minus its modelled kernel."""
    ob = cost.estimate(kernel_stats("coalesced_output_block", 128), c.replace(launch_s=0.0))
    return c.replace(launch_s=cal.published("call_s", "coalesced_output_block", 128) - ob.time_s)


def _solve_dma(a1, n1, b1, a2, n2, b2) -> tuple[float, float]:
    """(seconds per byte, seconds per transfer) from a_k = b_k * x + n_k * y."""
    det = b1 * n2 - b2 * n1
    return (a1 * n2 - a2 * n1) / det, (b1 * a2 - b2 * a1) / det


def modelled_figures(c: cal.Constants, rest: RestOfGraph) -> dict[tuple[str, str, int], float]:
    """Every published figure as the model gives it, keyed like :data:`FIT_FIGURES`."""
    out: dict[tuple[str, str, int], float] = {}
    layers = cal.PROFILE_LAYERS
    for p in cal.PUBLISHED:
        key = (p.figure, p.kernel, p.tokens)
        if p.figure == "call_s":
            out[key] = cost.estimate(kernel_stats(p.kernel, p.tokens), c).call_s
            continue
        one = cost.estimate(kernel_stats(p.kernel, p.tokens), c)
        moe = kernel_stats(p.kernel, p.tokens, layers)
        device = rest.device_s + layers * one.time_s
        transfers = rest.dma_transfers + moe.dma_count
        dma_bytes = rest.dma_bytes + _moe_bytes(moe)
        out[key] = {
            "device_s": device,
            "hbm_read_bytes": rest.hbm_read_bytes + moe.hbm_read_bytes,
            "dma_bytes": dma_bytes,
            "dma_transfers": transfers,
            "dma_active_s": dma_bytes / c.dma_bytes_per_s + transfers * c.dma_fixed_s,
            "gpsimd_s": transfers * c.dge_per_dma_s + layers * (one.gpsimd_s - one.dge_s),
            "tensor_occupancy": (rest.tensor_busy_s + layers * one.tensor_s) / device,
        }[p.figure]
    return out


def comparison(c: cal.Constants | None = None, rest: RestOfGraph | None = None, rules: dict | None = None) -> list[dict]:
    """One row per published figure: published, modelled, ratio, fit or prediction, within the band."""
    if c is None or rest is None:
        c, rest = fit(rules)
    model = modelled_figures(c, rest)
    fitted_here = fit_figures(rules)
    rows = []
    for p in cal.PUBLISHED:
        key = (p.figure, p.kernel, p.tokens)
        ratio = model[key] / p.value
        launch = c.launch_s if p.figure == "call_s" else 0.0  # the profile is a compiled graph: no launch
        rows.append({"figure": p.figure, "kernel": p.kernel, "T": p.tokens, "published": p.value, "modelled": model[key],
                     "launch_part": launch,
                     "ratio": ratio, "role": "fit" if key in fitted_here else "prediction", "source": p.source,
                     "within_band": abs(ratio - 1) <= cal.BAND})
    return rows


def record(scenario: cal.Scenario = cal.FITTED) -> dict:
    """What the benchmark writes for one scenario: constants (with sources), rest of graph, the comparison rows."""
    c, rest = fit(scenario.rules)
    return {"scenario": scenario.name, "constants": asdict(c), "constant_sources": scenario.sources,
            "rest_of_graph": asdict(rest),
            "documented": {k: {"value": v.value, "unit": v.unit, "source": v.source} for k, v in cal.DOCUMENTED_FIGURES.items()},
            "band": cal.BAND, "rows": comparison(c, rest, scenario.rules)}
