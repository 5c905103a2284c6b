"""STAND-IN: vllm_neuron/utils/weight_loader.py (set_weight_loader and the loader object's load(slices, rank))."""

from dataclasses import dataclass
from typing import Callable

_WEIGHT_LOADER_ATTR = "weight_loader"


@dataclass
class SafetensorsWeightLoader:
    transform: Callable = None

    def load(self, slices, rank):
        out = self.transform(slices, rank) if self.transform else slices[0][:]
        return out.contiguous()


def set_weight_loader(param, loader) -> None:
    setattr(param, _WEIGHT_LOADER_ATTR, loader)


def get_weight_loader(param):
    return getattr(param, _WEIGHT_LOADER_ATTR, SafetensorsWeightLoader())


def transposed_shard_loader(shard_dim: int, shard_size: int) -> SafetensorsWeightLoader:
    """[out, in] checkpoint -> [in, out] parameter, sharded on ``shard_dim`` of the parameter (o_proj-like)."""

    def transform(slices, rank):
        full = slices[0][:].T
        start = rank * shard_size
        return full.narrow(shard_dim, start, shard_size)

    return SafetensorsWeightLoader(transform=transform)
