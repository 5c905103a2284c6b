"""STAND-IN: vllm_neuron/vllm/platform.py NeuronPlatform (the attributes the glue reads or wraps)."""

from vllm.platforms import Platform, PlatformEnum


class NeuronPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    supported_quantization: list[str] = ["neuron_quant", "compressed-tensors", "modelopt", "fp8"]
    checked_configs: list = []

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        cls.checked_configs.append(vllm_config)
