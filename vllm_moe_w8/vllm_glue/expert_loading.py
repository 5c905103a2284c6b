"""Loading one MoE layer's routed experts through vLLM's loader, and accounting for what arrived.

vLLM's TP/EP-aware ``RoutedExperts.weight_loader`` does the slicing; :class:`ExpertLoads` wraps it so that

* FP8 bytes are viewed as uint8 before the copy (a plain ``copy_`` would convert the values: :func:`as_codes`);
* scale grids are *refined* first when the per-rank intermediate size is not a multiple of the checkpoint
  tile (e.g. 384 / TP2 = 192): every tile is split into ``gcd(I_rank, 128)``-wide tiles carrying the
  parent's scale (exact, :func:`regrid_scales`, tile from :func:`rank_block`), the ragged edge is cropped,
  and vLLM then slices the rank's rows/columns as for any other grid;
* every (local expert, w1/w3/w2, weight|scale) that vLLM's loader accepted is recorded in a bool grid
  (TP ranks receive their slice of every expert, EP ranks only their local experts), and
  :meth:`ExpertLoads.check_complete` refuses the layer, naming the checkpoint tensor, if any never arrived:
  it would otherwise keep the parameter's initial zeros / ones and be served as garbage.
"""

from __future__ import annotations

import math

import torch

from vllm_moe_w8.codec import fp8

SHARD_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
SHARD_INDEX = {"w1": 0, "w3": 1, "w2": 2}
LOADED_WEIGHT, LOADED_SCALE = 0, 1


def rank_block(block: tuple[int, int], size_per_rank: int, tp_size: int) -> tuple[int, int]:
    """Scale tile on one rank: ``block`` refined to ``gcd(size_per_rank, b)`` where TP splits a tile."""
    bn, bk = block
    if tp_size <= 1:
        return block
    if bn > 1 and size_per_rank % bn:
        bn = math.gcd(size_per_rank, bn)
    if bk > 0 and size_per_rank % bk:
        bk = math.gcd(size_per_rank, bk)
    return bn, bk


