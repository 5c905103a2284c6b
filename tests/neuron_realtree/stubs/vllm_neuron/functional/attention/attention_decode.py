"""STUB (real-tree mode): vllm_neuron.functional.attention.attention_decode (an NKI attention kernel wrapper)."""

from _placeholder import Placeholder

_swizzle_packed_k = Placeholder("attention_decode._swizzle_packed_k")
_unswizzle_packed_k = Placeholder("attention_decode._unswizzle_packed_k")
