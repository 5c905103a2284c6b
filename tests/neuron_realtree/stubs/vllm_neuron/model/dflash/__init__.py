"""STUB (real-tree mode, tests only): the dflash family that the real model/registry.py imports beside the families under
test. Not part of the tree (outside neuron-w8); each class is a placeholder so the registry lists what it lists."""


class DFlashDraftModel:
    """Placeholder for vllm_neuron.model.dflash.DFlashDraftModel (not read)."""
