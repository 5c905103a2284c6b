"""STAND-IN: vllm_neuron/model/neuron_config.py (fork jinhuang12/vllm-neuron @289de16): the parts the glue and the
GLM-5 model read. ``OnDeviceSamplingConfig(all_greedy=False, ...)``; ``NeuronConfig.from_dict(d)`` as the runner
builds it from ``additional_config["neuron_config"]``: ``on_device_sampling_config`` absent -> a default
``OnDeviceSamplingConfig()`` (on-device sampling on, not greedy), explicitly ``None`` -> off, a dict -> its values;
``quantization``, ``ep_degree`` and ``mlp_dp_size`` kept; other fields not reproduced."""

from dataclasses import dataclass, field


def _flag(value) -> bool:
    return value.lower() in ("true", "1", "yes") if isinstance(value, str) else bool(value)


class OnDeviceSamplingConfig:
    def __init__(self, **kwargs):
        self.all_greedy = _flag(kwargs.pop("all_greedy", False))
        self.max_top_k = int(kwargs.pop("max_top_k", 256))
        self.deterministic = _flag(kwargs.pop("deterministic", False))


@dataclass
class NeuronConfig:
    ep_degree: int = 1
    mlp_dp_size: int = 1
    on_device_sampling_config: OnDeviceSamplingConfig | None = field(default_factory=OnDeviceSamplingConfig)
    quantization: str | None = None

    @classmethod
    def from_dict(cls, config_dict: dict) -> "NeuronConfig":
        if config_dict.get("on_device_sampling_config") is not None:
            sampling = OnDeviceSamplingConfig(**config_dict["on_device_sampling_config"])
        elif "on_device_sampling_config" in config_dict:
            sampling = None
        else:
            sampling = OnDeviceSamplingConfig()
        return cls(ep_degree=config_dict.get("ep_degree", 1), mlp_dp_size=config_dict.get("mlp_dp_size", 1),
                   on_device_sampling_config=sampling, quantization=config_dict.get("quantization"))
