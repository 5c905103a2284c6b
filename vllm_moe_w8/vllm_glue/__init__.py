"""The vLLM glue: registration of the ``neuron-w8`` quantization method, its config, the runtime settings
the config resolves once and hands to the methods, the MoE and linear methods, expert-weight loading with
completeness accounting, and the numerics self-check. It is the only room that imports vLLM. It may import
the codec, the op and the Neuron glue; the methods never import the config back (settings are passed in).
"""
