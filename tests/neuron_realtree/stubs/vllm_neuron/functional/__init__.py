"""STUB (real-tree mode, tests only): replaces ``vllm_neuron.functional`` (``NF``: the Neuron kernel wrappers -
attention, MoE, collectives - that need Neuron hardware). Every ``NF.<name>`` is a labelled placeholder that raises
when called; the glue's adopted MoE forward never calls one."""

from _placeholder import module_getattr

__getattr__ = module_getattr("vllm_neuron.functional")
