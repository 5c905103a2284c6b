"""STAND-IN for vllm-neuron (tests only; see tests/neuron_standin/README.md)."""

__version__ = "0.24.0.standin"
