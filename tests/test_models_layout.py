"""The tiny checkpoints have the official layout: checked against independent sources, without vLLM.

* Names and shapes: transformers' own model class for the architecture, built from the checkpoint's
  ``config.json`` on the meta device, must have exactly the checkpoint's tensors (per-expert tensors
  fused as transformers 5 holds them: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I];
  FP8 scales aside).
* FP8 as the exporters write it: every quantised weight is float8_e4m3fn with a scale grid of
  ceil(N/128) x ceil(K/128) (block) or [N, 1] (per-channel) in the requested dtype; every block reaches
  the E4M3FN-only codes >= 0x78; routers, norms, embeddings, lm_head, shared_expert_gate and the
  linear-attention a/b projections stay bf16; GLM's e_score_correction_bias is fp32.
* Sharded with an index that names every tensor; a chat-capable tokenizer whose size fits the vocab.
* The twin is the exact dequantisation (checked with ml_dtypes' float8_e4m3fn, not torch's).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open

from vllm_moe_w8 import tiny_models

ARCHS = ["Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
         "Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM"]
KEPT_BF16 = re.compile(r"(mlp\.gate\.weight|shared_expert_gate|in_proj_[ab]\.|norm|embed|lm_head|visual\.|conv1d|dt_bias|indexer\.weights_proj)")


def _tensors(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == fname
                out[name] = f.get_tensor(name)
    assert set(out) == set(index["weight_map"])
    return out, index


def _fuse_experts(shapes: dict) -> dict:
    """Per-expert names -> transformers 5's fused 3-D expert tensors."""
    fused, experts = {}, defaultdict(dict)
    for name, shape in shapes.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            experts[m.group(1)][(int(m.group(2)), m.group(3))] = shape
        else:
            fused[name] = shape
    for prefix, parts in experts.items():
        num = 1 + max(e for e, _ in parts)
        inter, hidden = parts[0, "gate_proj"]
        assert all(parts[e, "gate_proj"] == parts[e, "up_proj"] == (inter, hidden) for e in range(num))
        assert all(parts[e, "down_proj"] == (hidden, inter) for e in range(num))
        fused[f"{prefix}.gate_up_proj"] = (num, 2 * inter, hidden)
        fused[f"{prefix}.down_proj"] = (num, hidden, inter)
    return fused


