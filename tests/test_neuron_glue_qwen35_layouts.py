"""Both Qwen3.5-MoE checkpoint layouts under vllm-neuron (issue #24), through the stand-in (tests/neuron_standin:
NOT vllm-neuron, it reproduces only the signatures and the config/loader behaviour neuron-w8 relies on).

- multimodal (``Qwen3_5MoeForConditionalGeneration``: nested ``text_config``, tensors ``model.language_model.*``):
  served — start-up passes, vllm-neuron's factory builds it and every block gets our experts at load;
- text-only (``Qwen3_5MoeForCausalLM``: flat config, tensors ``model.*``): refused at start-up, naming the
  architecture, why and what to use instead. vllm-neuron (whn09/vllm-neuron @3de9ea3) has no model for it: its
  ``Qwen3_5Config.from_hf`` needs ``text_config``, and nesting the flat config would not help, because its
  ``load_weights`` reads every text tensor under ``model.language_model.`` (the last test shows both).
"""

from __future__ import annotations

import pytest
import torch

import _neuron_standin as st

SIZES = dict(hidden_size=256, moe_intermediate_size=256, shared_intermediate_size=256, num_experts=8,
             num_experts_per_tok=2, num_hidden_layers=2)
LAYOUTS = {"multimodal": "Qwen3_5MoeForConditionalGeneration", "text": "Qwen3_5MoeForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from vllm_moe_w8 import tiny_models

    root = tmp_path_factory.mktemp("q35_layouts")
    return {name: tiny_models.write_checkpoint(root / name, arch, **SIZES) for name, arch in LAYOUTS.items()}


@pytest.fixture()
def standin(monkeypatch):
    yield from st.glue_fixture(monkeypatch, install=False)


def installed_platform():
    from vllm_neuron.vllm.platform import NeuronPlatform

    from vllm_moe_w8.neuron_glue import registration

    registration.install(NeuronPlatform)
    return NeuronPlatform


def build_and_load(config, path):
    """One rank of vllm-neuron's runner sequence (stand-in): the registry's Qwen3.5-MoE factory, then load_weights."""
    from vllm_neuron.model.registry import get_models
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    factory = dict(get_models())["Qwen3_5MoeForConditionalGeneration"]
    state = st.make_groups(1, ep=False)

    def build(rank):
        state(rank)
        return load_model(factory, config, None, str(path))

    return st.run_ranks(1, build)[0]


def test_multimodal_layout_is_served(standin, checkpoints):
    from vllm_moe_w8.neuron_glue import experts

    cls = installed_platform()
    config = st.vllm_config(checkpoints["multimodal"])
    cls.check_and_update_config(config)
    assert config in cls.checked_configs, "start-up went on to the platform's own checks"
    standin["config"] = config
    model = build_and_load(config.model_config.hf_config, checkpoints["multimodal"])
    blocks = experts.adopted_blocks(model)
    assert len(blocks) == SIZES["num_hidden_layers"], "every MoE block carries our 1-byte experts"
    for _, block in blocks:
        assert not hasattr(block, "experts_gate_up_weight"), "vllm-neuron's BF16 experts were dropped"
    t = st.checkpoint_tensors(checkpoints["multimodal"])
    norm = model.language_model.layers[1].post_attention_layernorm.weight
    assert torch.equal(norm, t["model.language_model.layers.1.post_attention_layernorm.weight"].to(norm.dtype)), \
        "vllm-neuron's loader read the text tensors from model.language_model.*"


def test_text_only_layout_is_refused_at_start_up(standin, checkpoints):
    from vllm_moe_w8.neuron_glue import interfaces

    cls = installed_platform()
    config = st.vllm_config(checkpoints["text"])
    with pytest.raises(interfaces.NeuronGlueError, match=(
        r"architecture Qwen3_5MoeForCausalLM with vllm-neuron 0\.24\.0\.standin: vllm-neuron has no model for the "
        r"text-only Qwen3\.5-MoE layout .*requires a nested text_config .*under model\.language_model\.\*\. Under "
        r"vllm-neuron serve the multimodal checkpoint \(architectures \[\"Qwen3_5MoeForConditionalGeneration\"\].* "
        r"served by neuron-w8 on vLLM's own model classes")):
        cls.check_and_update_config(config)
    assert config not in cls.checked_configs, "stopped before the platform went on"
    assert "Qwen3_5MoeForCausalLM" not in interfaces.supported_text()
    # Not requested: the platform's own business (vllm-neuron then fails on it in its own words, below).
    cls.check_and_update_config(st.vllm_config(checkpoints["text"], quantization=None))


def test_why_the_text_only_layout_is_refused_rather_than_nested(standin, checkpoints):
    """What start-up pre-empts: vllm-neuron's factory cannot build the flat config, and a nested copy of it (under
    the multimodal architecture name) builds but cannot load, its text tensors being named model.* not
    model.language_model.*."""
    path = checkpoints["text"]
    cls = installed_platform()
    standin["config"] = st.vllm_config(path, quantization=None)
    with pytest.raises(ValueError, match="Qwen3.5 config is missing text_config"):
        build_and_load(standin["config"].model_config.hf_config, path)

    nested = st.vllm_config(path)
    flat = nested.model_config.hf_config
    nested.model_config.hf_config = st.as_namespace({"architectures": ["Qwen3_5MoeForConditionalGeneration"]})
    nested.model_config.hf_config.text_config = flat
    nested.model_config.hf_config.quantization_config = flat.quantization_config
    cls.check_and_update_config(nested)  # the nested config alone would pass start-up ...
    standin["config"] = nested
    with pytest.raises(RuntimeError, match=r"parameter\(s\) got no checkpoint tensor: \['language_model\.layers\.0\."):
        build_and_load(nested.model_config.hf_config, path)  # ... and fail at load, in vllm-neuron's words
    # The same sequence loads the multimodal checkpoint (test_multimodal_layout_is_served): the names differ.
