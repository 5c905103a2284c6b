"""Cost model: a run's :class:`~.machine.Stats` -> estimated time on one NeuronCore-v3 (Trn2).

The constants live in :mod:`.calibration`, each with its source (AWS documentation, the published profile of
the reference implementation, or "fitted" by :mod:`.calibrate`); docs/cost-model.md lists them
beside the published figures they reproduce. The rules:

* **DMA queues** (``dma_s``, Explorer's "DMA active time"): bytes at the effective DMA rate plus a fixed
  cost per DMA instruction (``dma_copy``); small transfers are dominated by the fixed cost.
  ``hbm_s`` is the plain HBM time (bytes at one physical core's share of 2.9 TB/s, runs shorter than 512 B
  charged as 512 B) - the roofline, never above ``dma_s`` for the kernels here.
* **GpSimdE** (``gpsimd_s``): its own instructions plus the software descriptor generation of every DMA
  (``dge_s``): kernel-issued DMAs have their descriptors written by GpSimd - except those issued with
  ``dge_mode=hwdge`` (``Stats.hwdge_dmas``), whose descriptors the hardware DGE writes ("Sync Engine or Scalar Engine
  sequencers invoke DGE hardware block to generate DMA descriptors", aws-neuron-sdk @81ce03ae
  ``nki/api/nki/isa/__init__.py``).
* **TensorE** at 2.4 GHz streams one moving column per cycle (bf16/fp8; fp32 takes 4 passes) plus a fixed
  cost per matmul/transpose (issue, stationary load, PE-array fill and drain).
* **VectorE / ScalarE / GpSimdE**: free elements per partition (2x for scalar_tensor_tensor), at least the
  static per-instruction overhead (an instruction with little work costs the overhead; on wide instructions
  AWS documents it as hidden). They share PSUM (they cannot access it in parallel) and the kernels here chain
  them (PSUM evacuation on one feeds the other), so their times add.
* **Overlap**: DMA queues, GpSimd, TensorE and the Vector+Scalar chain run concurrently:
  ``time_s = max(dma, hbm, gpsimd, tensor, vector + scalar)``; ``serial_s`` is the no-overlap bound.
* **Scenarios** (:data:`.calibration.SCENARIOS`): ``fitted`` is the above; ``documented`` takes AWS's figures where
  they contradict the fit: a matmul costs ``max(N, 64)`` cycles (no fixed cost: background stationary load),
  VectorE and ScalarE are separate lanes (``time_s = max(dma, hbm, gpsimd, tensor, vector, scalar)``), and
  VectorE ``tensor_tensor`` costs 2 cycles per free element. ``estimate(stats, scenario)`` takes either.
* **Dynamic features** (:mod:`.cost_dynamic`): extra software-DGE descriptors of vector-offset DMAs on GpSimd;
  register loads and dynamic-loop iterations as a serial ``control_s`` added to the overlapped time
  (``time_s = max(lanes) + control_s``); their constants are :class:`~.calibration.Constants` fields (assumed).
* **Launch**: an eager call from PyTorch adds ``launch_s`` (host dispatch, not device time); a kernel inside a
  compiled graph pays none. ``call_s = time_s + launch_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import calibration as cal
from . import cost_dynamic
from .machine import Stats

# Backward-compatible names (the figures behind them are in calibration.py).
HBM_BYTES_PER_S = cal.HBM_BYTES_PER_S.value
DMA_EFFICIENT_RUN_BYTES = cal.DMA_EFFICIENT_RUN_BYTES.value
TENSOR_HZ = cal.TENSOR_HZ.value
VECTOR_HZ = cal.VECTOR_HZ.value
SCALAR_HZ = cal.SCALAR_HZ.value
GPSIMD_HZ = cal.GPSIMD_HZ.value
MIN_II_CYCLES = 64
FP32_MATMUL_PASSES = 4
ENGINE_HZ = {"vector": VECTOR_HZ, "scalar": SCALAR_HZ, "gpsimd": GPSIMD_HZ}


@dataclass
class Estimate:
    hbm_s: float
    tensor_s: float
    vector_s: float
    scalar_s: float
    gpsimd_s: float
    dma_s: float = 0.0  # DMA queue busy time (bytes + per-DMA fixed cost)
    dge_s: float = 0.0  # part of gpsimd_s: descriptor generation for the DMAs
    launch_s: float = 0.0  # eager launch overhead (host), not part of time_s
    dma_count: int = 0
    control_s: float = 0.0  # serial: register loads + dynamic-loop iterations (cost_dynamic.py)
    parallel_vector_scalar: bool = False  # the scenario's rule: VectorE and ScalarE as separate lanes
    scenario: str = "fitted"

    @property
    def engines(self) -> dict[str, float]:
        return {"hbm": self.hbm_s, "dma": self.dma_s, "tensor": self.tensor_s, "vector": self.vector_s,
                "scalar": self.scalar_s, "gpsimd": self.gpsimd_s}

    @property
    def lanes(self) -> dict[str, float]:
        """What runs concurrently. Fitted: VectorE and ScalarE form one serial lane (shared PSUM port, chained work);
        documented: they are separate lanes."""
        if self.parallel_vector_scalar:
            return {"hbm": self.hbm_s, "dma": self.dma_s, "tensor": self.tensor_s, "vector": self.vector_s,
                    "scalar": self.scalar_s, "gpsimd": self.gpsimd_s}
        return {"hbm": self.hbm_s, "dma": self.dma_s, "tensor": self.tensor_s, "vector+scalar": self.vector_s + self.scalar_s,
                "gpsimd": self.gpsimd_s}

    @property
    def time_s(self) -> float:
        """Modelled device time of the kernel (concurrent lanes, then the serial control term)."""
        return max(self.lanes.values()) + self.control_s

    @property
    def call_s(self) -> float:
        """Modelled time of one eager call (device time + launch overhead)."""
        return self.time_s + self.launch_s

    @property
    def serial_s(self) -> float:
        return sum(v for k, v in self.engines.items() if k != "hbm")

    @property
    def bound_by(self) -> str:
        return max(self.lanes, key=self.lanes.get)


def _passes(dtype_name: str) -> int:
    return FP32_MATMUL_PASSES if dtype_name in ("float32", "tfloat32") else 1


def hbm_seconds(stats: Stats) -> float:
    return sum(nbytes / min(1.0, run / DMA_EFFICIENT_RUN_BYTES) for run, nbytes in stats.dma_runs.items()) / HBM_BYTES_PER_S


def constants_of(c: "cal.Constants | cal.Scenario") -> cal.Constants:
    """The constants of a scenario (a bare :class:`~.calibration.Constants` is taken as is)."""
    return c.constants if isinstance(c, cal.Scenario) else c


def dma_seconds(stats: Stats, c: cal.Constants = cal.CALIBRATED) -> float:
    c = constants_of(c)
    nbytes = sum(stats.dma_runs.values())
    return nbytes / c.dma_bytes_per_s + stats.dma_count * c.dma_fixed_s


def matmul_cycles(n: int, passes: int, c: cal.Constants = cal.CALIBRATED) -> float:
    """TensorE cycles of one matmul/transpose streaming ``n`` moving columns ``passes`` times."""
    c = constants_of(c)
    return max(n * passes + c.matmul_fixed_cycles, c.matmul_min_cycles)


def tensor_cycles(stats: Stats, c: cal.Constants = cal.CALIBRATED) -> float:
    c = constants_of(c)
    cycles = 0.0
    for (_k, _m, n, st, mv), count in stats.matmuls.items():
        cycles += count * matmul_cycles(n, max(_passes(st), _passes(mv)), c)
    for (p, _f, dtype), count in stats.transposes.items():
        cycles += count * matmul_cycles(p, _passes(dtype), c)
    return cycles


def instruction_cycles(engine: str, op: str, free: int, c: cal.Constants = cal.CALIBRATED) -> float:
    """Cycles of one VectorE/ScalarE/GpSimdE instruction over ``free`` elements per partition."""
    c = constants_of(c)
    if op == "scalar_tensor_tensor":
        work = 2 * free
    elif op in ("tensor_tensor", "tensor_tensor_scan") and engine == "vector":
        work = c.vector_two_input_factor * free
    else:
        work = free
    return max(work, c.instruction_overhead_cycles)


def engine_cycles(stats: Stats, engine: str, c: cal.Constants = cal.CALIBRATED) -> float:
    c = constants_of(c)
    cycles = 0.0
    for (eng, op, _p, free), count in stats.engine_ops.items():
        if eng == engine:
            cycles += count * instruction_cycles(eng, op, free, c)
    return cycles


def estimate(stats: Stats, c: "cal.Constants | cal.Scenario" = cal.FITTED) -> Estimate:
    """Modelled NeuronCore-v3 time of one kernel run under a scenario (see the module docstring for the rules)."""
    name = c.name if isinstance(c, cal.Scenario) else "custom"
    c = constants_of(c)
    dge = (stats.dma_count - stats.hwdge_dmas) * c.dge_per_dma_s + cost_dynamic.descriptor_seconds(stats, c)
    return Estimate(
        hbm_s=hbm_seconds(stats),
        tensor_s=tensor_cycles(stats, c) / TENSOR_HZ,
        vector_s=engine_cycles(stats, "vector", c) / VECTOR_HZ,
        scalar_s=engine_cycles(stats, "scalar", c) / SCALAR_HZ,
        gpsimd_s=engine_cycles(stats, "gpsimd", c) / GPSIMD_HZ + dge,
        dma_s=dma_seconds(stats, c),
        dge_s=dge,
        launch_s=c.launch_s,
        dma_count=stats.dma_count,
        control_s=cost_dynamic.control_seconds(stats, c),
        parallel_vector_scalar=c.parallel_vector_scalar,
        scenario=name,
    )
