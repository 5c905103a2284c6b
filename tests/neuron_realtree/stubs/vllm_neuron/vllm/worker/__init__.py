"""STUB package marker (real-tree mode, tests only): the real package's __init__ is not part of the tree (the
upstream one registers vllm-neuron with vLLM, which the glue tests do themselves); its modules are the real files
listed in tests/neuron_realtree/MANIFEST.toml."""
