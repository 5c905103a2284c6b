"""The Neuron glue: the binding of ``kernels/`` to a Trainium device (``binding``). It is the one room that
imports AWS's Neuron packages (``nki``, ``torch_neuronx``, ``libtorch_neuronx_lite``, ``vllm_neuron``,
``nkilib``), always behind an import guard, so importing it on a host without them is harmless. It may import
torch and ``vllm_moe_w8.kernels``; it imports neither vLLM nor the vLLM glue.
"""
