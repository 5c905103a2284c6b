"""Cost of the runtime-dependent features (:mod:`.dynamic`): indirect DMA descriptor generation, register loads
and dynamic-loop iterations. Kept apart from :mod:`.cost`'s static rules and :mod:`.calibration`'s fitted
constants; :func:`.cost.estimate` adds these terms (GpSimd lane and a serial control term). The three constants are
:class:`.calibration.Constants` fields (``indirect_descriptor_s``, ``register_load_s``, ``dynamic_iteration_s``),
the same assumed values in both scenarios, with their sources in each scenario's ``sources``.

* **Software DGE per indirect DMA** (``indirect_descriptor_s``): the Trn2 architecture guide
  (aws-neuron-sdk ``nki/guides/architecture/trainium2_arch.rst``, summarised in docs/TRN2_NKI.md) says indirect
  DMA has no hardware-DGE path: its descriptors are written by software DGE on GpSimd. Every DMA already pays
  the fitted ``dge_per_dma_s`` (fitted on the reference kernels' static 128-partition transfers); a vector-offset
  DMA also resolves one index per partition row into an address, each row beyond the first charged
  ``indirect_descriptor_s``. Value assumed: 1/32 of the fitted per-DMA figure per row (a 128-row gather ~5x a
  static DMA's descriptor time) - a device measurement.
* **Register load** (``register_load_s``): a 4-byte read the engine sequencer waits for before it can branch or
  form an address; assumed equal to the fitted fixed cost of one DMA (``calibration.CALIBRATED.dma_fixed_s``).
* **Dynamic-loop iteration** (``dynamic_iteration_s``): the compiler cannot software-pipeline across a dynamic
  loop's back-edge, so each iteration exposes one DMA latency before its first matmul plus the sequencers' branch
  and semaphore round; assumed 2 us (hardware-DGE DMA latency ~600 ns per the Trn2 guide, x2 for the dependent
  index then weight loads, plus ~0.8 us of synchronisation) - a device measurement.

Register loads and loop overhead stall every engine (serial ``control_s``); descriptor generation occupies GpSimd.
A DMA whose rows (or whole transfer) ``oob_mode.skip`` drops moves no bytes for them but still pays its fixed cost,
its software-DGE time and every row's descriptor (assumed: the index is resolved before the bounds check; the API
says only that the transfer is skipped).
"""

from __future__ import annotations

from . import calibration as cal
from .machine import Stats

CONSTANT_NAMES = ("indirect_descriptor_s", "register_load_s", "dynamic_iteration_s")


def descriptor_seconds(stats: Stats, c: cal.Constants = cal.CALIBRATED) -> float:
    """GpSimd time writing the extra descriptors of vector-offset (gather/scatter) DMAs."""
    extra = sum(n * (desc - 1) for (_kind, desc), n in stats.indirect_dmas.items())
    return extra * c.indirect_descriptor_s


def control_seconds(stats: Stats, c: cal.Constants = cal.CALIBRATED) -> float:
    """Serial time: register loads and dynamic-loop iterations (no engine overlaps them)."""
    return stats.register_loads * c.register_load_s + stats.dynamic_iterations * c.dynamic_iteration_s
