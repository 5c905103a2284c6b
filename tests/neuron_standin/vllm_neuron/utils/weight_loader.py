"""STAND-IN: vllm_neuron/utils/weight_loader.py (fork jinhuang12/vllm-neuron @10c6804): set_weight_loader /
get_weight_loader, the loader object's load(slices, rank), and the two helpers the Qwen3.5 mixers use:
``sharding_weight_loader`` (the shard ``(rank % num_shards) * shard_size`` along ``shard_dim`` of the parameter, i.e.
of the checkpoint's other dim when the storage is transposed, then transposed) and ``with_rank_override``."""

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


def sharding_weight_loader(shard_dim: int, shard_size: int, num_shards: int, is_storage_transposed: bool = False):
    def transform(slices, rank):
        sl = slices[0]
        dim = 1 - shard_dim if is_storage_transposed and shard_dim in (0, 1) else shard_dim
        index = [slice(None)] * len(sl.get_shape())
        start = (rank % num_shards) * shard_size
        index[dim] = slice(start, start + shard_size)
        out = sl[tuple(index)]
        return out.T if is_storage_transposed else out

    return SafetensorsWeightLoader(transform=transform)


def with_rank_override(loader, rank: int):
    return SafetensorsWeightLoader(transform=lambda slices, _rank: loader.load(slices, rank))
