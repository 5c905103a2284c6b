"""The Neuron glue: launching ``kernels/`` on a Trainium device (``kernel_launch``) and the first-run check
(``neuron_check``). It is the one room that imports AWS's Neuron packages (``nki``, ``torch_neuronx``,
``libtorch_neuronx_lite``, ``vllm_neuron``, ``nkilib``), always behind an import guard, so importing it on a host
without them is harmless. It may import torch, ``vllm_moe_w8.kernels``, the codec and the op's reference; vLLM only
lazily, in ``neuron_check``'s inventory (the platform's quantization list); never the vLLM glue.
"""
