"""STUB (real-tree mode): vllm_neuron.functional.attention.attention_decode_mask (NKI attention kernel bucketing)."""

from _placeholder import Placeholder

_resize_block_len = Placeholder("attention_decode_mask._resize_block_len")
