"""Which engine schedule the exact pow2 kernel is built with, read once at load from the Neuron calibration file.

The pow2 kernel scales and adds every 128x128 block's fp32 partial. Each block goes either to VectorE (one fused
``scalar_tensor_tensor``: partial * scale + total) or to ScalarE + GpSimdE (a scaled ``activation`` PSUM -> SBUF,
then a GpSimd ``tensor_tensor`` add in SBUF). The arithmetic is the same fp32 multiply then fp32 add either way;
only the engine changes. Which split is fastest depends on a fact no document settles and only the device can
measure: whether VectorE and ScalarE run in parallel on PSUM (AWS's Trn2 guide: yes; the fitted cost model: no).

``vllm-moe-w8 neuron-check`` measures it (``neuron_glue/microbench.py``) and writes :data:`DEFAULT_PATH` (or the
file ``$VLLM_MOE_W8_NEURON_CALIBRATION`` names), a JSON object with at least ``{"scenario": "fitted" | "documented"}``.
No file (the safe default): the ``fitted`` schedule, the one that is fastest under the pessimistic model
(ScalarE + GpSimd only). A file that cannot be read or names another scenario is an error naming the file.

``vector_blocks`` of every ``BLOCK_PERIOD`` blocks go to VectorE (a trace-time constant of the kernel).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

CALIBRATION_ENV = "VLLM_MOE_W8_NEURON_CALIBRATION"
DEFAULT_PATH = Path.home() / ".cache" / "vllm-moe-w8" / "neuron_calibration.json"
BLOCK_PERIOD = 32


@dataclass(frozen=True)
class Pow2Schedule:
    scenario: str  # the cost scenario it is fastest in
    vector_blocks: int  # of every BLOCK_PERIOD block scale-adds, how many run on VectorE
    source: str  # where the choice came from


# The split that minimises the modelled time of the served kernels in that scenario (cost model, LNC 2): fitted, no
# block on VectorE (it shares one lane with ScalarE); documented, 9 of 32 - against 10 of 32 (the former 5 of 16):
# GLM-5.3-Flash EP=32 dense T=128 557 vs 609 us, selective T=32 / 64 262 / 390 vs 275 / 413 us; Qwen3.5-35B-A3B EP=8
# dense T=128 274 vs 263 us, selective T=32 / 64 247 / 267 vs 239 / 259 us; block prefill 2k tokens 482 / 700 vs
# 471 / 675 us (Qwen / GLM): 3,177 vs 3,203 us summed. (Weights-stationary selective decode has no block scale-adds.)
SCHEDULES = {"fitted": 0, "documented": 9}


def calibration_path() -> Path:
    return Path(os.environ.get(CALIBRATION_ENV) or DEFAULT_PATH)


def load(path: Path | None = None) -> Pow2Schedule:
    """The schedule the calibration file selects, or the fitted one when there is no file."""
    path = calibration_path() if path is None else Path(path)
    if not path.exists():
        return Pow2Schedule("fitted", SCHEDULES["fitted"], f"default (no calibration file at {path})")
    try:
        record = json.loads(path.read_text())
        scenario = record["scenario"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"Neuron calibration file {path}: cannot read its 'scenario' ({type(exc).__name__}: {exc}); "
                         f"re-run `vllm-moe-w8 neuron-check` or delete the file to use the default schedule") from None
    if scenario not in SCHEDULES:
        raise ValueError(f"Neuron calibration file {path}: scenario {scenario!r} is not one of {sorted(SCHEDULES)}; "
                         "re-run `vllm-moe-w8 neuron-check` or delete the file")
    return Pow2Schedule(scenario, SCHEDULES[scenario], f"{path} (measured {record.get('measured_on', 'on an unknown host')})")


def on_vector(block: int, vector_blocks: int) -> bool:
    """Block ``block`` (counted within an expert) goes to VectorE: spreads ``vector_blocks`` per period evenly."""
    return (block * vector_blocks) % BLOCK_PERIOD + vector_blocks >= BLOCK_PERIOD
