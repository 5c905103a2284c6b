"""Cost model: a run's :class:`~.machine.Stats` -> estimated time on one NeuronCore-v3 (Trn2).

Assumptions (stated, not measured; the first hardware run calibrates them):

* HBM: a physical core's share of the chip's 2.9 TB/s (8 physical cores, LNC=1): 362.5 GB/s. A DMA
  whose contiguous HBM runs are shorter than 512 B is charged as if each run moved 512 B (descriptor
  efficiency); DMA fixed latency is assumed hidden by the 16 DMA queues.
* TensorE at 2.4 GHz streams one moving column per cycle for bf16/fp16/fp8 operands (bf16 x fp8 runs at
  the BF16 rate; FP8 double-row mode is not used); fp32/tf32 operands take 4 passes. An instruction
  costs max(N, 64) cycles (64 = minimum initiation interval); loading the stationary operand is
  assumed hidden behind the previous instruction. nc_transpose is a matmul with N = input partitions.
* VectorE 0.96 GHz, ScalarE 1.2 GHz, GpSimdE 1.2 GHz (assumed equal to ScalarE): max(N, 64) cycles per
  instruction with N the free elements per partition; scalar_tensor_tensor costs 2N on VectorE
  (NKI ISA documentation).
* Engines and DMA overlap perfectly (NKI schedules them concurrently given enough buffering):
  ``time_s = max(hbm, tensor, vector, scalar, gpsimd)``. ``serial_s`` (their sum) is the bound with no
  overlap at all. Kernel launch overhead is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from .machine import Stats

HBM_BYTES_PER_S = 2.9e12 / 8
DMA_EFFICIENT_RUN_BYTES = 512
TENSOR_HZ = 2.4e9
VECTOR_HZ = 0.96e9
SCALAR_HZ = 1.2e9
GPSIMD_HZ = 1.2e9
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

    @property
    def engines(self) -> dict[str, float]:
        return {"hbm": self.hbm_s, "tensor": self.tensor_s, "vector": self.vector_s, "scalar": self.scalar_s, "gpsimd": self.gpsimd_s}

    @property
    def time_s(self) -> float:
        return max(self.engines.values())

    @property
    def serial_s(self) -> float:
        return sum(self.engines.values())

    @property
    def bound_by(self) -> str:
        return max(self.engines, key=self.engines.get)


def _passes(dtype_name: str) -> int:
    return FP32_MATMUL_PASSES if dtype_name in ("float32", "tfloat32") else 1


def hbm_seconds(stats: Stats) -> float:
    return sum(nbytes / min(1.0, run / DMA_EFFICIENT_RUN_BYTES) for run, nbytes in stats.dma_runs.items()) / HBM_BYTES_PER_S


def tensor_cycles(stats: Stats) -> int:
    cycles = 0
    for (_k, _m, n, st, mv), count in stats.matmuls.items():
        cycles += count * max(n, MIN_II_CYCLES) * max(_passes(st), _passes(mv))
    for (p, _f, dtype), count in stats.transposes.items():
        cycles += count * max(p, MIN_II_CYCLES) * _passes(dtype)
    return cycles


def engine_cycles(stats: Stats, engine: str) -> int:
    cycles = 0
    for (eng, op, _p, free), count in stats.engine_ops.items():
        if eng == engine:
            work = 2 * free if op == "scalar_tensor_tensor" else free
            cycles += count * max(work, MIN_II_CYCLES)
    return cycles


def estimate(stats: Stats) -> Estimate:
    return Estimate(
        hbm_s=hbm_seconds(stats),
        tensor_s=tensor_cycles(stats) / TENSOR_HZ,
        vector_s=engine_cycles(stats, "vector") / VECTOR_HZ,
        scalar_s=engine_cycles(stats, "scalar") / SCALAR_HZ,
        gpsimd_s=engine_cycles(stats, "gpsimd") / GPSIMD_HZ,
    )
