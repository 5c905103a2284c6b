"""STUB (real-tree mode, tests only): replaces ``vllm_neuron.functional.moe`` (the MoE kernel wrappers: router,
blockwise mapping, ``moe_cte``, ``moe_block_tkg``; NKI, need Neuron hardware). Package marker for ``router``."""
