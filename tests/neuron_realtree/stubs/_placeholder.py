"""STUB helper (real-tree mode, tests only): names that stand for Neuron-only objects.

``Placeholder(name)`` is what an attribute of a stubbed Neuron package evaluates to: it can be passed around at
import time (a dtype in a default argument, an enum member in a table), and any call on it raises, naming it, so a
code path that would need Neuron hardware fails loudly instead of pretending."""


class NeuronOnly(RuntimeError):
    """A stubbed Neuron-only object was used: this code path needs Neuron hardware."""


class Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return f"<stub {self._name}>"

    def __getattr__(self, item: str) -> "Placeholder":
        if item.startswith("__"):
            raise AttributeError(item)
        return Placeholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise NeuronOnly(f"{self._name} is Neuron-only (stubbed in the real-tree mode: tests/neuron_realtree/stubs)")

    def __getitem__(self, item):
        return self


def module_getattr(module_name: str):
    """A PEP 562 module ``__getattr__`` that answers every public name with a Placeholder."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module_name}.{name}")

    return __getattr__
