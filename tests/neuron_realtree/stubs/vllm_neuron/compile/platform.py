"""STUB (real-tree mode, tests only): replaces ``vllm_neuron/compile/platform.py`` (the Neuron runtime's target probe:
needs the runtime). ``get_platform_target()`` answers "trn2", the target neuron-w8's kernels are written for."""


def get_platform_target() -> str:
    return "trn2"
