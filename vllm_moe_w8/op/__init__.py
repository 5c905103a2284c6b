"""The op: the torch custom op ``moe_w8::fused_moe`` (``custom_op``) and what computes it off Trainium: the
CPU implementation (``cpu``: exact weights, float32 sums; h rounded to BF16 for BF16 activations on avx512bf16), its native kernel (one variant per instruction set: AVX-512 BF16, AVX2) built
from ``csrc/`` (``native``), and the fp32
reference the tests and benchmarks compare against (``reference``). It may import torch, the codec and (for
the device path) the Neuron glue; it imports no vLLM and no Neuron package itself.
"""
