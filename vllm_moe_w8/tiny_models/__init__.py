"""Tiny random FP8 MoE checkpoints laid out exactly like the official ones, and their exact twins.

No official FP8 MoE checkpoint is small enough for a test or a demo, so this package writes one. It ships
inside the runtime package because ``vllm-moe-w8 demo`` needs it: the demo writes a tiny model and serves
it, on any machine, without a download. A checkpoint has the same ``config.json`` keys (with
``text_config`` nesting where the real one nests), the same tensor names, the same choice of which tensors are FP8 and which stay bf16/fp32, the same
``quantization_config``, several ``model-0000N-of-0000M.safetensors`` shards with
``model.safetensors.index.json``, a ``generation_config.json`` and a small byte-level BPE tokenizer
(trained offline with ``tokenizers``) that has a chat template. Only the sizes are tiny: hidden 256,
``moe_intermediate_size`` 384 (so TP=2 gives a ragged 192 per rank), two or three layers.

Weights are drawn in fp32 and quantised as real checkpoints are: one scale per 128x128 block
(``weight_block_size``) or per output channel (compressed-tensors ``strategy: channel``), equal to
the block's amax / 448, so every block uses the E4M3FN-only codes 0x78..0x7E. Scales are stored as
dequantisation multipliers (``weight_scale_inv`` / ``weight_scale``) in the requested dtype.

:func:`write_twin` writes the *independent reference*: the same checkpoint with each FP8 tensor
replaced by its exactly dequantised weight (torch's own float8_e4m3fn conversion times the scale,
pad-then-crop on ragged grids; exact for bf16/fp16 scales, one fp32 rounding for fp32 scales) and no
``quantization_config``; vLLM runs it unquantised.

Modules, one per concern: ``layout`` (architectures, sizes, the tensor plan and shared building blocks),
one per model family (``qwen3``, ``qwen35``, ``glm``), ``quantize``, ``tokenizer``, ``shards``, ``writer``
(:func:`write_checkpoint`) and ``twin`` (:func:`write_twin`). A new family is a module with a plan
function registered in ``writer.FAMILIES`` and its architecture in ``layout.ARCHITECTURES``.

Imports torch and safetensors; ``tokenizers`` is imported only when a tokenizer is written.
Never imports vLLM, and no other room of the package.
"""


from vllm_moe_w8.tiny_models.layout import ALIASES, ARCHITECTURES, FORMATS, TinySizes, resolve_architecture
from vllm_moe_w8.tiny_models.quantize import dequantize_exact, quantize_block, quantize_channel
from vllm_moe_w8.tiny_models.tokenizer import write_tokenizer
from vllm_moe_w8.tiny_models.twin import write_twin
from vllm_moe_w8.tiny_models.writer import module_of, write_checkpoint

__all__ = [
    "ALIASES", "ARCHITECTURES", "FORMATS", "TinySizes", "dequantize_exact", "module_of", "quantize_block",
    "quantize_channel", "resolve_architecture", "write_checkpoint", "write_tokenizer", "write_twin",
]
