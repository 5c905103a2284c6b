"""STAND-IN: vllm_neuron/model/glm_moe_dsa/factory.py (fork @7d004450): the registry's factory.

``from_configs(hf_config, neuron_config, tensor_parallel_size=None)``: the TP size (default: the TP world) must be
``SUPPORTED_TENSOR_PARALLEL_SIZE`` (64, the fork's frozen contract; tests of tiny models relax it explicitly), the
rank is the TP rank, and the model is ``model.GlmMoeDsaForCausalLM.from_configs(..., tensor_parallel_size=tp,
expert_parallel_rank=rank)``. The fork reads both from ``vllm.distributed`` when torch.distributed is initialised;
the stand-in's ranks are threads, so it reads its own process group."""

from torch import nn

from vllm_neuron.parallel import neuron_parallel_state as ps


class GlmMoeDsaForCausalLM(nn.Module):
    SUPPORTED_TENSOR_PARALLEL_SIZE = 64

    @classmethod
    def from_configs(cls, hf_config, neuron_config, tensor_parallel_size=None):
        return cls._select_implementation(hf_config, neuron_config, tensor_parallel_size)

    @classmethod
    def _select_implementation(cls, hf_config, neuron_config, tensor_parallel_size):
        tp = tensor_parallel_size if tensor_parallel_size is not None else ps.get_tp_group().world_size
        if tp != cls.SUPPORTED_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"GLM-5.2 supports tensor_parallel_size={cls.SUPPORTED_TENSOR_PARALLEL_SIZE}; got {tp!r}")
        from .model import GlmMoeDsaForCausalLM as Model

        return Model.from_configs(hf_config, neuron_config, tensor_parallel_size=tp,
                                  expert_parallel_rank=ps.get_tp_group().rank_in_group)
