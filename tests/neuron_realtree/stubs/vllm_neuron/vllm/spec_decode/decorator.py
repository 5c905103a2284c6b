"""STUB (real-tree mode, tests only): replaces ``vllm_neuron/vllm/spec_decode/decorator.py`` (speculative-decoding
wrapper of a model's forward; not part of the tree). ``async_speculative_decoding`` leaves the class unchanged."""


def async_speculative_decoding(cls=None, **_kwargs):
    if cls is None:
        return lambda c: c
    return cls
