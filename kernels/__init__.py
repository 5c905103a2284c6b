"""NKI kernels for the routed experts on Trainium2, and the CPU interpreter that executes them here.

* :mod:`.moe_w8` - the kernels (``moe_w8_pow2``, ``moe_w8_output_block``) with their shape contract.
* :mod:`.host` - torch-side preparation: one-time weight re-layout, token buckets, dense affinities.
* :mod:`.nki_api` - binds the kernels to AWS's ``nki`` when a real one is importable, else to
  :mod:`.nki_cpu`, the project's interpreter of the NKI subset (rules, counters, cost model).
* :mod:`.launch` - runs a kernel on torch tensors through ``nki.simulate`` or the interpreter.

The Neuron device path is ``vllm_moe_w8.neuron_glue.binding``. Importing this package imports neither
vLLM nor AWS's Neuron packages.
"""
