"""STUB (real-tree mode): replaces ``nkilib.core.utils.common_types`` (the NKI kernels' enums; the kernels need
Neuron hardware). Every name is a labelled placeholder (its members too)."""

from _placeholder import module_getattr

__getattr__ = module_getattr("nkilib.core.utils.common_types")