def regrid_scales(scale: torch.Tensor, full_shape: tuple[int, int], src: tuple[int, int], dst: tuple[int, int], name: str) -> torch.Tensor:
    """Scale grid of an [N, K] weight over ``src`` tiles -> grid over ``dst`` tiles (each inside a ``src`` tile).

    Exact: a refined tile carries its parent tile's scale. Checks the grid's shape against the weight.
    """
    if src[1] == 0 and scale.dim() == 1:
        scale = scale.unsqueeze(-1)
    expected = fp8.grid_shape(full_shape, src)
    if tuple(scale.shape[-2:]) != expected:
        per = "per-channel [N, 1]" if src == (1, 0) else (f"{src[0]}-row blocks [ceil(N/{src[0]}), 1]" if src[1] == 0 else f"{src[0]}x{src[1]} blocks")
        raise ValueError(
            f"neuron-w8: scale tensor {name} has shape {tuple(scale.shape)}; the weight {tuple(full_shape)} with {per} "
            f"needs {expected}. Check weight_block_size in the checkpoint's quantization_config"
        )
    if dst == src:
        return scale
    (sbn, sbk), (dbn, dbk) = src, dst
    if sbn % dbn or (sbk and (dbk == 0 or sbk % dbk)):
        raise ValueError(f"neuron-w8: cannot refine {src} scale tiles to {dst} for {name}")
    out = scale
    if dbn != sbn:
        out = out.repeat_interleave(sbn // dbn, dim=-2)[..., : math.ceil(full_shape[0] / dbn), :]
    if sbk and dbk != sbk:
        out = out.repeat_interleave(sbk // dbk, dim=-1)[..., : math.ceil(full_shape[1] / dbk)]
    return out.contiguous()


def as_codes(loaded: torch.Tensor, name: str) -> torch.Tensor:
    """FP8 checkpoint bytes as uint8 (a view: no value conversion)."""
    if loaded.dtype == torch.float8_e4m3fn:
        return loaded.view(torch.uint8)
    if loaded.dtype == torch.uint8:
        return loaded
    raise ValueError(
        f"neuron-w8: routed-expert tensor {name} is {loaded.dtype}; neuron-w8 loads OCP E4M3FN (float8_e4m3fn) "
        "expert weights, or uint8 codes of a converted checkpoint. Is this a BF16 or a differently quantised checkpoint?"
    )


def loads_from_checkpoint() -> bool:
    """False under ``load_format='dummy'`` (vLLM fills random weights without calling the loaders)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        vc = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - vLLM without this helper
        return True
    load_format = getattr(getattr(vc, "load_config", None), "load_format", None)
    return str(getattr(load_format, "value", load_format) or "").lower() != "dummy"


class ExpertLoads:
    """The loader wrappers of one MoE layer and the record of which checkpoint tensors they accepted."""

    def __init__(self, vllm_loader, *, prefix: str, scale_suffix: str, num_local: int, hidden: int, inter_full: int,
                 ckpt_block: tuple[int, int], load_block: tuple[int, int], expect_checkpoint_loads: bool = True):
        self.vllm_loader = vllm_loader
        self.prefix, self.scale_suffix = prefix, scale_suffix
        self.hidden, self.inter_full = hidden, inter_full
        self.ckpt_block, self.load_block = ckpt_block, load_block
        self.expect_checkpoint_loads = expect_checkpoint_loads
        # [local expert, shard w1/w3/w2, weight|scale]: which checkpoint tensors vLLM's loader accepted.
        self.loaded = torch.zeros(num_local, 3, 2, dtype=torch.bool)
        # vLLM's loader is the layer's bound method; its global -> local expert map tells us what arrived.
        self._to_local = getattr(getattr(vllm_loader, "__self__", None), "_map_global_expert_id_to_local_expert_id", None)

    def checkpoint_name(self, shard_id: str, expert_id: int, what: str) -> str:
        return f"{self.prefix}.{expert_id}.{SHARD_PROJ.get(shard_id, shard_id)}.{what}"

    def weight_loader(self):
        """vLLM-style loader for ``w13_weight`` / ``w2_weight``: FP8 bytes copied as uint8 codes."""
        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            codes = as_codes(loaded_weight, self.checkpoint_name(shard_id, expert_id, "weight"))
            ok = self.vllm_loader(param=param, loaded_weight=codes, weight_name=weight_name, shard_id=shard_id,
                                  expert_id=expert_id, return_success=True)
            self._record(ok, codes, shard_id, expert_id, LOADED_WEIGHT)
            return ok if return_success else None

        load.supports_moe_loading = True
        return load

    def scale_loader(self):
        """vLLM-style loader for the scale grids: float32, refined to this rank's tile before vLLM slices it."""
        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            name = self.checkpoint_name(shard_id, expert_id, self.scale_suffix)
            if not loaded_weight.is_floating_point() or loaded_weight.element_size() < 2:
                raise ValueError(f"neuron-w8: scale tensor {name} has dtype {loaded_weight.dtype}; expected float32, bfloat16 or float16")
            full = (self.inter_full, self.hidden) if shard_id in ("w1", "w3") else (self.hidden, self.inter_full)
            grid = regrid_scales(loaded_weight.float(), full, self.ckpt_block, self.load_block, name)
            ok = self.vllm_loader(param=param, loaded_weight=grid, weight_name=weight_name, shard_id=shard_id,
                                  expert_id=expert_id, return_success=True)
            self._record(ok, grid, shard_id, expert_id, LOADED_SCALE)
            return ok if return_success else None

        load.supports_moe_loading = True
        return load

    def _record(self, ok, loaded: torch.Tensor, shard_id: str, expert_id: int, kind: int) -> None:
        """Note that vLLM's loader accepted ``shard_id`` of global expert ``expert_id`` (all experts if 3-D)."""
        if not ok or shard_id not in SHARD_INDEX:
            return
        if loaded.dim() == 3:  # a fused [E, ...] tensor fills every local expert at once
            self.loaded[:, SHARD_INDEX[shard_id], kind] = True
            return
        local = int(self._to_local(expert_id)) if self._to_local is not None else int(expert_id)
        if 0 <= local < self.loaded.shape[0]:
            self.loaded[local, SHARD_INDEX[shard_id], kind] = True

    def check_complete(self, global_ids: list[int]) -> None:
        """Refuse a layer some of whose expert weights or scales never arrived (they would be served as 0 / 1)."""
        if not self.expect_checkpoint_loads or bool(self.loaded.all()):
            return
        missing = []
        for local, shard, kind in (~self.loaded).nonzero().tolist():
            shard_id = ("w1", "w3", "w2")[shard]
            missing.append(self.checkpoint_name(shard_id, global_ids[local], "weight" if kind == LOADED_WEIGHT else self.scale_suffix))
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(
            f"neuron-w8: {len(missing)} routed-expert tensor(s) of {self.prefix} never arrived from the checkpoint: {shown}. "
            "Without them the layer would serve zeros (weights) or unit scales. Check that model.safetensors.index.json "
            "lists them and that their shard holds them: re-download the shard (or the whole checkpoint), or re-export "
            "/ re-convert it"
        )
