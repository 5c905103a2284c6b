"""A narrowly scoped correction for a vLLM CPU bug: rotary embeddings of 3-D query/key tensors.

vLLM 0.32's CPU ``RotaryEmbedding.forward_cpu`` hands query/key to the C++ ``_C.rotary_embedding`` op,
which assumes a 2-D ``[tokens, heads * head_size]`` layout with unit stride in the last dimension: it
takes ``num_heads = size(-1) / head_size`` and the token stride from ``stride(-2)``. MLA attention
(GLM-5, DeepSeek-V2/V3, ``vllm/model_executor/layers/mla.py``) passes 3-D strided views instead (the
rope part of q ``[T, heads, 128][..., 64:]`` and ``k_pe = kv[..., 512:].unsqueeze(1)``), so the op rotates
the wrong rows with other tokens' positions: a sequence's result depends on which sequences vLLM
batches with it (and a 3-D layout of another shape can even write out of bounds).

What this module does, and only where it applies (vLLM 0.32.x on the CPU platform, and only when a
probe of the C++ op on a 3-D input shows the bug):
* calls of ``RotaryEmbedding.forward_cpu`` whose query or key is not 2-D with unit last stride take
  vLLM's own exact torch path (``forward_native``); the result is written back in place, as the C++
  op would, and returned;
* every other call (the 2-D layouts of Qwen3-MoE, GLM-4-MoE, Llama ...) goes to the C++ op unchanged;
* the first corrected call logs one warning on ``vllm.neuron_w8``.
A vLLM whose op handles 3-D input (the probe agrees with the torch path) is left untouched, whatever
its version. ``VLLM_MOE_W8_CPU_ROPE_FIX=0`` disables the correction (to reproduce the bug).

Installed by :func:`install` from the plugin's registration, so it is active in every vLLM process,
including runs of unquantised models in the same environment.

Same finding under both of vLLM's CPU MLA backends (``CPU_MLA``, the reference one; ``AMX_MLA``, the default on Intel
AMX hosts, bf16 only): the rotation is not part of the backend. ``MultiHeadLatentAttentionWrapper.forward``
(``vllm/model_executor/layers/mla.py``) calls ``rotary_emb(positions, q[..., nope:], k_pe)`` on the 3-D views before
it calls the attention layer, and ``AMXMLAImpl`` (``vllm/v1/attention/backends/mla/amx_mla.py``) only splits the
already rotated ``q`` into ``q_nope``/``q_pe`` and stores ``k_pe.squeeze(1)`` (``forward_mha``,
``do_kv_cache_update``); neither backend rotates again. So MLA on AMX_MLA hits the same op with the same layouts, the
probe (an fp32 call of the op itself, independent of the attention backend and of AMX) answers the same, and the
same calls are corrected. The op's bug is in its layout arithmetic, not in a data type or instruction set.
"""

from __future__ import annotations

import os

import torch

ENV = "VLLM_MOE_W8_CPU_ROPE_FIX"
AFFECTED_VLLM_MINOR = (0, 32)
_MARK = "_vllm_moe_w8_rope_fix"

enabled = True  # read on every call; tests flip it to show the bug returns without the correction
_warned = False


def needs_torch_path(query: torch.Tensor, key: torch.Tensor | None) -> bool:
    """True for the layouts the C++ op gets wrong: not 2-D, or not unit stride in the last dimension."""
    for t in (query, key):
        if t is not None and (t.dim() != 2 or t.stride(-1) != 1):
            return True
    return False


def cpp_op_mixes_tokens() -> bool:
    """Probe: does ``_C.rotary_embedding`` disagree with vLLM's torch path on a small 3-D query?

    The probe's layout ([3 tokens, 2 heads, 8] contiguous) is one the buggy op reads and writes within
    bounds (it rotates the first 3 of the 6 head-rows), so the probe itself is safe."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(8, 8, generator=gen)
    positions = torch.tensor([1, 5, 2])
    query = torch.randn(3, 2, 8, generator=gen)
    key = torch.randn(3, 8, generator=gen)
    want_q, want_k = RotaryEmbedding.forward_static(positions, query.clone(), key.clone(), 8, 8, cache, True)
    ops.rotary_embedding(positions, query, key, 8, cache, True)
    return not (torch.equal(query, want_q) and torch.equal(key, want_k))


def _corrected_forward_cpu(original):
    def forward_cpu(self, positions, query, key=None):
        if not (enabled and needs_torch_path(query, key)):
            return original(self, positions, query, key)
        _warn_once()
        new_q, new_k = self.forward_native(positions, query, key)
        query.copy_(new_q)  # in place, like the C++ op: callers may rely on either the result or the mutation
        if key is not None:
            key.copy_(new_k)
        return query, key

    forward_cpu.__wrapped__ = original
    setattr(forward_cpu, _MARK, True)
    return forward_cpu


def _warn_once() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    from vllm.logger import init_logger

    init_logger("vllm.neuron_w8").warning(
        "neuron-w8: vLLM's CPU rotary-embedding kernel mis-handles 3-D query/key (MLA attention): those calls take "
        "vLLM's exact torch path instead (vllm_moe_w8.vllm_glue.cpu_rope_fix; %s=0 disables). Other layouts are untouched.", ENV)


def install(vllm_version: str) -> str:
    """Install the correction where it applies (``vllm_version``: the running vLLM's); returns what was done."""
    from vllm.platforms import current_platform

    if os.environ.get(ENV, "1") == "0":
        return f"disabled by {ENV}=0"
    if not current_platform.is_cpu():
        return f"not needed: platform {current_platform.device_type!r} is not the CPU platform"
    version = vllm_version
    if not version.startswith("%d.%d." % AFFECTED_VLLM_MINOR):
        return f"not installed: vLLM {version} is not 0.32.x"
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if getattr(RotaryEmbedding.forward_cpu, _MARK, False):
        return "installed"
    if not cpp_op_mixes_tokens():
        return f"not needed: vLLM {version}'s CPU rotary kernel handles 3-D input"
    RotaryEmbedding.forward_cpu = _corrected_forward_cpu(RotaryEmbedding.forward_cpu)
    return "installed"
