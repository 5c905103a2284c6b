"""STAND-IN: the parts of vllm_neuron/model/glm_moe_dsa/weight_loaders.py (fork @41758812) and quantization.py the
load path uses: the checkpoint manifest (index keys with their safetensors headers, each classified), the pure-EP
ownership of routed experts (``ExpertParallelContract``: rank ``r`` owns experts ``[r*E/EP, (r+1)*E/EP)``), the
rank-local load plan, the TP shard rule per key (routed experts never sharded: EP spans the TP world) and the scale
blocks covering a weight shard.

Differences, labelled: the fork pins the real checkpoint (118,629 keys, 141 shards, EP 64 over 256 experts,
``PINNED_EP``) and classifies every key of GLM-5's grammar, failing closed; the stand-in keeps the pin as
``PINNED_EP`` (tests of tiny models replace it with their world) and classifies only the categories of the MoE path
it builds (post-attention norm, dense MLP, router, routed and shared experts); other keys are ``OTHER`` and outside
its plan."""

import math
import re
from dataclasses import dataclass
from enum import Enum

from safetensors import safe_open


class Disposition(str, Enum):
    LOAD_TARGET = "load_target"
    FP8_SCALE = "fp8_scale_metadata"


class TensorCategory(str, Enum):
    LAYER_NORM = "layer_norm"
    DENSE_MLP = "dense_mlp"
    ROUTER = "router"
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    OTHER = "other (not built by the stand-in)"


@dataclass(frozen=True)
class KeyInfo:
    key: str
    disposition: Disposition
    category: TensorCategory
    layer_index: int | None = None
    expert_index: int | None = None
    is_scale: bool = False


@dataclass(frozen=True)
class TensorHeader:
    dtype: str
    shape: tuple
    shard: str


@dataclass(frozen=True)
class ManifestEntry:
    info: KeyInfo
    header: TensorHeader

    @property
    def key(self):
        return self.info.key


@dataclass(frozen=True)
class CheckpointManifest:
    entries: tuple

    @property
    def by_key(self):
        return {e.key: e for e in self.entries}


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ROUTED = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_SHARED = re.compile(r"^mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_DENSE = re.compile(r"^mlp\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_ROUTER = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def classify_checkpoint_key(key):
    m = _LAYER_RE.match(key)
    layer, suffix = (int(m.group(1)), m.group(2)) if m else (None, key)
    expert = None
    if suffix == "post_attention_layernorm.weight":
        category = TensorCategory.LAYER_NORM
    elif suffix in _ROUTER:
        category = TensorCategory.ROUTER
    elif (r := _ROUTED.match(suffix)) is not None:
        category, expert = TensorCategory.ROUTED_EXPERT, int(r.group(1))
    elif _SHARED.match(suffix):
        category = TensorCategory.SHARED_EXPERT
    elif _DENSE.match(suffix):
        category = TensorCategory.DENSE_MLP
    else:
        category = TensorCategory.OTHER
    is_scale = key.endswith(".weight_scale_inv")
    return KeyInfo(key, Disposition.FP8_SCALE if is_scale else Disposition.LOAD_TARGET, category, layer, expert, is_scale)


def load_checkpoint_manifest(index_path):
    """Every index key with its header (dtype, shape), classified (the fork also validates FP8 weight/scale pairs)."""
    import json
    from pathlib import Path

    index_path = Path(index_path)
    weight_map = json.loads(index_path.read_text())["weight_map"]
    headers = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(index_path.parent / shard), framework="pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                headers[k] = TensorHeader(s.get_dtype(), tuple(s.get_shape()), shard)
    return CheckpointManifest(tuple(ManifestEntry(classify_checkpoint_key(k), headers[k]) for k in sorted(weight_map)))


@dataclass(frozen=True)
class ExpertParallelContract:
    num_routed_experts: int = 256
    world_size: int = 64

    @property
    def experts_per_rank(self):
        return self.num_routed_experts // self.world_size

    def owner_of_routed_expert(self, expert_index):
        return expert_index // self.experts_per_rank

    def rank_loads(self, info, rank):
        if info.category is TensorCategory.ROUTED_EXPERT:
            return self.owner_of_routed_expert(info.expert_index) == rank
        return info.category is not TensorCategory.OTHER


PINNED_EP = ExpertParallelContract()


def local_load_plan(manifest, *, ep_rank, ep=None):
    ep = ep or PINNED_EP
    return tuple(e for e in manifest.entries if ep.rank_loads(e.info, ep_rank))


@dataclass(frozen=True)
class TPShardSpec:
    global_shape: tuple
    shard_dim: int | None
    world_size: int = 64

    def slices_for_rank(self, rank):
        slices = [slice(None)] * len(self.global_shape)
        if self.shard_dim is not None:
            size = self.global_shape[self.shard_dim] // self.world_size
            slices[self.shard_dim] = slice(rank * size, (rank + 1) * size)
        return tuple(slices)


def tp_shard_spec_for_key(key, shape, *, world_size=64):
    if re.search(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", key):
        dim = None  # pure EP: each owned routed expert keeps its full width
    elif re.search(r"mlp\.(?:shared_experts\.)?(gate|up)_proj\.weight$", key):
        dim = 0
    elif re.search(r"mlp\.(?:shared_experts\.)?down_proj\.weight$", key):
        dim = 1
    elif key.endswith("mlp.gate.weight"):
        dim = None
    else:
        raise ValueError(f"No tensor-parallel shard rule for {key}")
    return TPShardSpec(tuple(shape), dim, world_size)


def scale_slices_for_weight_shard(global_shape, *, shard_dim, rank, world_size, block=(128, 128)):
    """The 128x128 scale blocks covering one rank's weight shard (quantization.py ``scale_coverage_for_weight_shard``)."""
    slices = [slice(None), slice(None)]
    if shard_dim is not None:
        size = global_shape[shard_dim] // world_size
        lo, hi = rank * size, (rank + 1) * size
        slices[shard_dim] = slice(lo // block[shard_dim], math.ceil(hi / block[shard_dim]))
    return tuple(slices)
