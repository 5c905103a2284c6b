"""Non-expert FP8 tensors reach vllm-neuron's loaders dequantised, on every thread of the load.

vllm-neuron's ``SafetensorsCheckpoint.load_sharded_pipelined`` (Infinity-AI-Institute/vllm-neuron
``utils/checkpoints.py`` @cd76a78) indexes the checkpoint lazily, shard by shard, and hands each parameter to
a ``ThreadPoolExecutor(4)`` as soon as its own keys are indexed; ``_process_param`` then calls ``_get_slice``
on a worker thread and casts the result to the parameter's dtype. A plain cast of FP8 bytes drops their
scales, so :func:`install` wraps ``_get_slice`` once: while a neuron-w8 load is active (:func:`active`, for
the whole duration of neuron-w8's ``load_weights``, **process-wide**, not per thread) an FP8 ``.weight``
comes back as a :class:`DequantizedSlice`.

The scale is read from the checkpoint's *own* index (``codec.checkpoint.Checkpoint``: the index file and every
shard header, read before the load starts), never through the loader's partial index: the weight's
``weight_scale_inv`` may sit in a shard the loader has not indexed yet.

Which active load a call belongs to: the shard file the loader found the weight in (its
``_tensor_name_to_file``) names the checkpoint folder; with one active load (the usual case: one model per
process) that load.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.codec.checkpoint import Checkpoint, CheckpointError

HOOKED = "_neuron_w8_dequantizing"
FP8_DTYPE = "F8_E4M3"


class DequantizedSlice:
    """A stand-in for safetensors' PySafeSlice of an FP8 weight: indexes the weight dequantised to ``dtype``."""

    def __init__(self, weight_slice, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, name: str):
        self._weight_slice, self._scale, self._block, self._dtype, self._name = weight_slice, scale, block, dtype, name
        self._full: torch.Tensor | None = None

    def get_shape(self):
        return self._weight_slice.get_shape()

    def get_dtype(self) -> str:
        return {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[self._dtype]

    def full(self) -> torch.Tensor:
        if self._full is None:
            w = self._weight_slice[:]
            self._full = fp8.dequantize_checkpoint(w, self._scale, self._block, name=self._name).to(self._dtype)
        return self._full

    def __getitem__(self, index):
        return self.full()[index]


@dataclass(frozen=True)
class ActiveLoad:
    """One neuron-w8 ``load_weights`` in progress: its checkpoint (own index), format and target dtype."""

    reader: Checkpoint
    fmt: object  # vllm_glue.checkpoint_format.CheckpointFormat (linear_block, linear_scale_suffix)
    dtype: torch.dtype

    @property
    def directory(self) -> str:
        return os.path.realpath(str(self.reader.path))


class ActiveLoads:
    """The loads in progress in this process, seen by every thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loads: dict[int, ActiveLoad] = {}
        self._next = 0

    def enter(self, load: ActiveLoad) -> int:
        with self._lock:
            self._next += 1
            self._loads[self._next] = load
            return self._next

    def exit(self, token: int) -> None:
        with self._lock:
            self._loads.pop(token, None)

    def find(self, checkpoint, key: str) -> ActiveLoad | None:
        """The active load ``checkpoint._get_slice(key)`` belongs to, or None (no neuron-w8 load running)."""
        with self._lock:
            loads = list(self._loads.values())
        if not loads:
            return None
        where = getattr(checkpoint, "_tensor_name_to_file", None) or {}
        path = where.get(key) if isinstance(where, dict) else None
        if path is not None:
            folder = os.path.realpath(os.path.dirname(str(path)))
            for ld in loads:
                if ld.directory == folder:
                    return ld
        folders = {ld.directory for ld in loads}
        if len(folders) == 1:
            return loads[0]
        raise CheckpointError(
            f"neuron-w8: FP8 tensor {key!r}: {len(folders)} neuron-w8 loads run in this process ({sorted(folders)}) and "
            "the loader does not say which checkpoint this tensor comes from; load one model at a time"
        )


ACTIVE = ActiveLoads()


def read_scale(load: ActiveLoad, checkpoint, scale_key: str, get_slice) -> torch.Tensor:
    """The scale tensor, from the checkpoint's own index (``checkpoint`` / ``get_slice``: the loader's, unused)."""
    if scale_key not in load.reader.tensors:
        raise KeyError(f"not in {load.reader.index_path or load.reader.path}")
    return load.reader.load(scale_key)


@contextlib.contextmanager
def active(checkpoint_cls, reader: Checkpoint, fmt, dtype: torch.dtype):
    """While active (on every thread), ``checkpoint_cls._get_slice(key)`` of an FP8 weight is dequantised."""
    install(checkpoint_cls)
    token = ACTIVE.enter(ActiveLoad(reader, fmt, dtype))
    try:
        yield
    finally:
        ACTIVE.exit(token)


def install(checkpoint_cls) -> None:
    """Wrap ``checkpoint_cls._get_slice`` once (outside an active load it behaves as before)."""
    original = checkpoint_cls.__dict__["_get_slice"]
    if getattr(original, HOOKED, False):
        return

    def _get_slice(self, key):
        sl = original(self, key)
        if _slice_dtype(sl) != FP8_DTYPE:
            return sl
        load = ACTIVE.find(self, key)
        if load is None:
            return sl
        if not key.endswith(".weight"):
            raise CheckpointError(f"neuron-w8: FP8 tensor {key!r} is not a '.weight'; cannot find its scale")
        suffix = load.fmt.linear_scale_suffix
        scale_key = f"{key[: -len('weight')]}{suffix}"
        try:
            scale = read_scale(load, self, scale_key, original)
        except (KeyError, AttributeError, RuntimeError, CheckpointError) as e:
            raise CheckpointError(f"neuron-w8: FP8 tensor {key!r} has no {suffix} ({e}); cannot dequantise it") from e
        return DequantizedSlice(sl, scale, tuple(load.fmt.linear_block), load.dtype, key)

    setattr(_get_slice, HOOKED, True)
    checkpoint_cls._get_slice = _get_slice


def _slice_dtype(sl) -> str | None:
    get = getattr(sl, "get_dtype", None)
    return get() if callable(get) else None
