"""STUB (real-tree mode): replaces ``libtorch_neuronx_lite.compile.platform`` (the Neuron runtime's platform probe;
not installable here). ``get_platform_target()`` answers "trn2", the target the read factories are written for."""


def get_platform_target() -> str:
    return "trn2"
