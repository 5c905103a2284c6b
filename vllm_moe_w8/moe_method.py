"""``NeuronW8MoEMethod``: routed experts as 1-byte codes + float32 scales, computed by ``moe_w8::fused_moe``.

Loading: the parameters ``w13_weight`` [E, 2I, H] / ``w2_weight`` [E, H, I] (uint8) and
``w13_<suffix>`` / ``w2_<suffix>`` (float32 scale grids; suffix = the checkpoint's scale name) are
filled by vLLM's TP/EP-aware ``RoutedExperts.weight_loader``, wrapped so that

* FP8 bytes are viewed as uint8 before the copy (a plain ``copy_`` would convert the values);
* scale grids are *refined* first when the per-rank intermediate size is not a multiple of the
  checkpoint tile (e.g. 384 / TP2 = 192): every tile is split into ``gcd(I_rank, 128)``-wide tiles
  carrying the parent's scale (exact), the ragged edge is cropped, and vLLM then slices the rank's
  rows/columns as for any other grid. vLLM's own block-FP8 MoE refuses or pads these shapes.

EP: each rank allocates, loads and repacks only its local experts (vLLM's loader skips the others).

Completeness: the wrappers record every (local expert, w1/w3/w2, weight|scale) that vLLM's loader
accepted (a bool grid per layer; TP ranks receive their slice of every expert, EP ranks only their
local experts). :meth:`process_weights_after_loading` refuses the load, naming the checkpoint tensor,
if any never arrived: a tensor listed in the index but absent from its shard, or a weight without its
scale, would otherwise keep the parameter's initial zeros / ones and be served as garbage.

After loading, :meth:`process_weights_after_loading` repacks every local expert with
:func:`vllm_moe_w8.fp8.repack` in the user's mode (pow2 default, output-block, lut; converted
checkpoints are already final), runs the numerics self-check on a few sampled experts (on by
default: the repacked weight must dequantise to the checkpoint's values within the mode's stated
error, else the load stops naming layer and expert), and logs. ``apply`` maps global expert ids to
local ones with ``layer.expert_map`` and calls the custom op.
"""

from __future__ import annotations

import math
import time

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.utils import set_weight_attrs

from vllm_moe_w8 import fp8, moe_op, moe_reference
from vllm_moe_w8.quant_config import NeuronW8Config, runtime_settings
from vllm_moe_w8.self_check import (  # noqa: F401  (re-exported: the errors and bounds callers know from here)
    POW2_BOUND_SLACK, POW2_RNE_ERROR, NumericsSelfCheckError, check_finite, check_projection, check_rounded_count,
)

logger = init_logger("vllm.neuron_w8")

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


