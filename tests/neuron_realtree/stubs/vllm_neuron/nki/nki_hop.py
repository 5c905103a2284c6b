"""STUB (real-tree mode, tests only): replaces ``vllm_neuron/nki/nki_hop.py`` (the ``wrap_nki`` higher-order op that
lowers NKI kernels in vllm-neuron's compile backend: needs Neuron hardware). ``can_run_kernel(t)`` is what it is on a
host without a Neuron device: false for every CPU/meta tensor, so the read files take their torch branches;
``wrap_nki(kernel)[grid](...)`` raises, naming the kernel (a kernel launch here would be a stub pretending)."""

from _placeholder import NeuronOnly


def can_run_kernel(*tensors) -> bool:
    return any(getattr(t, "device", None) is not None and t.device.type not in ("cpu", "meta") for t in tensors)


class _Caller:
    def __init__(self, kernel):
        self._kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise NeuronOnly(f"wrap_nki({getattr(self._kernel, '__name__', self._kernel)!r})[{grid}] needs Neuron hardware")

        return launch


def wrap_nki(kernel):
    return _Caller(kernel)
