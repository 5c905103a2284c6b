"""``nki.isa`` as the interpreter implements it (aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py``), Trn2
(NeuronCore-v3). The face only: each instruction family lives with its rules and their citations -

* data movement: :mod:`.dma` (``dma_copy``, ``dma_transpose``, ``dma_compute``), :mod:`.spmd` (``sendrecv``,
  ``core_barrier``), :mod:`.dynamic` (registers, dynamic access patterns);
* TensorE: :mod:`.tensor_engine` (``nc_matmul``, ``nc_transpose``);
* VectorE (and the ScalarE / GpSimdE variants): :mod:`.vector_engine`, :mod:`.vector_reduce`;
* ScalarE: :mod:`.scalar_engine` (``activation``, ``activate2``);
* GpSimdE: :mod:`.gpsimd` (``iota``, ``nonzero_with_count``).

Every instruction computes in float32 (or on integer bit patterns where its doc says so), casts to the destination
dtype, and is counted in the run's :class:`~.machine.Stats` for the cost model.
"""

from __future__ import annotations

from .dma import dma_compute, dma_copy, dma_transpose  # noqa: F401
from .dynamic import VirtualRegister, register_alloc, register_load, register_move, register_store  # noqa: F401
from .enums import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd  # noqa: F401
from .gpsimd import iota, local_gather, nonzero_with_count  # noqa: F401
from .rules import NkiValidationError  # noqa: F401
from .scalar_engine import activate2, activation, activation_reduce  # noqa: F401
from .spmd import core_barrier, sendrecv  # noqa: F401
from .tensor_engine import nc_matmul, nc_transpose  # noqa: F401
from .vector_engine import memset, scalar_tensor_tensor, tensor_copy, tensor_copy_predicated, tensor_scalar, tensor_tensor  # noqa: F401
from .vector_reduce import nc_stream_shuffle, reciprocal, tensor_reduce, tensor_tensor_scan  # noqa: F401

# deprecated engine constants ("use engine.tensor" ...)
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


def get_nc_version() -> nc_version:
    """The interpreter's target: Trn2, NeuronCore-v3 (``nc_version.gen3``)."""
    return nc_version.gen3


def get_nc_sub_version() -> int:
    return 0
