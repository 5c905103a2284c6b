"""``NeuronW8Config``: which checkpoints it claims, how it refuses the rest, flag/auto selection, skip lists,
and the runtime settings (additional_config / environment / checkpoint precedence)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_moe_w8.vllm_glue.quant_config import (  # noqa: E402
    AUTO_ENV,
    NeuronW8Config,
    UnsupportedCheckpoint,
    parse_checkpoint_format,
    runtime_settings,
)

BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": CT_GROUP},
      "ignore": ["lm_head", "re:.*mlp\\.gate$"]}
CONVERTED = {"quant_method": "neuron-w8", "mode": "pow2", "code_format": "e4m3", "weight_block_size": [128, 128],
             "source": BLOCK, "converted_by": "vllm-moe-w8 0.1.0"}
QWEN = SimpleNamespace(architectures=["Qwen3MoeForCausalLM"])
LLAMA = SimpleNamespace(architectures=["LlamaForCausalLM"])


def test_claims_block_fp8_compressed_tensors_channel_and_converted():
    b = parse_checkpoint_format(BLOCK)
    assert (b.kind, b.expert_block, b.expert_scale_suffix, b.linear_scale_suffix) == ("block", (128, 128), "weight_scale_inv", "weight_scale_inv")
    assert "model.layers.0.mlp.gate" in b.ignored
    c = parse_checkpoint_format(CT)
    assert (c.kind, c.expert_block, c.expert_scale_suffix) == ("channel", (1, 0), "weight_scale")
    v = parse_checkpoint_format(CONVERTED)
    assert (v.kind, v.mode, v.code_format, v.expert_block, v.linear_block) == ("converted", "pow2", "e4m3", (128, 128), (128, 128))
    assert "lm_head" in v.ignored  # the source's skip list still applies
    ob = parse_checkpoint_format({**CONVERTED, "mode": "output-block"})
    assert ob.expert_block == (128, 0)
    ct_conv = parse_checkpoint_format({**CONVERTED, "mode": "lut", "code_format": "e4m3fn", "source": CT})
    assert ct_conv.expert_block == (1, 0) and ct_conv.linear_scale_suffix == "weight_scale"


@pytest.mark.parametrize("cfg,found", [
    ({**BLOCK, "weight_block_size": None}, "without weight_block_size"),
    ({**BLOCK, "weight_block_size": [64, 64]}, r"weight_block_size is \[64, 64\]"),
    ({**BLOCK, "activation_scheme": "static"}, "activation_scheme is 'static'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "tensor"}}}}, "strategy: 'tensor'"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "num_bits": 4, "type": "int"}}}}, "is not FP8"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "input_activations": {**CT_GROUP["input_activations"], "dynamic": False}}}}, "input_activations is static"),
    ({**CONVERTED, "mode": "fp4"}, "mode is 'fp4'"),
    ({**CONVERTED, "code_format": "e4m3fn"}, "code_format 'e4m3fn' does not match mode 'pow2'"),
    (None, "no quantization_config"),
])
def test_refusals_say_what_was_found_and_what_is_supported(cfg, found):
    with pytest.raises(UnsupportedCheckpoint, match=found) as info:
        parse_checkpoint_format(cfg)
    if cfg is None or cfg.get("quant_method") == "awq":  # wholly foreign: the message lists what is supported
        assert "block FP8" in str(info.value) and "compressed-tensors per-channel" in str(info.value)


def test_no_quantization_config_refused_on_construction():
    with pytest.raises(ValueError, match="no quantization_config"):
        NeuronW8Config()


def test_flag_override_auto_opt_in_and_unchanged_default(monkeypatch):
    monkeypatch.delenv(AUTO_ENV, raising=False)
    over = NeuronW8Config.override_quantization_method
    assert over(BLOCK, "neuron-w8", hf_config=QWEN) == "neuron-w8"
    assert over(CT, "neuron-w8", hf_config=QWEN) == "neuron-w8"
    assert over(CONVERTED, None, hf_config=QWEN) == "neuron-w8"  # a converted checkpoint needs no flag
    assert over(BLOCK, None, hf_config=QWEN) is None  # no opt-in: vLLM's own fp8 path, unchanged
    assert over(BLOCK, "fp8", hf_config=QWEN) is None
    with pytest.raises(UnsupportedCheckpoint, match=r"architecture \['LlamaForCausalLM'\] is not supported.*Qwen3MoeForCausalLM"):
        over(BLOCK, "neuron-w8", hf_config=LLAMA)
    with pytest.raises(UnsupportedCheckpoint, match="weight_block_size is"):
        over({**BLOCK, "weight_block_size": [64, 64]}, "neuron-w8", hf_config=QWEN)
    monkeypatch.setenv(AUTO_ENV, "1")
    assert over(BLOCK, None, hf_config=QWEN) == "neuron-w8"
    assert over(CT, None, hf_config=QWEN) == "neuron-w8"
    assert over(BLOCK, "fp8", hf_config=QWEN) is None  # an explicit other method wins
    assert over(BLOCK, None, hf_config=LLAMA) is None  # auto is conservative: no error, no claim
    assert over({**BLOCK, "weight_block_size": [64, 64]}, None, hf_config=QWEN) is None


def test_cli_spelling_is_lower_cased_by_vllm():
    from vllm.config.model import ModelConfig

    assert ModelConfig.validate_quantization_before("NEURON-W8") == "neuron-w8"


def test_skip_lists_exact_suffix_parent_regex_and_fused():
    cfg = NeuronW8Config.from_config({**BLOCK, "modules_to_not_convert": ["lm_head", "model.visual", "mlp.gate"], "ignored_layers": ["re:.*shared_expert_gate"]})
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert cfg.is_layer_skipped("lm_head")
    assert cfg.is_layer_skipped("model.layers.3.mlp.gate")
    assert not cfg.is_layer_skipped("model.layers.3.mlp.gate_up_proj")
    assert cfg.is_layer_skipped("model.visual.blocks.0.attn.qkv")
    assert cfg.is_layer_skipped("model.layers.1.mlp.shared_expert_gate")
    assert not cfg.is_layer_skipped("model.layers.1.self_attn.qkv_proj")
    mixed = NeuronW8Config.from_config({**BLOCK, "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]})
    mixed.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    with pytest.raises(ValueError, match="mixes skipped and quantised shards"):
        mixed.is_layer_skipped("model.layers.0.self_attn.qkv_proj")
    every = NeuronW8Config.from_config({**BLOCK, "modules_to_not_convert": [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]})
    every.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert every.is_layer_skipped("model.layers.0.self_attn.qkv_proj")


def test_runtime_settings_precedence(monkeypatch):
    monkeypatch.delenv("VLLM_MOE_W8_MODE", raising=False)
    monkeypatch.delenv("VLLM_MOE_W8_SELF_CHECK", raising=False)
    block = parse_checkpoint_format(BLOCK)
    s = runtime_settings(block, {})
    assert (s.mode, s.mode_source, s.self_check) == ("pow2", "default", True)
    assert runtime_settings(parse_checkpoint_format({**BLOCK, "mode": "lut"}), {}).mode == "lut"
    monkeypatch.setenv("VLLM_MOE_W8_MODE", "lut")
    assert runtime_settings(block, {}).mode_source == "environment VLLM_MOE_W8_MODE"
    s = runtime_settings(block, {"neuron_w8": {"mode": "output-block", "self_check": False}})
    assert (s.mode, s.self_check) == ("output-block", False) and "additional_config" in s.mode_source
    with pytest.raises(ValueError, match=r"unknown additional_config\['neuron_w8'\] key\(s\) \['modee'\]"):
        runtime_settings(block, {"neuron_w8": {"modee": "lut"}})
    with pytest.raises(ValueError, match="mode 'int4'"):
        runtime_settings(block, {"neuron_w8": {"mode": "int4"}})
    monkeypatch.delenv("VLLM_MOE_W8_MODE")
    conv = parse_checkpoint_format(CONVERTED)
    assert runtime_settings(conv, {}).mode == "pow2"
    with pytest.raises(ValueError, match="converted with mode 'pow2'.*asks for 'lut'"):
        runtime_settings(conv, {"neuron_w8": {"mode": "lut"}})