@pytest.mark.parametrize("arch", ARCHS)
def test_names_and_shapes_match_transformers_model(tiny_checkpoint, arch):
    import transformers

    ckpt = tiny_checkpoint(arch)
    config = transformers.AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = getattr(transformers, arch)(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tensors, _ = _tensors(ckpt)
    ours = {k: tuple(v.shape) for k, v in tensors.items() if not k.endswith(("_scale_inv", "_scale"))}
    ours = _fuse_experts(ours)
    assert sorted(set(ours) ^ set(expected)) == []
    assert {k: v for k, v in ours.items() if expected[k] != v} == {}


@pytest.mark.parametrize("arch,fmt,scale_dtype", [
    ("Qwen3MoeForCausalLM", "block", torch.bfloat16),
    ("Qwen3_5MoeForConditionalGeneration", "block", torch.float16),
    ("Glm4MoeForCausalLM", "block", torch.float32),
    ("Glm4MoeForCausalLM", "channel", torch.bfloat16),
    ("GlmMoeDsaForCausalLM", "block", torch.float32),
])
def test_fp8_tensors_and_scales_as_exporters_write_them(tiny_checkpoint, arch, fmt, scale_dtype):
    ckpt = tiny_checkpoint(arch, fmt, scale_dtype=scale_dtype)
    config = json.loads((ckpt / "config.json").read_text())
    qcfg = config["quantization_config"]
    tensors, index = _tensors(ckpt)
    assert len(set(index["weight_map"].values())) >= 2
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    suffix = "_scale_inv" if fmt == "block" else "_scale"
    if fmt == "block":
        assert qcfg == {**qcfg, "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        skipped = set(qcfg["modules_to_not_convert"])
    else:
        assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "float-quantized"
        assert qcfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
        assert qcfg["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
        skipped = set(qcfg["ignore"])
    fp8 = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert any(".experts.0.gate_proj" in n for n in fp8) and any("shared_expert" in n for n in fp8) or "Qwen3Moe" in arch
    for name in fp8:
        w, s = tensors[name], tensors[name + suffix]
        assert s.dtype == scale_dtype, name
        n, k = w.shape
        grid = (math.ceil(n / 128), math.ceil(k / 128)) if fmt == "block" else (n, 1)
        assert tuple(s.shape) == grid, name
        # every block (or row) uses the e4m3fn-only codes: scale = amax / 448
        mag = (w.view(torch.uint8) & 0x7F).to(torch.int32)
        if fmt == "block":
            padded = torch.zeros(grid[0] * 128, grid[1] * 128, dtype=torch.int32)
            padded[:n, :k] = mag
            block_max = padded.view(grid[0], 128, grid[1], 128).amax(dim=(1, 3))
        else:
            block_max = mag.amax(dim=1)
        assert int(block_max.min()) >= 0x78 and int(mag.max()) <= 0x7E, name
        assert tiny_models.module_of(name) not in skipped
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn or name.endswith(suffix):
            continue
        if name.endswith("e_score_correction_bias") or name.endswith("A_log"):
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name
            assert KEPT_BF16.search(name) or name.endswith(".bias"), f"{name} should be FP8 in the official layout"
        if t.dim() == 2 and name.endswith(".weight") and "embed" not in name:  # Linear layers, not embeddings
            assert tiny_models.module_of(name) in skipped, f"{name} is bf16 but not in the skip list"


@pytest.mark.parametrize("arch", ["Qwen3_5MoeForConditionalGeneration", "Glm4MoeForCausalLM"])
def test_tokenizer_chat_template_and_vocab(tiny_checkpoint, arch):
    import transformers

    ckpt = tiny_checkpoint(arch)
    config = json.loads((ckpt / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert 256 < len(tok) <= vocab
    text = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("The quick brown fox")["input_ids"]
    assert tok.decode(ids) == "The quick brown fox" and len(ids) < len("The quick brown fox")
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    if "text_config" in config:
        assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")


@pytest.mark.parametrize("arch,fmt,dtype", [("Glm4MoeForCausalLM", "block", torch.float32),
                                            ("Glm4MoeForCausalLM", "channel", torch.float32),
                                            ("Glm4MoeForCausalLM", "block", torch.bfloat16),
                                            ("Qwen3MoeForCausalLM", "block", torch.float32)])
def test_twin_is_the_exact_dequantisation(tiny_checkpoint, tiny_twin, arch, fmt, dtype):
    ckpt, twin = tiny_checkpoint(arch, fmt), tiny_twin(arch, fmt, dtype=dtype)
    src, _ = _tensors(ckpt)
    out, _ = _tensors(twin)
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    assert set(out) == {n for n in src if not n.endswith(("_scale_inv", "_scale"))}
    for name, t in src.items():
        if name not in out:
            continue
        if t.dtype != torch.float8_e4m3fn:
            assert torch.equal(out[name], t), name
            continue
        assert out[name].dtype == dtype
        codes = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        s = src[name + ("_scale_inv" if fmt == "block" else "_scale")].float().double().numpy()
        if fmt == "block":  # ragged edges: the last block row/column covers the remainder
            s = np.repeat(np.repeat(s, 128, 0), 128, 1)[: codes.shape[0], : codes.shape[1]]
        expected = torch.from_numpy(codes * s)
        # the product computed exactly (float64), rounded once to fp32 (exact unless the scale is fp32:
        # a 4-bit x 8/11-bit mantissa product fits fp32), then to the twin's dtype
        assert torch.equal(out[name], expected.to(torch.float32).to(dtype)), name
        if src[name + ("_scale_inv" if fmt == "block" else "_scale")].dtype != torch.float32 and dtype == torch.float32:
            assert torch.equal(out[name].double(), expected), name


def test_sizes_are_ragged_under_tp2_and_overrides_apply(tiny_checkpoint):
    ckpt = tiny_checkpoint("Qwen3MoeForCausalLM", "block", num_experts=4, num_shards=3)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["moe_intermediate_size"] == 384 and (384 // 2) % 128 != 0
    assert config["num_experts"] == 4
    _, index = _tensors(ckpt)
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny-model architecture 'Llama'"):
        tiny_models.write_checkpoint(tmp_path / "a", "Llama")
    with pytest.raises(ValueError, match="fmt must be one of"):
        tiny_models.write_checkpoint(tmp_path / "b", "qwen3-moe", fmt="tensor")
    with pytest.raises(ValueError, match="unknown size override"):
        tiny_models.write_checkpoint(tmp_path / "c", "qwen3-moe", hidden=3)
    with pytest.raises(ValueError, match="scale_dtype"):
        tiny_models.write_checkpoint(tmp_path / "d", "qwen3-moe", scale_dtype=torch.int8)
