"""NKI kernels for the routed experts on Trainium2, and the CPU interpreter that executes them here.

* :mod:`.moe_w8` - the dense kernels (``moe_w8_pow2``, ``moe_w8_output_block``: decode) with their shape contract.
* :mod:`.moe_w8_grouped` - the token-grouped kernels (prefill) and :mod:`.grouping`, their host-side row grouping.
* :mod:`.moe_w8_blocks` - the device-scheduled kernels (selective decode, block prefill) with :mod:`.projections`
  (per-block projection helpers), :mod:`.routing` (traceable routing metadata) and :mod:`.host_routed` (their
  launch contract).
* :mod:`.host` - torch-side preparation: one-time weight re-layout, token buckets, dense affinities.
* :mod:`.nki_api` - binds the kernels to AWS's ``nki`` when a real one is importable, else to
  :mod:`.nki_cpu`, the project's interpreter of the NKI subset (rules, counters, cost model).
* :mod:`.launch` - runs a kernel on torch tensors through ``nki.simulate`` or the interpreter.

``vllm_moe_w8.neuron_glue.kernel_launch`` launches them (``wrap_nki`` on Neuron, the interpreter elsewhere).
Importing this package imports neither vLLM nor AWS's Neuron packages.
"""
