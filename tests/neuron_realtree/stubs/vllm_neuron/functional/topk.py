"""STUB (real-tree mode): vllm_neuron.functional.topk (a Neuron kernel wrapper)."""

from _placeholder import Placeholder

topk = Placeholder("vllm_neuron.functional.topk.topk")
