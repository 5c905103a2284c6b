"""STUB (real-tree mode, tests only): replaces ``vllm_neuron/envs.py`` (the runtime's environment-variable table;
not part of the tree). Only the names the tree's real files read, with the defaults those files assume on a
single-node CPU run: the native compile backend, no switch-cc mesh override, the barrier timeout."""

import os

VLLM_NEURON_SWITCH_CC = bool(int(os.environ.get("VLLM_NEURON_SWITCH_CC", "0")))
VLLM_NEURON_BARRIER_TIMEOUT = int(os.environ.get("VLLM_NEURON_BARRIER_TIMEOUT", "1800"))


def is_native_backend() -> bool:
    return os.environ.get("VLLM_NEURON_BACKEND", "native") == "native"
