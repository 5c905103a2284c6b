"""``wrap_nki`` for the project's NKI interpreter: the same calling convention and the same graph shape as
vllm-neuron's, so that ``torch.compile(fullgraph=True)`` traces our forward on CPU as it will on Trainium.

vllm-neuron's ``wrap_nki(kernel)`` (Infinity-AI-Institute/vllm-neuron ``vllm_neuron/nki/nki_hop.py`` @6f4bf2d8)
returns a caller; ``caller[grid](*args, **kwargs)`` binds the arguments to the kernel's parameter names,
keeps the tensors as graph inputs, hashes the other arguments as trace-time constants and emits one opaque
``nki_kernel_wrapper`` node; under fake tensors its output shapes come from compiling the kernel (or, in its
CPU simulator mode, from simulating it on ones). Here:

* :func:`wrap_nki` ``(kernel, output)`` -> :class:`Caller`; ``caller[grid](*tensors, **constants)`` -> one call
  of the torch custom op ``moe_w8::nki_interpreted(kernel, grid, tensors, constants)`` (one opaque node; the
  constants are one JSON string, a constant of the graph);
* its fake (meta) implementation gives the output's shape from ``output(tensors, grid)``, the kernel's declared
  launch contract (``kernel_launch.KERNELS``), since the interpreter cannot run on fake tensors;
* executed, it runs ``kernels.nki_cpu.launch(kernel, (grid,), ..., lnc=grid)`` (one interpreted kernel at a
  time: the interpreter keeps process-wide state) and returns the output on the first tensor's device.

The interpreter's per-program counters go to :func:`collect_stats`'s list while it is open (eager callers).
"""

from __future__ import annotations

import contextlib
import json
import threading

import numpy as np
import torch

_KERNELS: dict[str, tuple[object, object]] = {}  # name -> (kernel, output(tensors, grid) -> (shape, dtype))
_RUN_LOCK = threading.Lock()
_stats: list = []  # open collect_stats() lists (process-wide: the op may run on any thread)


class Caller:
    """``wrap_nki(kernel)``: index with the grid, then call with the tensors and the constants."""

    def __init__(self, name: str, grid: int | None = None):
        self.name, self.grid = name, grid

    def __getitem__(self, grid) -> "Caller":
        grid = grid if isinstance(grid, int) else tuple(grid)[0]
        return Caller(self.name, int(grid))

    def __call__(self, *tensors: torch.Tensor, **constants) -> torch.Tensor:
        if self.grid is None:
            raise TypeError(f"wrap_nki({self.name}): launch as caller[grid](...) (grid = LNC)")
        return torch.ops.moe_w8.nki_interpreted(self.name, self.grid, list(tensors), encode_constants(constants))


@torch._dynamo.assume_constant_result
def encode_constants(constants: dict) -> str:
    """The launch's constants as one string, evaluated at trace time (a constant of the graph, as vllm-neuron
    hashes its kernel's non-tensor arguments into one constant key)."""
    return json.dumps(constants, sort_keys=True)


def wrap_nki(kernel, output) -> Caller:
    """Register ``kernel`` (once, by name) with its output contract; return its caller."""
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "func", None), "__name__")
    known = _KERNELS.get(name)
    if known is not None and known[0] is not kernel:
        raise ValueError(f"wrap_nki: two different kernels named {name!r}")
    _KERNELS[name] = (kernel, output)
    return Caller(name)


@contextlib.contextmanager
def collect_stats(sink: list):
    """Append each interpreted launch's per-program :class:`nki_cpu.Stats` list to ``sink`` while open."""
    _stats.append(sink)
    try:
        yield sink
    finally:
        _stats.remove(sink)


def numpy_of(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@torch.library.custom_op("moe_w8::nki_interpreted", mutates_args=())
def nki_interpreted(kernel: str, grid: int, tensors: list[torch.Tensor], constants: str) -> torch.Tensor:
    """One kernel launch ``kernel[grid](*tensors, **constants)`` in the project's NKI interpreter."""
    from vllm_moe_w8.kernels import nki_cpu

    fn, _ = _KERNELS[kernel]
    with _RUN_LOCK:
        out, program_stats = nki_cpu.launch(fn, (grid,), *[numpy_of(t) for t in tensors], lnc=grid, **json.loads(constants))
        for sink in _stats:
            sink.append(program_stats)
    return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(tensors[0].device)


@nki_interpreted.register_fake
def _nki_interpreted_fake(kernel, grid, tensors, constants):
    _, output = _KERNELS[kernel]
    shape, dtype = output(tensors, grid)
    return tensors[0].new_empty(shape, dtype=dtype)
