"""The cost model's constants, each with its source, and the published hardware figures they are fitted to.

Sources:

* ``AWS-ARCH``: AWS Neuron documentation, "Trainium/Inferentia2 Architecture Guide for NKI"
  (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/nki/trainium_inferentia2_arch.html):
  static instruction overhead ~100 engine cycles, VectorE and ScalarE cannot access PSUM in parallel, 16 DMA
  engines per core. Written for NeuronCore-v2; assumed to carry over to v3.
* ``AWS-TRN2``: AWS Trainium2 / NeuronCore-v3 documentation (chip HBM 2.9 TB/s over 8 physical cores, TensorE
  2.4 GHz, VectorE 0.96 GHz, ScalarE 1.2 GHz), as collected in ``/work/shared/docs/TRN2_NKI.md``.
* ``REF-CALL``: the reference implementation's per-call times (dstair/neuron-pytorch-native,
  ``contrib/qwen3.6-35b-a3b``, trn2.3xlarge TP=8 LNC=1, E=32 H=2048 I=512; eager, launch overhead included;
  torch 2.13, torch-neuronx 2.13.3, nki 0.7.0b1).
* ``REF-PROFILE``: its ``BENCHMARK.md``, "matched rank-0 Explorer result", 2 decoder layers, BS=32 full graph
  (device time, HBM reads, DMA bytes and transfers, DMA / GPSIMD active time, TensorE occupancy).
* ``fitted``: solved from the REF figures by :func:`.calibrate.fit` (the derivation is in that module); the
  values here are what ``fit()`` returns, and ``tests/test_cost_model.py`` checks they still are.
* ``AWS-V2-GUIDE`` / ``AWS-V3-GUIDE``: aws-neuron/aws-neuron-sdk ``nki/guides/architecture/trainium_inferentia2_arch.rst``
  and ``trainium2_arch.rst`` @fb4ce1062d8d4a6b688274d6dafaa29e58d115f4 (the sources of the "documented" scenario).

Two scenarios (:data:`SCENARIOS`), the same rules with different constants where AWS's documentation and the fit
disagree (see :class:`Scenario`):

* ``fitted`` - today's calibration: every matmul costs its moving columns plus a fitted fixed cost (616 cycles),
  VectorE and ScalarE run as one serial lane, two-input VectorE ops cost their free size.
* ``documented`` - AWS's figures: back-to-back matmuls issue every ``max(N, 64)`` cycles with the next stationary
  loaded in the background (AWS-V2-GUIDE, "MM_INIT_LATENCY"), VectorE and ScalarE read PSUM in parallel on
  NeuronCore-v3 (AWS-V3-GUIDE, "Data Movement Updates"), two-input VectorE instructions take ~2N cycles
  (AWS-V2-GUIDE, VectorE cost model). Constants AWS does not document (DMA rate and fixed cost, software
  descriptor generation, launch) are fitted to the same published figures under these rules.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Sourced:
    value: float
    unit: str
    source: str


HBM_BYTES_PER_S = Sourced(2.9e12 / 8, "B/s", "AWS-TRN2: 2.9 TB/s per chip shared by 8 physical cores (LNC=1)")
DMA_EFFICIENT_RUN_BYTES = Sourced(512, "B", "assumed: DMA runs shorter than 512 B move at the 512 B rate (roofline only)")
TENSOR_HZ = Sourced(2.4e9, "Hz", "AWS-TRN2: TensorE 2.4 GHz, one moving column per cycle (bf16/fp8)")
VECTOR_HZ = Sourced(0.96e9, "Hz", "AWS-TRN2: VectorE 0.96 GHz")
SCALAR_HZ = Sourced(1.2e9, "Hz", "AWS-TRN2: ScalarE 1.2 GHz")
GPSIMD_HZ = Sourced(1.2e9, "Hz", "AWS-V3-GUIDE: GpSimd 1.2 GHz; its width is not documented for v3 (v2: 8 processors x "
                                  "16 fp32 lanes), charged one element per partition per cycle: assumed")
DOCUMENTED_FIGURES = {"HBM_BYTES_PER_S": HBM_BYTES_PER_S, "DMA_EFFICIENT_RUN_BYTES": DMA_EFFICIENT_RUN_BYTES,
                      "TENSOR_HZ": TENSOR_HZ, "VECTOR_HZ": VECTOR_HZ, "SCALAR_HZ": SCALAR_HZ, "GPSIMD_HZ": GPSIMD_HZ}


@dataclass(frozen=True)
class Constants:
    """The calibrated constants (see ``SOURCES`` for where each comes from)."""

    dma_bytes_per_s: float  # effective DMA queue rate for bulk bytes
    dma_fixed_s: float  # DMA queue time per DMA instruction, independent of its size
    dge_per_dma_s: float  # GpSimd time per DMA instruction (software descriptor generation)
    matmul_fixed_cycles: float  # TensorE cycles per matmul/transpose beyond its moving columns
    instruction_overhead_cycles: float  # VectorE/ScalarE/GpSimdE static cycles per instruction
    launch_s: float  # eager launch overhead of one kernel call from PyTorch (host side)
    matmul_min_cycles: float = 0.0  # issue interval floor of a matmul/transpose (documented: 64)
    vector_two_input_factor: float = 1.0  # VectorE tensor_tensor cycles per free element (documented: 2)
    parallel_vector_scalar: bool = False  # VectorE and ScalarE as separate lanes (documented on v3) or one serial lane
    # runtime-dependent features (cost_dynamic.py): assumed in both scenarios, device measurements to replace them
    indirect_descriptor_s: float = 6.1960e-07 / 32  # GpSimd time per extra indexed row of a vector-offset DMA
    register_load_s: float = 3.6641e-07  # serial: one register load (sequencer waits on a 4-byte read)
    dynamic_iteration_s: float = 2e-6  # serial: one dynamic-loop iteration (exposed DMA latency + sync)

    def replace(self, **changes) -> "Constants":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return Constants(**values)


SOURCES = {
    "dma_bytes_per_s": "fitted: REF-PROFILE DMA active time vs DMA bytes and transfers of the two FP8 columns",
    "dma_fixed_s": "fitted: same two equations (the transfer-count difference, 27,962 vs 5,531, at equal bytes)",
    "dge_per_dma_s": "fitted: REF-PROFILE coalesced pow2 GPSIMD active time / DMA transfers",
    "matmul_fixed_cycles": "fitted: REF-PROFILE TensorE occupancy x device time of the two FP8 columns",
    "instruction_overhead_cycles": "AWS-ARCH: static instruction overhead of ~100 engine cycles (charged as each "
                                   "instruction's minimum)",
    "launch_s": "fitted: REF-CALL output-block B=128 (2.0 ms) minus the modelled kernel",
    "indirect_descriptor_s": "assumed: 1/32 of the fitted per-DMA software-DGE time (dge_per_dma_s) per extra indexed "
                             "row of a vector-offset DMA (AWS-V3-GUIDE: indirect DMA has only software DGE)",
    "register_load_s": "assumed: one fitted DMA fixed cost (dma_fixed_s) per register load",
    "dynamic_iteration_s": "assumed: exposed DMA latency per dynamic-loop iteration (2 x ~600 ns, AWS-V3-GUIDE) "
                           "+ ~0.8 us sequencer synchronisation",
}

# What fit() returns (checked by tests/test_cost_model.py; regenerate with benchmarks/bench_cost_model.py).
CALIBRATED = Constants(
    dma_bytes_per_s=2.2993e11,
    dma_fixed_s=3.6641e-07,
    dge_per_dma_s=6.1960e-07,
    matmul_fixed_cycles=616.17,
    instruction_overhead_cycles=100.0,
    launch_s=1.1318e-03,
)

DOCUMENTED_RULES = {"matmul_fixed_cycles": 0.0, "matmul_min_cycles": 64.0, "vector_two_input_factor": 2.0,
                    "parallel_vector_scalar": True}
DOCUMENTED_SOURCES = {
    **{k: v.replace("fitted:", "fitted (under the documented rules):") for k, v in SOURCES.items()},
    "matmul_fixed_cycles": "AWS-V2-GUIDE: background LoadStationary hides the stationary load; no fixed cost beyond the "
                           "issue interval",
    "matmul_min_cycles": "AWS-V2-GUIDE: back-to-back matmul initiation interval max(N, MM_INIT_LATENCY = 64 cycles)",
    "vector_two_input_factor": "AWS-V2-GUIDE: VectorE instructions with two input tiles take ~2N cycles (tensor_tensor)",
    "parallel_vector_scalar": "AWS-V3-GUIDE: VectorE and ScalarE access PSUM in parallel at full bandwidth on NeuronCore-v3",
}
SOURCES = {**SOURCES,
           "matmul_min_cycles": "fitted scenario: none (the fitted fixed cost covers issue and stationary load)",
           "vector_two_input_factor": "fitted scenario: tensor_tensor charged its free size (as calibrated)",
           "parallel_vector_scalar": "fitted scenario: AWS-ARCH (NeuronCore-v2): VectorE and ScalarE cannot access "
                                     "PSUM in parallel; one serial lane"}

# What fit(DOCUMENTED_RULES) returns (checked by tests/test_cost_model.py).
CALIBRATED_DOCUMENTED = Constants(
    dma_bytes_per_s=2.2993e11,
    dma_fixed_s=3.6641e-07,
    dge_per_dma_s=6.1960e-07,
    matmul_fixed_cycles=0.0,
    instruction_overhead_cycles=100.0,
    launch_s=1.1318e-03,
    **{k: v for k, v in DOCUMENTED_RULES.items() if k != "matmul_fixed_cycles"},
)


@dataclass(frozen=True)
class Scenario:
    """One set of cost-model constants with the source of each (``fitted`` or ``documented``)."""

    name: str
    constants: Constants
    sources: dict
    rules: dict  # the constants held fixed (not fitted) in this scenario


FITTED = Scenario("fitted", CALIBRATED, SOURCES, {})
DOCUMENTED = Scenario("documented", CALIBRATED_DOCUMENTED, DOCUMENTED_SOURCES, DOCUMENTED_RULES)
SCENARIOS = {s.name: s for s in (FITTED, DOCUMENTED)}

BAND = 0.30  # each modelled figure within 30 % of the published one (the target)


@dataclass(frozen=True)
class Published:
    figure: str  # device_s, call_s, hbm_read_bytes, dma_bytes, dma_transfers, dma_active_s, gpsimd_s, tensor_occupancy
    kernel: str  # a reference_dataflows.KERNELS name
    tokens: int
    value: float
    source: str


def _profile(kernel: str, device_ms, hbm_mb, dma_mb, transfers, dma_ms, gpsimd_ms, occupancy_pct) -> list[Published]:
    return [Published("device_s", kernel, 32, device_ms * 1e-3, "REF-PROFILE"),
            Published("hbm_read_bytes", kernel, 32, hbm_mb * 1e6, "REF-PROFILE"),
            Published("dma_bytes", kernel, 32, dma_mb * 1e6, "REF-PROFILE"),
            Published("dma_transfers", kernel, 32, transfers, "REF-PROFILE"),
            Published("dma_active_s", kernel, 32, dma_ms * 1e-3, "REF-PROFILE"),
            Published("gpsimd_s", kernel, 32, gpsimd_ms * 1e-3, "REF-PROFILE"),
            Published("tensor_occupancy", kernel, 32, occupancy_pct / 100, "REF-PROFILE")]


PROFILE_LAYERS = 2
REFERENCE_SHAPE = {"E": 32, "H": 2048, "I": 512}
PUBLISHED: list[Published] = [
    Published("call_s", "coalesced_pow2", 32, 3.4e-3, "REF-CALL"),
    Published("call_s", "coalesced_pow2", 64, 3.6e-3, "REF-CALL"),
    Published("call_s", "coalesced_pow2", 128, 4.0e-3, "REF-CALL"),
    Published("call_s", "coalesced_output_block", 128, 2.0e-3, "REF-CALL"),
    *_profile("bf16", 6.366, 589.2, 622.2, 3548, 3.741, 2.223, 45.8),
    *_profile("first_pow2", 23.761, 395.6, 428.9, 27962, 12.111, 17.676, 18.0),
    *_profile("coalesced_pow2", 9.563, 395.6, 428.9, 5531, 3.892, 3.427, 25.48),
]


def published(figure: str, kernel: str, tokens: int = 32) -> float:
    for p in PUBLISHED:
        if (p.figure, p.kernel, p.tokens) == (figure, kernel, tokens):
            return p.value
    raise KeyError(f"no published figure {figure!r} for kernel {kernel!r} at T={tokens}")
