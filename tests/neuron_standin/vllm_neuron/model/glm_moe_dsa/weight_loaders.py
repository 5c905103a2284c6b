"""STAND-IN: vllm_neuron/model/glm_moe_dsa/weight_loaders.py (fork @41758812): the checkpoint manifest and the
rank-local plan, with the fork's checks and the fork's way of binding its pins.

* pins: ``PINNED_INDEX_KEY_COUNT`` (118,629 keys), ``PINNED_CONTRACT`` (78 main layers + 1 MTP,
  ``first_k_dense_replace`` 3, 256 experts, the indexer layers), ``PINNED_EP`` (EP 64 over TP 64). As in the fork
  they are *default arguments*, bound when this module is imported: ``load_checkpoint_index(...,
  expected_key_count=PINNED_INDEX_KEY_COUNT)``, ``load_checkpoint_manifest(..., contract=PINNED_CONTRACT,
  expected_key_count=...)``, ``local_load_plan(..., ep=PINNED_EP)`` - assigning the module constants afterwards
  changes nothing (tests re-bind the defaults, tests/_glue_families.py);
* the index: exactly ``{"metadata", "weight_map"}``, a positive ``metadata.total_size``, the pinned key count;
* the key grammar, failing closed (``UnexpectedCheckpointKey``): outer keys (embedding, final norm, lm_head),
  layer norms, MLA attention, indexer tensors only on the contract's indexer layers, dense MLP only below
  ``first_k_dense_replace``, router / routed experts (index < the contract's expert count) / shared expert only
  from it on, MTP-only tensors only on MTP layers; an MTP layer's keys are an intentional skip;
* headers: each shard's header lists exactly the index's keys for it; every FP8 weight has its fp32
  ``weight_scale_inv`` of the 128x128 grid and every scale its weight (``quantization.validate_header_pair``);
* ``ExpertParallelContract(num_routed_experts, world_size, tensor_parallel_world_size)``: owner = expert //
  (experts / EP); every other non-MTP key is loaded by every rank;
* ``tp_shard_spec_for_key``: the fork's TP rule per key (replicated q_a / kv_a / router / routed experts, dim-0
  q_b / kv_b / shared and dense gate-up, dim-1 o_proj and down projections), ValueError for the others."""

import json
import math
import re
import struct
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

PINNED_INDEX_KEY_COUNT = 118_629
PINNED_TP_SIZE = 64
PINNED_EP_SIZE = 64


class UnexpectedCheckpointKey(ValueError):
    pass


class HeaderMismatch(ValueError):
    pass


class Disposition(str, Enum):
    LOAD_TARGET = "load_target"
    FP8_SCALE = "fp8_scale_metadata"
    INTENTIONAL_SKIP = "intentional_main_workload_skip"


class TensorCategory(str, Enum):
    OUTER = "outer"
    LAYER_NORM = "layer_norm"
    ATTENTION = "attention"
    DENSE_MLP = "dense_mlp"
    ROUTER = "router"
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    MTP = "mtp"


@dataclass(frozen=True)
class GlmMoeDsaCheckpointContract:
    num_hidden_layers: int = 78
    num_nextn_predict_layers: int = 1
    first_k_dense_replace: int = 3
    num_routed_experts: int = 256
    indexer_layer_indices: tuple = (0, 1, 2) + tuple(range(6, 79, 4))

    @property
    def mtp_layer_indices(self):
        return tuple(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers))

    @property
    def all_layer_indices(self):
        return tuple(range(self.num_hidden_layers + self.num_nextn_predict_layers))


PINNED_CONTRACT = GlmMoeDsaCheckpointContract()


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
class CheckpointIndex:
    path: Path
    key_to_shard: dict
    total_size: int

    @classmethod
    def from_file(cls, path, *, expected_key_count=None):
        raw = json.loads(Path(path).read_text())
        if set(raw) != {"metadata", "weight_map"}:
            raise ValueError(f"Unexpected index fields: {sorted(raw)}")
        weight_map = raw["weight_map"]
        if expected_key_count is not None and len(weight_map) != expected_key_count:
            raise ValueError(f"Checkpoint index has {len(weight_map)} keys; expected {expected_key_count}")
        total = raw["metadata"].get("total_size")
        if not isinstance(total, int) or total <= 0:
            raise ValueError("metadata.total_size must be a positive integer")
        return cls(Path(path), weight_map, total)


