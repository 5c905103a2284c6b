"""A CPU interpreter of NKI (``nki``, ``nki.language``, ``nki.isa``) for Trn2 / NeuronCore-v3, whose semantics come
from AWS's NKI documentation rule by rule (aws-neuron/aws-neuron-sdk @81ce03ae; every rule with its file and sentence
in :data:`rules.RULES`, listed in docs/nki-interpreter.md) and whose acceptance test is AWS's own kernels run unmodified
(``benchmarks/aws_differential``).

The kernels in ``vllm_moe_w8.kernels`` run here instead of on a device: their own source executes with ``nl`` /
``nisa`` bound to :mod:`.language` / :mod:`.isa` (see ``vllm_moe_w8.kernels.nki_api``). Numerics are numpy float32 with
BF16/FP16/FP8 storage from ml_dtypes. One module per instruction family holds its rules: :mod:`.dma`, :mod:`.spmd`,
:mod:`.dynamic`, :mod:`.tensor_engine`, :mod:`.vector_engine`, :mod:`.vector_reduce`, :mod:`.scalar_engine`,
:mod:`.gpsimd`; memory and views: :mod:`.machine`, :mod:`.tensor`; the traced Python subset: :mod:`.subset`. It counts
what a kernel does (:class:`Stats`), which :mod:`.cost` turns into an estimated NeuronCore-v3 time.

What it does not model (docs/nki-interpreter.md, "What may still differ on hardware"): instruction scheduling and
engine concurrency (the cost model assumes perfect overlap), DMA queues, the compiler's buffer rotation, ScalarE's
piece-wise polynomial approximations (exact float32 here; :func:`scalar_engine.perturbed` bounds their effect),
FP8 subnormals in TensorE, the float32/tfloat32 matmul passes, and anything the docs leave unspecified (named there).
"""

from . import isa, language
from .rules import RULES, NkiValidationError
from .machine import Stats
from .runtime import Kernel, jit, launch, run, simulate
from .scalar_engine import perturbed
from .tensor import Tensor
from .dtypes import Dtype as dtype  # nki.dtype (the type of nl.float32 ...)

__all__ = ["isa", "language", "NkiValidationError", "RULES", "Stats", "Tensor", "Kernel", "jit", "launch", "run",
           "simulate", "perturbed"]
