"""The Neuron room: everything that imports nki, torch_neuronx, libtorch_neuronx_lite, vllm_neuron or nkilib (apart from kernels/)."""
