"""neuron-w8's vLLM-facing Neuron path on vLLM 0.24.0, the version vllm-neuron 0.24 pins.

Run by ``scripts/test_vllm024.sh`` in ``.venv-vllm024/`` (skipped under any other vLLM). The current
platform is the stand-in of vllm-neuron's ``NeuronPlatform`` (tests/neuron_standin, NOT vllm-neuron);
everything else is vLLM 0.24's own code: ``register()`` through vLLM's quantization registry, then
``ModelConfig`` (quantization verification against the platform) and ``VllmConfig`` (which calls the
platform's ``check_and_update_config``, where neuron-w8 checks architecture and settings) on a tiny
real-layout FP8 Qwen3-MoE checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.skipif(not vllm.__version__.startswith("0.24."), reason="runs in .venv-vllm024 (vLLM 0.24)")

STANDIN = Path(__file__).parents[1] / "neuron_standin"


@pytest.fixture(scope="module")
def neuron(tmp_path_factory):
    """The stand-in Neuron platform as vLLM's current platform, then ``vllm_moe_w8.register()``."""
    import vllm.platforms as platforms

    import vllm_moe_w8
    from vllm_moe_w8 import tiny_models

    sys.path.insert(0, str(STANDIN))
    from vllm_neuron.vllm.platform import NeuronPlatform

    saved = platforms._current_platform
    platforms._current_platform = NeuronPlatform()
    vllm_moe_w8._registered = False
    vllm_moe_w8.register()
    path = tiny_models.write_checkpoint(tmp_path_factory.mktemp("v024") / "q3", "Qwen3MoeForCausalLM",
                                        hidden_size=256, moe_intermediate_size=256, num_hidden_layers=1)
    yield NeuronPlatform, path
    platforms._current_platform = saved
    sys.path.remove(str(STANDIN))


@pytest.fixture(scope="module")
def model_config(neuron):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(neuron[1]), quantization="neuron-w8", dtype="bfloat16")


def test_register_routes_to_the_neuron_glue(neuron):
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from vllm_moe_w8.neuron_glue.registration import WRAPPED
    from vllm_moe_w8.vllm_glue.quant_config import NeuronW8Config

    platform, _ = neuron
    assert "neuron-w8" in QUANTIZATION_METHODS and get_quantization_config("neuron-w8") is NeuronW8Config
    assert "neuron-w8" in platform.supported_quantization
    from vllm_neuron.model.qwen3_moe import Qwen3MoeForCausalLM

    assert getattr(Qwen3MoeForCausalLM.from_configs, WRAPPED, False), "vllm-neuron's factory is wrapped"


def test_model_config_accepts_neuron_w8_on_the_neuron_platform(model_config):
    assert model_config.quantization == "neuron-w8"
    assert model_config.architectures == ["Qwen3MoeForCausalLM"]


def test_the_platform_check_is_real(neuron):
    platform, _ = neuron

    class Unextended(platform.__mro__[1]):  # vLLM 0.24's Platform with vllm-neuron's own list only
        device_name = "neuron"
        supported_quantization = ["neuron_quant", "compressed-tensors", "modelopt", "fp8"]

    with pytest.raises(ValueError, match="neuron-w8 quantization is currently not supported"):
        Unextended.verify_quantization("neuron-w8")


def test_vllm_config_parses_settings_and_passes_the_neuron_checks(neuron, model_config):
    from vllm.config import VllmConfig

    platform, _ = neuron
    vc = VllmConfig(model_config=model_config, additional_config={"neuron_w8": {"mode": "output-block", "self_check": False}})
    assert vc in platform.checked_configs, "the platform's own check_and_update_config still ran"
    from vllm_moe_w8.neuron_glue import settings

    assert settings.requested(vc)
    resolved = settings.resolve(model_config.hf_config.quantization_config, vc.additional_config)
    assert (resolved.mode, resolved.self_check, resolved.fmt.kind) == ("output-block", False, "block")


@pytest.mark.parametrize("extra, message", [
    ({"neuron_w8": {"mode": "lut"}}, "mode 'lut' .* has no NKI kernel"),
    ({"neuron_w8": {"mood": "pow2"}}, r"unknown additional_config\['neuron_w8'\] key\(s\) \['mood'\]"),
])
def test_vllm_config_refuses_bad_settings(model_config, extra, message):
    from vllm.config import VllmConfig

    with pytest.raises(ValueError, match=message):
        VllmConfig(model_config=model_config, additional_config=extra)


@pytest.mark.parametrize("arch, message", [
    # neuron-w8 serves GLM-4.x on vLLM's own model classes, but vllm-neuron has no GLM-4 MoE model
    ("Glm4MoeForCausalLM", r"architecture Glm4MoeForCausalLM with vllm-neuron 0\.24\.0\.standin: not supported\. "
                           r"neuron-w8 replaces the experts of: Qwen3MoeForCausalLM"),
    ("LlamaForCausalLM", r"architecture \['LlamaForCausalLM'\] is not supported by neuron-w8"),
])
def test_vllm_config_refuses_an_architecture(model_config, monkeypatch, arch, message):
    from vllm.config import VllmConfig

    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    monkeypatch.setattr(model_config.hf_config, "architectures", [arch])
    with pytest.raises((NeuronGlueError, ValueError), match=message):
        VllmConfig(model_config=model_config)


def test_quant_config_parsing_on_vllm_024(model_config):
    from vllm_moe_w8.vllm_glue.quant_config import NeuronW8Config

    cfg = model_config.hf_config.quantization_config
    assert NeuronW8Config.override_quantization_method(cfg, "neuron-w8") == "neuron-w8"
    assert NeuronW8Config.from_config(cfg).get_name() == "neuron-w8"
