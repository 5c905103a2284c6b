"""vllm_moe_w8.vllm_glue.cpu_rope_fix: vLLM 0.32's CPU rotary kernel mis-handles 3-D query/key (MLA); the correction routes
exactly those calls to vLLM's own torch path (``RotaryEmbedding.forward_static``, the independent reference here)
and leaves 2-D calls to the C++ op. No engine start: a real ``RotaryEmbedding`` under a default vLLM config."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the correction patches vLLM's CPU rotary embedding")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402

from vllm_moe_w8.vllm_glue import cpu_rope_fix  # noqa: E402
from vllm_moe_w8.vllm_glue.register import installed_vllm_version  # noqa: E402

HEADS, NOPE, ROPE, KV_WIDTH, KV_LORA = 4, 64, 64, 832, 512  # GLM-5 / DeepSeek MLA shapes (the CPU MLA head size)


@pytest.fixture(scope="module")
def rope():
    cpu_rope_fix.install(installed_vllm_version())
    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(ROPE, ROPE, 256, 10000.0, False, torch.float32)


def _mla_inputs(tokens: int, seed: int):
    """The views MLA passes: q's rope half ``[T, heads, 128][..., 64:]`` and ``kv[..., 512:576].unsqueeze(1)``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, NOPE + ROPE, generator=gen)
    kv = torch.randn(tokens, KV_WIDTH, generator=gen)
    return q, kv


def _mla_rotate(rope, positions, q, kv):
    q, kv = q.clone(), kv.clone()
    q_pe, k_pe = q[..., NOPE:], kv[..., KV_LORA:KV_LORA + ROPE].unsqueeze(1)
    q[..., NOPE:], k_pe = rope.forward_cpu(positions, q_pe, k_pe)
    return q, k_pe.squeeze(1)


def _reference(rope, positions, q, kv):
    """Each token alone, contiguous, through vLLM's torch implementation."""
    cache = rope._match_cos_sin_cache_dtype(q)
    q_ref, k_ref = [], []
    for t in range(len(positions)):
        qt, kt = RotaryEmbedding.forward_static(positions[t:t + 1], q[t:t + 1, :, NOPE:].contiguous(),
                                                kv[t:t + 1, KV_LORA:KV_LORA + ROPE].contiguous(), ROPE, ROPE, cache, False)
        q_ref.append(torch.cat([q[t:t + 1, :, :NOPE], qt], dim=-1))
        k_ref.append(kt)
    return torch.cat(q_ref), torch.cat(k_ref)


def test_this_vllm_has_the_bug_and_the_correction_is_installed():
    """The probe finds the bug on vLLM 0.32's CPU build, so ``install`` patches (and stays idempotent)."""
    assert cpu_rope_fix.cpp_op_mixes_tokens()
    assert cpu_rope_fix.install(installed_vllm_version()) == "installed"
    assert getattr(RotaryEmbedding.forward_cpu, "_vllm_moe_w8_rope_fix", False)
    assert cpu_rope_fix.install("0.33.0").startswith("not installed")


def test_mla_rotation_is_exact_and_batch_independent(rope, monkeypatch):
    monkeypatch.setattr(cpu_rope_fix, "enabled", True)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])  # three sequences batched
    q, kv = _mla_inputs(len(positions), seed=1)
    got_q, got_k = _mla_rotate(rope, positions, q, kv)
    want_q, want_k = _reference(rope, positions, q, kv)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # same torch ops: bit-identical
    alone_q, alone_k = _mla_rotate(rope, positions[6:], q[6:], kv[6:])
    assert torch.equal(alone_q, got_q[6:]) and torch.equal(alone_k, got_k[6:])


def test_without_the_correction_the_kernel_mixes_tokens(rope, monkeypatch):
    """Fault twin: with the correction off the same check fails, so the test above can fail."""
    monkeypatch.setattr(cpu_rope_fix, "enabled", False)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    q, kv = _mla_inputs(len(positions), seed=1)
    got_q, got_k = _mla_rotate(rope, positions, q, kv)
    want_q, want_k = _reference(rope, positions, q, kv)
    assert (got_q - want_q).abs().max() > 1e-2 or (got_k - want_k).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["contiguous", "row-strided"])
def test_2d_layouts_still_use_the_cpp_op(rope, monkeypatch, layout):
    """Everything else is untouched: 2-D calls never reach the torch path (and the C++ op is exact for them)."""
    monkeypatch.setattr(cpu_rope_fix, "enabled", True)

    def fail(*args, **kwargs):
        raise AssertionError("a 2-D call took the torch path")

    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([3, 0, 7])
    if layout == "contiguous":
        q, k = torch.randn(3, HEADS * ROPE, generator=gen), torch.randn(3, ROPE, generator=gen)
    else:  # q, k, v = qkv.split(...): row-strided 2-D views
        qkv = torch.randn(3, (HEADS + 2) * ROPE, generator=gen)
        q, k = qkv[:, :HEADS * ROPE], qkv[:, HEADS * ROPE:(HEADS + 1) * ROPE]
    want_q, want_k = RotaryEmbedding.forward_static(positions, q.clone(), k.clone(), ROPE, ROPE,
                                                     rope._match_cos_sin_cache_dtype(q), False)
    monkeypatch.setattr(RotaryEmbedding, "forward_native", fail)
    got_q, got_k = rope.forward_cpu(positions, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)  # C++ vs torch: fp32 rounding only
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)


def test_needs_torch_path_is_exactly_the_broken_layouts():
    t2 = torch.zeros(3, 8)
    assert not cpu_rope_fix.needs_torch_path(t2, t2)
    assert not cpu_rope_fix.needs_torch_path(torch.zeros(3, 16)[:, :8], None)  # row-strided: the op handles it
    assert cpu_rope_fix.needs_torch_path(torch.zeros(3, 2, 8), t2)  # 3-D, even contiguous
    assert cpu_rope_fix.needs_torch_path(t2, torch.zeros(3, 1, 8))
    assert cpu_rope_fix.needs_torch_path(torch.zeros(8, 3).t(), None)  # last stride != 1