class NeuronW8MoEMethod(FusedMoEMethodBase):
    """Routed experts of one MoE layer (see the module docstring)."""

    def __init__(self, quant_config: NeuronW8Config, layer: torch.nn.Module, prefix: str = ""):
        super().__init__(layer.moe_config)
        self.quant_config = quant_config
        self.fmt = quant_config.format
        self.prefix = prefix
        self.settings = runtime_settings(self.fmt)
        self.mode = self.settings.mode
        self.code_format = fp8.CODE_FORMAT[self.mode]
        self.suffix = self.fmt.expert_scale_suffix
        self.ckpt_block = self.fmt.expert_block
        self.load_block = self.ckpt_block
        self.block = self.ckpt_block  # tile of the stored grids after processing
        self.processed = False
        # [local expert, shard w1/w3/w2, weight|scale]: which checkpoint tensors vLLM's loader accepted.
        self.loaded = torch.zeros(0, 3, 2, dtype=torch.bool)
        self.expect_checkpoint_loads = _loads_from_checkpoint()

    # ---- weights --------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        moe = self.moe
        if moe.has_bias:
            raise ValueError(f"neuron-w8: {self.prefix} has expert biases; the supported models (Qwen3/3.5-MoE, GLM-4.x/5) have none")
        activation = getattr(getattr(layer, "activation", None), "value", "silu")
        if activation != "silu":
            raise ValueError(f"neuron-w8: {self.prefix} uses activation {activation!r}; the moe_w8 op implements SwiGLU ('silu') only")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise ValueError(f"neuron-w8: {self.prefix} applies router weights on the input; not supported")
        tp = moe.tp_size
        inter, hidden = intermediate_size_per_partition, hidden_size
        self.num_local, self.hidden, self.inter, self.tp_size = num_experts, hidden, inter, tp
        self.inter_full = inter * tp
        self.load_block = rank_block(self.ckpt_block, inter, tp)
        self.loaded = torch.zeros(num_experts, 3, 2, dtype=torch.bool)
        bn, bk = self.load_block
        g_i, g_h = math.ceil(inter / bn), (1 if bk == 0 else math.ceil(hidden / bk))
        g_h2, g_i2 = math.ceil(hidden / bn), (1 if bk == 0 else math.ceil(inter / bk))
        layer.weight_block_size = list(self.ckpt_block) if self.ckpt_block[1] else None
        layer.orig_dtype = params_dtype

        vllm_loader = extra_weight_attrs.pop("weight_loader")
        # vLLM's loader is the layer's bound method; its global -> local expert map tells us what arrived.
        self._to_local = getattr(getattr(vllm_loader, "__self__", None), "_map_global_expert_id_to_local_expert_id", None)
        attrs = dict(extra_weight_attrs)

        def param(data, loader):
            p = torch.nn.Parameter(data, requires_grad=False)
            set_weight_attrs(p, attrs)
            set_weight_attrs(p, {"weight_loader": loader})
            return p

        layer.register_parameter("w13_weight", param(torch.zeros(num_experts, 2 * inter, hidden, dtype=torch.uint8), self._weight_loader(vllm_loader)))
        layer.register_parameter("w2_weight", param(torch.zeros(num_experts, hidden, inter, dtype=torch.uint8), self._weight_loader(vllm_loader)))
        scale_loader = self._scale_loader(vllm_loader)
        s13 = param(torch.ones(num_experts, 2 * g_i, g_h, dtype=torch.float32), scale_loader)
        s2 = param(torch.ones(num_experts, g_h2, g_i2, dtype=torch.float32), scale_loader)
        # vLLM's loader dispatches scales on this attribute: 'block' slices grids by rank, 'channel' keeps
        # one column (w2's per-row scales are not split by TP).
        kind = "block" if bk > 0 else "channel"
        set_weight_attrs(s13, {"quant_method": kind})
        set_weight_attrs(s2, {"quant_method": kind})
        layer.register_parameter(f"w13_{self.suffix}", s13)
        layer.register_parameter(f"w2_{self.suffix}", s2)
        layer.w13_input_scale = None
        layer.w2_input_scale = None

        qc = self.quant_config
        if qc.moe_layers_created == 0:
            path, why = moe_op.compute_path(layer.w13_weight.device)
            mp = moe.moe_parallel_config
            logger.info(
                "neuron-w8: loading routed experts: method %s, checkpoint %s, mode %s (%s), compute path %s (%s); "
                "TP rank %d/%d, EP rank %d/%d (EP %s); local experts %d of %d; scale tile %s -> %s on this rank; self-check %s",
                type(self).__name__, self.fmt.kind, self.mode, self.settings.mode_source, path, why,
                mp.tp_rank, mp.tp_size, mp.ep_rank, mp.ep_size, "on" if mp.use_ep else "off",
                num_experts, moe.num_experts, self.ckpt_block, self.load_block,
                f"on ({self.settings.self_check_experts} experts/layer)" if self.settings.self_check else "off",
            )
            qc.load_started = time.perf_counter()
        qc.moe_layers_created += 1

    def _ckpt_name(self, shard_id: str, expert_id: int, what: str) -> str:
        return f"{self.prefix}.{expert_id}.{SHARD_PROJ.get(shard_id, shard_id)}.{what}"

    def _weight_loader(self, vllm_loader):
        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            codes = as_codes(loaded_weight, self._ckpt_name(shard_id, expert_id, "weight"))
            ok = vllm_loader(param=param, loaded_weight=codes, weight_name=weight_name, shard_id=shard_id, expert_id=expert_id, return_success=True)
            self._record(ok, codes, shard_id, expert_id, LOADED_WEIGHT)
            return ok if return_success else None

        load.supports_moe_loading = True
        return load

    def _scale_loader(self, vllm_loader):
        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            name = self._ckpt_name(shard_id, expert_id, self.suffix)
            if not loaded_weight.is_floating_point() or loaded_weight.element_size() < 2:
                raise ValueError(f"neuron-w8: scale tensor {name} has dtype {loaded_weight.dtype}; expected float32, bfloat16 or float16")
            full = (self.inter_full, self.hidden) if shard_id in ("w1", "w3") else (self.hidden, self.inter_full)
            grid = regrid_scales(loaded_weight.float(), full, self.ckpt_block, self.load_block, name)
            ok = vllm_loader(param=param, loaded_weight=grid, weight_name=weight_name, shard_id=shard_id, expert_id=expert_id, return_success=True)
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

    def _check_all_loaded(self, layer) -> None:
        """Refuse a layer some of whose expert weights or scales never arrived (they would be served as 0 / 1)."""
        if not self.expect_checkpoint_loads or bool(self.loaded.all()):
            return
        global_ids = self._global_ids(layer)
        missing = []
        for local, shard, kind in (~self.loaded).nonzero().tolist():
            shard_id = ("w1", "w3", "w2")[shard]
            missing.append(self._ckpt_name(shard_id, global_ids[local], "weight" if kind == LOADED_WEIGHT else self.suffix))
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(
            f"neuron-w8: {len(missing)} routed-expert tensor(s) of {self.prefix} never arrived from the checkpoint: {shown}. "
            "Without them the layer would serve zeros (weights) or unit scales. Check that model.safetensors.index.json "
            "lists them and that their shard holds them: re-download the shard (or the whole checkpoint), or re-export "
            "/ re-convert it"
        )

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    # ---- repack -----------------------------------------------------------------------------------
    def _global_ids(self, layer) -> list[int]:
        emap = layer.expert_map
        if emap is None:
            return list(range(self.num_local))
        ids = [0] * self.num_local
        for g, local in enumerate(emap.tolist()):
            if 0 <= local < self.num_local:
                ids[local] = g
        return ids

    def _sampled(self) -> list[int]:
        n = min(self.settings.self_check_experts, self.num_local) if self.settings.self_check else 0
        if n <= 0:
            return []
        return sorted({round(i * (self.num_local - 1) / max(n - 1, 1)) for i in range(n)})

    def process_weights_after_loading(self, layer) -> None:
        if self.processed:
            return
        t0 = time.perf_counter()
        self._check_all_loaded(layer)
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        s13, s2 = getattr(layer, f"w13_{self.suffix}").data, getattr(layer, f"w2_{self.suffix}").data
        inter, block = self.inter, self.load_block
        g_i = math.ceil(inter / block[0])
        bytes_before = w13.numel() + w2.numel() + 4 * (s13.numel() + s2.numel())
        global_ids = self._global_ids(layer)
        sampled = self._sampled()
        stats = fp8.RepackStats()

        if self.fmt.converted:
            new_block, new_s13, new_s2 = block, s13, s2
            originals = {}
        else:
            new_block = (fp8.OUTPUT_BLOCK_ROWS, 0) if self.mode == "output-block" else block
            ob_rows = math.ceil(inter / new_block[0])
            if self.mode == "output-block":
                new_s13 = torch.empty(self.num_local, 2 * ob_rows, 1, dtype=torch.float32)
                new_s2 = torch.empty(self.num_local, math.ceil(self.hidden / new_block[0]), 1, dtype=torch.float32)
            else:
                new_s13, new_s2 = s13, s2  # same grid: updated in place
            originals = {e: (w13[e].clone(), s13[e].clone(), w2[e].clone(), s2[e].clone()) for e in sampled}
            rounded_per_expert = {}
            for e in range(self.num_local):
                name = f"{self.prefix}.{global_ids[e]}"
                parts = [
                    (w13[e, :inter], s13[e, :g_i], new_s13, (slice(0, ob_rows) if self.mode == "output-block" else slice(0, g_i)), "gate_proj", True),
                    (w13[e, inter:], s13[e, g_i:], new_s13, (slice(ob_rows, 2 * ob_rows) if self.mode == "output-block" else slice(g_i, 2 * g_i)), "up_proj", True),
                    (w2[e], s2[e], new_s2, slice(None), "down_proj", False),
                ]
                changed = 0
                for codes, scales, dst_scales, rows, proj, _ in parts:
                    rep = fp8.repack(codes, scales, self.mode, block, name=f"{name}.{proj}.weight")
                    codes.copy_(rep.codes)
                    dst_scales[e, rows] = rep.scale_grid
                    stats = stats.add(rep.stats)
                    changed += rep.stats.values_changed
                rounded_per_expert[e] = changed
        self.block = new_block
        if new_s13 is not s13:
            _replace(layer, f"w13_{self.suffix}", new_s13)
            _replace(layer, f"w2_{self.suffix}", new_s2)
        if sampled:
            self._self_check(layer, sampled, originals, global_ids, rounded_per_expert if originals else {})
        self.processed = True
        self._prepare_neuron(layer)
        seconds = time.perf_counter() - t0
        bytes_after = w13.numel() + w2.numel() + 4 * (new_s13.numel() + new_s2.numel())
        logger.debug(
            "neuron-w8: %s repacked %d experts (%s): blocks shifted %d/%d, values rounded %d, %.3f s",
            self.prefix, self.num_local, self.mode, stats.blocks_shifted, stats.blocks, stats.values_changed, seconds,
        )
        self._account(bytes_before, bytes_after, stats, seconds, len(sampled))

    def _prepare_neuron(self, layer) -> None:
        """On a Neuron device, lay the experts out for the NKI kernels once, at load (not at the first call)."""
        if layer.w13_weight.device.type == "cpu" or not moe_op.neuron_status()[0]:
            return
        from vllm_moe_w8 import neuron_binding

        supports = getattr(neuron_binding, "supports", None)
        if supports is not None:
            ok, why = supports(self.block[0], self.block[1], self.code_format)
            if not ok:
                raise ValueError(
                    f"neuron-w8: {self.prefix} (mode {self.mode}, scale tile {self.block}, codes {self.code_format}) has no NKI "
                    f"kernel on this Neuron device: {why}. Use mode pow2 or output-block, or expert parallelism instead of a "
                    "TP split that refines the tile"
                )
        neuron_binding.prepare_weights(
            layer.w13_weight, getattr(layer, f"w13_{self.suffix}"), layer.w2_weight, getattr(layer, f"w2_{self.suffix}"),
            self.block[0], self.block[1], self.code_format,
        )

    def _self_check(self, layer, sampled, originals, global_ids, rounded_per_expert) -> None:
        """Dequantise the stored (op-layout) weights of ``sampled`` experts and compare with the checkpoint."""
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        s13, s2 = getattr(layer, f"w13_{self.suffix}").data, getattr(layer, f"w2_{self.suffix}").data
        inter, block = self.inter, self.load_block
        g_i = math.ceil(inter / block[0])
        for e in sampled:
            where = f"layer {self.prefix}, expert {global_ids[e]} (local {e})"
            gate, up = moe_reference.dequantize_w13(w13, s13, e, self.block, self.code_format)
            down = moe_reference.dequantize_expert(w2[e], s2[e], self.block, self.code_format)
            got = {"gate_proj": gate, "up_proj": up, "down_proj": down}
            check_finite(got, where, self.code_format, self.mode)
            if not originals:  # converted checkpoint: no source values here; finiteness is what we can check
                continue
            c13, o13, c2, o2 = originals[e]
            want = {
                "gate_proj": (c13[:inter], o13[:g_i]),
                "up_proj": (c13[inter:], o13[g_i:]),
                "down_proj": (c2, o2),
            }
            n_diff = 0
            for proj, (codes, scales) in want.items():
                new_scale_el = None
                if self.mode == "output-block":
                    new_scale_el = fp8.expand_scales(_rows_scale(got, proj, layer, self, e), tuple(codes.shape), self.block)
                n_diff += check_projection(got[proj], codes, scales, block, self.mode, where, proj, new_scale_el)
            check_rounded_count(self.mode, n_diff, rounded_per_expert.get(e, 0), where)

    def _account(self, before: int, after: int, stats: fp8.RepackStats, seconds: float, checked: int) -> None:
        qc = self.quant_config
        acc = qc.load_stats
        for key, value in (
            ("layers", 1), ("bytes_before", before), ("bytes_after", after), ("blocks", stats.blocks),
            ("blocks_shifted", stats.blocks_shifted), ("values_rounded", stats.values_changed), ("seconds", seconds),
            ("checked_experts", checked),
        ):
            acc[key] = acc.get(key, 0) + value
        acc["max_abs_error"] = max(acc.get("max_abs_error", 0.0), stats.max_abs_error)
        qc.moe_layers_processed += 1
        if qc.moe_layers_processed == qc.moe_layers_created:
            wall = time.perf_counter() - getattr(qc, "load_started", time.perf_counter())
            logger.info(
                "neuron-w8: processed %d MoE layers (mode %s%s): expert bytes %.2f MB before -> %.2f MB after; "
                "blocks shifted %d of %d; values rounded %d (max abs error %.3g); self-check %s; repack %.2f s "
                "(%.2f s since loading started)",
                int(acc["layers"]), self.mode, ", converted checkpoint: no repack" if self.fmt.converted else "",
                acc["bytes_before"] / 1e6, acc["bytes_after"] / 1e6, int(acc["blocks_shifted"]), int(acc["blocks"]),
                int(acc["values_rounded"]), acc["max_abs_error"],
                f"passed on {int(acc['checked_experts'])} experts" if acc["checked_experts"] else "off",
                acc["seconds"], wall,
            )

    # ---- compute ----------------------------------------------------------------------------------
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        ids = topk_ids
        emap = layer.expert_map
        if emap is not None:
            ids = emap[topk_ids.long()]
        limit = getattr(layer, "swiglu_limit", None)
        return torch.ops.moe_w8.fused_moe(
            x, topk_weights.to(torch.float32), ids,
            layer.w13_weight, getattr(layer, f"w13_{self.suffix}"),
            layer.w2_weight, getattr(layer, f"w2_{self.suffix}"),
            self.block[0], self.block[1], self.code_format, "silu", float(limit or 0.0),
        )


def _loads_from_checkpoint() -> bool:
    """False under ``load_format='dummy'`` (vLLM fills random weights without calling the loaders)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        vc = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - vLLM without this helper
        return True
    load_format = getattr(getattr(vc, "load_config", None), "load_format", None)
    return str(getattr(load_format, "value", load_format) or "").lower() != "dummy"


def _rows_scale(got, proj, layer, method, e):
    """Output-block row scales [rows, 1] of one projection of local expert ``e`` (after processing)."""
    s13 = getattr(layer, f"w13_{method.suffix}").data
    s2 = getattr(layer, f"w2_{method.suffix}").data
    rows = math.ceil(method.inter / method.block[0])
    if proj == "gate_proj":
        return s13[e, :rows]
    if proj == "up_proj":
        return s13[e, rows:]
    return s2[e]


def _replace(layer: torch.nn.Module, name: str, data: torch.Tensor) -> None:
    old = getattr(layer, name)
    new = torch.nn.Parameter(data, requires_grad=False)
    for key, value in vars(old).items():
        if not key.startswith("_"):
            setattr(new, key, value)
    delattr(layer, name)
    layer.register_parameter(name, new)
