"""A CPU interpreter for the subset of NKI (``nki``, ``nki.language``, ``nki.isa``) this project's kernels use.

No machine here can install AWS's ``nki`` / ``neuronx-cc``, so the kernels in ``vllm_moe_w8.kernels`` are
executed by this interpreter instead: the kernels' own source runs, with ``nl`` / ``nisa`` bound to
:mod:`.language` / :mod:`.isa` (see ``vllm_moe_w8.kernels.nki_api``). Numerics are numpy float32 with
FP8/BF16 storage from ml_dtypes. It enforces what Trn2 enforces (partition dim <= 128; nc_matmul shape,
dtype and PSUM rules; ``accumulate=True`` only after an initialising matmul; PSUM 8 x 2 KiB banks and SBUF
224 KiB per partition; DMA dtype matching; no reads of never-written memory; arithmetic operators only;
no tensor_scalar on GpSimdE; GpSimdE never touches PSUM), refuses NKI arguments it does not model instead of ignoring them, checks a
kernel's source against the traced Python subset (:mod:`.subset`), and counts what a kernel does
(:class:`Stats`), which :mod:`.cost` turns into an estimated NeuronCore-v3 time. docs/trainium2-kernels.md lists every rule
with where it is enforced and the test that breaks it.

What it does not model: instruction scheduling and engine concurrency (the cost model assumes perfect
overlap), DMA queues, the compiler's buffer rotation, hardware activation-function approximations, and
FP8 subnormal handling in TensorE (assumed IEEE-like; a device check).
"""

from . import isa, language
from .machine import NkiValidationError, Stats, Tensor
from .runtime import Kernel, jit, launch, run, simulate

__all__ = ["isa", "language", "NkiValidationError", "Stats", "Tensor", "Kernel", "jit", "launch", "run", "simulate"]
