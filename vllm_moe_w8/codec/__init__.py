"""The codec: FP8 code formats, the exact repack between them (``fp8``) and the safetensors checkpoint reader
with its validation (``checkpoint``). Everything downstream (the vLLM glue, the op, the tools) reads weights
through this room. It may import torch, numpy, ml_dtypes and safetensors; it imports neither vLLM nor any
Neuron package, nor any other room of this project.
"""
