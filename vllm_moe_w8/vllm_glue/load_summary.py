"""Load statistics of a model's routed experts, shared by all its MoE layers.

One :class:`MoELoadSummary` per model (the config owns it and hands it to every MoE method). Each
layer reports its creation and, after its repack, its byte counts and repack statistics; when the last
layer created has been processed, one summary line is logged (``processed N MoE layers ...``; the demo
and the end-to-end benchmark read it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.logger import init_logger

from vllm_moe_w8.codec import fp8

logger = init_logger("vllm.neuron_w8")


@dataclass
class MoELoadSummary:
    """Counters over the MoE layers of one model; ``totals`` sums every processed layer's statistics."""

    layers_created: int = 0
    layers_processed: int = 0
    started: float | None = None
    totals: dict[str, float] = field(default_factory=dict)

    def layer_created(self) -> bool:
        """Count a new MoE layer; True for the model's first one (the caller logs the load start)."""
        first = self.layers_created == 0
        if first:
            self.started = time.perf_counter()
        self.layers_created += 1
        return first

    def layer_processed(self, *, mode: str, converted: bool, bytes_before: int, bytes_after: int,
                        stats: fp8.RepackStats, seconds: float, checked_experts: int) -> None:
        """Add one processed layer; log the summary once the last created layer is in."""
        acc = self.totals
        for key, value in (
            ("layers", 1), ("bytes_before", bytes_before), ("bytes_after", bytes_after), ("blocks", stats.blocks),
            ("blocks_shifted", stats.blocks_shifted), ("values_rounded", stats.values_changed), ("seconds", seconds),
            ("checked_experts", checked_experts),
        ):
            acc[key] = acc.get(key, 0) + value
        acc["max_abs_error"] = max(acc.get("max_abs_error", 0.0), stats.max_abs_error)
        self.layers_processed += 1
        if self.layers_processed != self.layers_created:
            return
        wall = time.perf_counter() - (self.started if self.started is not None else time.perf_counter())
        logger.info(
            "neuron-w8: processed %d MoE layers (mode %s%s): expert bytes %.2f MB before -> %.2f MB after; "
            "blocks shifted %d of %d; values rounded %d (max abs error %.3g); self-check %s; repack %.2f s "
            "(%.2f s since loading started)",
            int(acc["layers"]), mode, ", converted checkpoint: no repack" if converted else "",
            acc["bytes_before"] / 1e6, acc["bytes_after"] / 1e6, int(acc["blocks_shifted"]), int(acc["blocks"]),
            int(acc["values_rounded"]), acc["max_abs_error"],
            f"passed on {int(acc['checked_experts'])} experts" if acc["checked_experts"] else "off",
            acc["seconds"], wall,
        )


@dataclass
class LinearLoadSummary:
    """How a model's non-expert linear layers are served (one per model, shared by its linear methods).

    Each layer reports its creation and, once loaded, its path: ``"vllm-fp8"`` (1 byte resident, vLLM's FP8 kernel),
    ``"dequant"`` (an exact copy in the model dtype) or ``"as-loaded"`` (not FP8 in the checkpoint). Every distinct
    reason is logged once, with the first layer it applied to; when the last created layer is in, one line sums up.
    """

    layers_created: int = 0
    layers_processed: int = 0
    paths: dict[str, list[int]] = field(default_factory=dict)  # path -> [layers, resident weight bytes]
    reasons: set[str] = field(default_factory=set)

    def layer_created(self) -> None:
        self.layers_created += 1

    def layer_processed(self, path: str, why: str, prefix: str, weight_bytes: int) -> None:
        if why not in self.reasons:
            self.reasons.add(why)
            logger.info("neuron-w8: non-expert linear layers on CPU: %s (first layer: %s)", why, prefix)
        count = self.paths.setdefault(path, [0, 0])
        count[0] += 1
        count[1] += weight_bytes
        self.layers_processed += 1
        if self.layers_processed != self.layers_created:
            return
        names = {"vllm-fp8": "on vLLM's FP8 kernel (1 byte per weight)", "dequant": "dequantised to the model dtype",
                 "as-loaded": "kept as loaded (not FP8 in the checkpoint)"}
        parts = [f"{n} {names[p]}: {b / 1e6:.2f} MB" for p, (n, b) in sorted(self.paths.items())]
        logger.info("neuron-w8: processed %d non-expert linear layers: %s", self.layers_processed, "; ".join(parts))
