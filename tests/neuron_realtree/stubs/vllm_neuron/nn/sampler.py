"""STUB (real-tree mode): replaces ``vllm_neuron/nn/sampler.py`` (not in any stored tree)."""

from . import Sampler  # noqa: F401