@dataclass(frozen=True)
class CheckpointManifest:
    index: CheckpointIndex
    entries: tuple

    @property
    def by_key(self):
        return {e.key: e for e in self.entries}


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PROJ = r"(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$"
_ROUTED = re.compile(r"^mlp\.experts\.(\d+)\." + _PROJ)
_SHARED = re.compile(r"^mlp\.shared_experts\." + _PROJ)
_DENSE = re.compile(r"^mlp\." + _PROJ)
_OUTER = {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}
_NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight"}
_ATTENTION = {"self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight"} | {
    f"self_attn.{p}.{t}" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    for t in ("weight", "weight_scale_inv")}
_INDEXER = {"self_attn.indexer." + s for s in ("k_norm.bias", "k_norm.weight", "weights_proj.weight", "wk.weight",
                                               "wk.weight_scale_inv", "wq_b.weight", "wq_b.weight_scale_inv")}
_ROUTER = {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
_MTP_ONLY = {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"}


def _category(layer, suffix, contract, key):
    moe = layer >= contract.first_k_dense_replace
    if suffix in _NORMS:
        return TensorCategory.LAYER_NORM, None
    if suffix in _ATTENTION:
        return TensorCategory.ATTENTION, None
    if suffix in _INDEXER:
        if layer not in contract.indexer_layer_indices:
            raise UnexpectedCheckpointKey(f"Indexer tensor is on an undeclared indexer layer: {key}")
        return TensorCategory.ATTENTION, None
    if _DENSE.match(suffix):
        if moe:
            raise UnexpectedCheckpointKey(f"Dense MLP tensor is on a MoE layer: {key}")
        return TensorCategory.DENSE_MLP, None
    routed, shared = _ROUTED.match(suffix), _SHARED.match(suffix)
    what = "Router" if suffix in _ROUTER else "Expert" if routed else "Shared expert" if shared else None
    if what is not None:
        if not moe:
            raise UnexpectedCheckpointKey(f"{what} tensor is on a dense layer: {key}")
        if routed is None:
            return (TensorCategory.ROUTER if suffix in _ROUTER else TensorCategory.SHARED_EXPERT), None
        expert = int(routed.group(1))
        if not 0 <= expert < contract.num_routed_experts:
            raise UnexpectedCheckpointKey(f"Routed expert {expert} is outside 0..{contract.num_routed_experts - 1}: {key}")
        return TensorCategory.ROUTED_EXPERT, expert
    if suffix in _MTP_ONLY:
        if layer not in contract.mtp_layer_indices:
            raise UnexpectedCheckpointKey(f"MTP-only tensor is on a main layer: {key}")
        return TensorCategory.MTP, None
    raise UnexpectedCheckpointKey(f"Unexpected checkpoint key: {key}")


def classify_checkpoint_key(key, contract=PINNED_CONTRACT):
    if key in _OUTER:
        return KeyInfo(key, Disposition.LOAD_TARGET, TensorCategory.OUTER)
    m = _LAYER.match(key)
    if m is None:
        raise UnexpectedCheckpointKey(f"Unexpected checkpoint key: {key}")
    layer, suffix = int(m.group(1)), m.group(2)
    if layer not in contract.all_layer_indices:
        raise UnexpectedCheckpointKey(f"Layer {layer} is outside the pinned main and MTP topology: {key}")
    category, expert = _category(layer, suffix, contract, key)
    is_scale = suffix.endswith(".weight_scale_inv")
    if layer in contract.mtp_layer_indices:
        disposition, category = Disposition.INTENTIONAL_SKIP, TensorCategory.MTP
    else:
        disposition = Disposition.FP8_SCALE if is_scale else Disposition.LOAD_TARGET
    return KeyInfo(key, disposition, category, layer, expert, is_scale)


def _shard_header(path: Path, shard: str) -> dict:
    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        raw = json.loads(f.read(n))
    return {k: TensorHeader(v["dtype"], tuple(v["shape"]), shard) for k, v in raw.items() if k != "__metadata__"}


def load_checkpoint_index(index_path, *, expected_key_count=PINNED_INDEX_KEY_COUNT):
    return CheckpointIndex.from_file(index_path, expected_key_count=expected_key_count)


def load_checkpoint_manifest(index_path, *, contract=PINNED_CONTRACT, expected_key_count=PINNED_INDEX_KEY_COUNT):
    index = load_checkpoint_index(index_path, expected_key_count=expected_key_count)
    headers = {}
    for shard in sorted(set(index.key_to_shard.values())):
        got = _shard_header(index.path.parent / shard, shard)
        want = {k for k, s in index.key_to_shard.items() if s == shard}
        if set(got) != want:
            raise HeaderMismatch(f"Index/header mismatch for {shard}")
        headers.update(got)
    entries = tuple(ManifestEntry(classify_checkpoint_key(k, contract), headers[k]) for k in sorted(index.key_to_shard))
    by_key = {e.key: e for e in entries}
    for e in entries:
        if e.info.is_scale:
            weight = by_key.get(e.key.removesuffix("_scale_inv"))
            if weight is None:
                raise HeaderMismatch(f"Inverse scale has no weight: {e.key}")
            grid = tuple(math.ceil(n / 128) for n in weight.header.shape)
            if weight.header.dtype != "F8_E4M3" or e.header.dtype != "F32" or e.header.shape != grid:
                raise ValueError(f"FP8 weight/scale pair {e.key} is not E4M3 with an fp32 128x128 grid {grid}")
        elif e.header.dtype == "F8_E4M3" and f"{e.key}_scale_inv" not in by_key:
            raise HeaderMismatch(f"FP8 weight has no inverse scale: {e.key}")
    return CheckpointManifest(index, entries)


@dataclass(frozen=True)
class ExpertParallelContract:
    num_routed_experts: int = 256
    world_size: int = PINNED_EP_SIZE
    tensor_parallel_world_size: int = PINNED_TP_SIZE

    def __post_init__(self):
        if self.num_routed_experts % self.world_size or self.tensor_parallel_world_size % self.world_size:
            raise ValueError(f"EP={self.world_size} does not divide {self.num_routed_experts} experts / "
                             f"TP={self.tensor_parallel_world_size}")

    @property
    def experts_per_rank(self):
        return self.num_routed_experts // self.world_size

    def owner_of_routed_expert(self, expert_index):
        return expert_index // self.experts_per_rank

    def rank_loads(self, info, rank):
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside EP={self.world_size}")
        if info.category is TensorCategory.ROUTED_EXPERT:
            return self.owner_of_routed_expert(info.expert_index) == rank
        return info.category is not TensorCategory.MTP


PINNED_EP = ExpertParallelContract()


def local_load_plan(manifest, *, ep_rank, ep=PINNED_EP):
    return tuple(e for e in manifest.entries
                 if e.info.disposition is not Disposition.INTENTIONAL_SKIP and ep.rank_loads(e.info, ep_rank))


def disposition_counts(entries):
    return Counter(e.info.disposition for e in entries)


@dataclass(frozen=True)
class TPShardSpec:
    global_shape: tuple
    shard_dim: int | None
    world_size: int = PINNED_TP_SIZE

    def slices_for_rank(self, rank):
        slices = [slice(None)] * len(self.global_shape)
        if self.shard_dim is not None:
            size = self.global_shape[self.shard_dim] // self.world_size
            slices[self.shard_dim] = slice(rank * size, (rank + 1) * size)
        return tuple(slices)


_TP_RULES = (  # (key pattern, shard dim), first match wins
    (r"(q_a_proj|kv_a_proj_with_mqa)\.weight$", None), (r"(q_b_proj|kv_b_proj)\.weight$", 0),
    (r"self_attn\.o_proj\.weight$", 1), (r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", None),
    (r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight$", 0), (r"mlp\.(shared_experts\.)?down_proj\.weight$", 1),
    (r"mlp\.gate\.weight$", None),
)


def tp_shard_spec_for_key(key, shape, *, world_size=PINNED_TP_SIZE):
    if key.endswith("weight_scale_inv"):
        raise ValueError("inverse-scale metadata has no TP rule of its own")
    for pattern, dim in _TP_RULES:
        if re.search(pattern, key):
            return TPShardSpec(tuple(shape), dim, world_size)
    raise ValueError(f"No tensor-parallel shard rule for {key}")


def scale_slices_for_weight_shard(global_shape, *, shard_dim, rank, world_size, block=(128, 128)):
    """The 128x128 scale blocks covering one rank's weight shard (quantization.py ``scale_coverage_for_weight_shard``)."""
    slices = [slice(None), slice(None)]
    if shard_dim is not None:
        size = global_shape[shard_dim] // world_size
        lo, hi = rank * size, (rank + 1) * size
        slices[shard_dim] = slice(lo // block[shard_dim], math.ceil(hi / block[shard_dim]))
    return tuple(slices)
