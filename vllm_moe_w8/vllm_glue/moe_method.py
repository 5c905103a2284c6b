"""``NeuronW8MoEMethod``: routed experts as 1-byte codes + float32 scales, computed by ``moe_w8::fused_moe``.

The method's life, one step per phase vLLM drives:

1. ``create_weights``: the parameters ``w13_weight`` [E, 2I, H] / ``w2_weight`` [E, H, I] (uint8) and
   ``w13_<suffix>`` / ``w2_<suffix>`` (float32 scale grids; suffix = the checkpoint's scale name), filled
   through the loader wrappers of :class:`vllm_moe_w8.vllm_glue.expert_loading.ExpertLoads` (uint8 views,
   scale grids refined for a ragged TP split, completeness accounting). EP: each rank allocates, loads and
   repacks only its local experts (vLLM's loader skips the others).
2. ``process_weights_after_loading``: refuse a layer whose tensors did not all arrive; repack every local
   expert with :func:`vllm_moe_w8.codec.fp8.repack` in the settings' mode (pow2 default, output-block,
   lut; a converted checkpoint is already final); run the numerics self-check
   (:mod:`vllm_moe_w8.vllm_glue.self_check`) on a few sampled experts; on a Neuron device, lay the experts
   out for the NKI kernels once; report to the model's load summary.
   On CPU, where ``cpu_vllm_fp8.decide`` picks vLLM's own FP8 kernel (AMX hosts where the layout fits, or
   ``VLLM_MOE_W8_CPU_KERNEL=vllm-fp8``), the codes are replaced by vLLM's prepacked copy of them.
3. ``apply``: map global expert ids to local ones with ``layer.expert_map`` and call the custom op (or vLLM's kernel).

The method gets everything it needs from its constructor (checkpoint format, runtime settings, the
model's load summary); it never imports the config.
"""

from __future__ import annotations

import math
import time

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.utils import set_weight_attrs

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.op import custom_op
from vllm_moe_w8.vllm_glue import cpu_vllm_fp8
from vllm_moe_w8.vllm_glue.checkpoint_format import CheckpointFormat
from vllm_moe_w8.vllm_glue.expert_loading import ExpertLoads, loads_from_checkpoint, rank_block
from vllm_moe_w8.vllm_glue.load_summary import MoELoadSummary
from vllm_moe_w8.vllm_glue.self_check import check_repacked_experts
from vllm_moe_w8.vllm_glue.settings import RuntimeSettings

logger = init_logger("vllm.neuron_w8")


class NeuronW8MoEMethod(FusedMoEMethodBase):
    """Routed experts of one MoE layer (see the module docstring)."""

    def __init__(self, layer: torch.nn.Module, prefix: str, fmt: CheckpointFormat, settings: RuntimeSettings,
                 load_summary: MoELoadSummary):
        super().__init__(layer.moe_config)
        self.fmt = fmt
        self.prefix = prefix
        self.settings = settings
        self.load_summary = load_summary
        self.mode = settings.mode
        self.code_format = fp8.CODE_FORMAT[self.mode]
        self.suffix = fmt.expert_scale_suffix
        self.ckpt_block = fmt.expert_block
        self.load_block = self.ckpt_block
        self.block = self.ckpt_block  # tile of the stored grids after processing
        self.processed = False
        self.cpu_kernel = "op"  # "vllm-fp8": the experts are prepacked for vLLM's FP8 kernel (cpu_vllm_fp8)
        self.cpu_choice: tuple[bool, str] | None = None  # cpu_vllm_fp8.decide's answer, made in create_weights
        self.expert_loads: ExpertLoads | None = None  # made by create_weights
        self.expect_checkpoint_loads = loads_from_checkpoint()

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
        self.load_block = rank_block(self.ckpt_block, inter, tp)
        bn, bk = self.load_block
        g_i, g_h = math.ceil(inter / bn), (1 if bk == 0 else math.ceil(hidden / bk))
        g_h2, g_i2 = math.ceil(hidden / bn), (1 if bk == 0 else math.ceil(inter / bk))
        layer.weight_block_size = list(self.ckpt_block) if self.ckpt_block[1] else None
        layer.orig_dtype = params_dtype

        loads = self.expert_loads = ExpertLoads(
            extra_weight_attrs.pop("weight_loader"), prefix=self.prefix, scale_suffix=self.suffix, num_local=num_experts,
            hidden=hidden, inter_full=inter * tp, ckpt_block=self.ckpt_block, load_block=self.load_block,
            expect_checkpoint_loads=self.expect_checkpoint_loads,
        )
        attrs = dict(extra_weight_attrs)

        def param(data, loader):
            p = torch.nn.Parameter(data, requires_grad=False)
            set_weight_attrs(p, attrs)
            set_weight_attrs(p, {"weight_loader": loader})
            return p

        layer.register_parameter("w13_weight", param(torch.zeros(num_experts, 2 * inter, hidden, dtype=torch.uint8), loads.weight_loader()))
        layer.register_parameter("w2_weight", param(torch.zeros(num_experts, hidden, inter, dtype=torch.uint8), loads.weight_loader()))
        s13 = param(torch.ones(num_experts, 2 * g_i, g_h, dtype=torch.float32), loads.scale_loader())
        s2 = param(torch.ones(num_experts, g_h2, g_i2, dtype=torch.float32), loads.scale_loader())
        # vLLM's loader dispatches scales on this attribute: 'block' slices grids by rank, 'channel' keeps
        # one column (w2's per-row scales are not split by TP).
        kind = "block" if bk > 0 else "channel"
        set_weight_attrs(s13, {"quant_method": kind})
        set_weight_attrs(s2, {"quant_method": kind})
        layer.register_parameter(f"w13_{self.suffix}", s13)
        layer.register_parameter(f"w2_{self.suffix}", s2)
        layer.w13_input_scale = None
        layer.w2_input_scale = None
        if layer.w13_weight.device.type == "cpu":  # decided before any weight is read: a forced, unfit kernel stops here
            self.cpu_choice = cpu_vllm_fp8.decide(
                self._final_block(), self.code_format, inter, moe.in_dtype, float(getattr(layer, "swiglu_limit", None) or 0.0),
                bool(moe.moe_parallel_config.use_ep))
        if self.load_summary.layer_created():
            self._log_load_start(layer, num_experts)

    def _final_block(self) -> tuple[int, int]:
        """The tile of the stored scale grids after processing (a converted checkpoint's stored tile is final)."""
        if self.mode == "output-block" and not self.fmt.converted:
            return (fp8.OUTPUT_BLOCK_ROWS, 0)
        return self.load_block

    def _log_load_start(self, layer, num_experts: int) -> None:
        path, why = custom_op.compute_path(layer.w13_weight.device)
        if self.cpu_choice is not None:  # name the kernel that will really run the experts, and why
            use_vllm, reason = self.cpu_choice
            path, why = (cpu_vllm_fp8.KERNEL_NAME, reason) if use_vllm else (path, f"{reason}; {why}")
        mp = self.moe.moe_parallel_config
        logger.info(
            "neuron-w8: loading routed experts: method %s, checkpoint %s, mode %s (%s), compute path %s (%s); "
            "TP rank %d/%d, EP rank %d/%d (EP %s); local experts %d of %d; scale tile %s -> %s on this rank; self-check %s",
            type(self).__name__, self.fmt.kind, self.mode, self.settings.mode_source, path, why,
            mp.tp_rank, mp.tp_size, mp.ep_rank, mp.ep_size, "on" if mp.use_ep else "off",
            num_experts, self.moe.num_experts, self.ckpt_block, self.load_block,
            f"on ({self.settings.self_check_experts} experts/layer)" if self.settings.self_check else "off",
        )

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    # ---- after loading: completeness, repack, self-check, Neuron layout ----------------------------
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
        """Local experts the self-check looks at: first, last and evenly between."""
        n = min(self.settings.self_check_experts, self.num_local) if self.settings.self_check else 0
        if n <= 0:
            return []
        return sorted({round(i * (self.num_local - 1) / max(n - 1, 1)) for i in range(n)})

    def process_weights_after_loading(self, layer) -> None:
        if self.processed:
            return
        t0 = time.perf_counter()
        global_ids = self._global_ids(layer)
        self.expert_loads.check_complete(global_ids)
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        s13, s2 = getattr(layer, f"w13_{self.suffix}").data, getattr(layer, f"w2_{self.suffix}").data
        bytes_before = w13.numel() + w2.numel() + 4 * (s13.numel() + s2.numel())
        sampled = self._sampled()
        self.block = self._final_block()
        if self.fmt.converted:  # codes and scales are final: the stored tile is the load tile
            new_s13, new_s2, originals, rounded, stats = s13, s2, {}, {}, fp8.RepackStats()
        else:
            originals = {e: (w13[e].clone(), s13[e].clone(), w2[e].clone(), s2[e].clone()) for e in sampled}
            new_s13, new_s2, rounded, stats = self._repack(w13, s13, w2, s2, global_ids)
        if new_s13 is not s13:
            _replace(layer, f"w13_{self.suffix}", new_s13)
            _replace(layer, f"w2_{self.suffix}", new_s2)
        if sampled:
            check_repacked_experts(
                (w13, new_s13, w2, new_s2), originals, sampled=sampled, global_ids=global_ids, rounded_per_expert=rounded,
                prefix=self.prefix, mode=self.mode, code_format=self.code_format, inter=self.inter,
                load_block=self.load_block, block=self.block,
            )
        if self.cpu_choice is not None:
            self._use_cpu_kernel(layer)
        self.processed = True
        seconds = time.perf_counter() - t0
        logger.debug(
            "neuron-w8: %s repacked %d experts (%s): blocks shifted %d/%d, values rounded %d, %.3f s",
            self.prefix, self.num_local, self.mode, stats.blocks_shifted, stats.blocks, stats.values_changed, seconds,
        )
        self.load_summary.layer_processed(
            mode=self.mode, converted=self.fmt.converted, bytes_before=bytes_before,
            bytes_after=w13.numel() + w2.numel() + 4 * (new_s13.numel() + new_s2.numel()),
            stats=stats, seconds=seconds, checked_experts=len(sampled),
        )

    def _use_cpu_kernel(self, layer) -> None:
        """vLLM's FP8 kernel or the op, as decided in create_weights; for vLLM's, the codes become its prepacked copy."""
        use, why = self.cpu_choice
        if why not in _logged_cpu_kernels:
            _logged_cpu_kernels.add(why)
            logger.info("neuron-w8: routed experts on CPU: %s (first layer: %s)", why, self.prefix)
        if use:
            p13, p2 = cpu_vllm_fp8.prepack(layer.w13_weight.data, layer.w2_weight.data)
            _replace(layer, "w13_weight", p13)
            _replace(layer, "w2_weight", p2)
            self.cpu_kernel = "vllm-fp8"

    def _repack(self, w13, s13, w2, s2, global_ids):
        """Repack every local expert in place (codes; scales in place or into new output-block grids).

        Returns (w13 scales, w2 scales, values rounded per local expert, summed repack statistics).
        """
        inter, block = self.inter, self.load_block
        g_i = math.ceil(inter / block[0])
        if self.mode == "output-block":
            ob_rows = math.ceil(inter / fp8.OUTPUT_BLOCK_ROWS)
            new_s13 = torch.empty(self.num_local, 2 * ob_rows, 1, dtype=torch.float32)
            new_s2 = torch.empty(self.num_local, math.ceil(self.hidden / fp8.OUTPUT_BLOCK_ROWS), 1, dtype=torch.float32)
            gate_rows, up_rows = slice(0, ob_rows), slice(ob_rows, 2 * ob_rows)
        else:
            new_s13, new_s2 = s13, s2  # same grid: updated in place
            gate_rows, up_rows = slice(0, g_i), slice(g_i, 2 * g_i)
        stats, rounded = fp8.RepackStats(), {}
        for e in range(self.num_local):
            name = f"{self.prefix}.{global_ids[e]}"
            parts = (
                (w13[e, :inter], s13[e, :g_i], new_s13, gate_rows, "gate_proj"),
                (w13[e, inter:], s13[e, g_i:], new_s13, up_rows, "up_proj"),
                (w2[e], s2[e], new_s2, slice(None), "down_proj"),
            )
            rounded[e] = 0
            for codes, scales, dst_scales, rows, proj in parts:
                rep = fp8.repack(codes, scales, self.mode, block, name=f"{name}.{proj}.weight")
                codes.copy_(rep.codes)
                dst_scales[e, rows] = rep.scale_grid
                stats = stats.add(rep.stats)
                rounded[e] += rep.stats.values_changed
        return new_s13, new_s2, rounded, stats

    # ---- compute ----------------------------------------------------------------------------------
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        ids = topk_ids
        emap = layer.expert_map
        if emap is not None:
            ids = emap[topk_ids.long()]
        if self.cpu_kernel == "vllm-fp8":  # no expert map here (decide: not with expert parallelism)
            return cpu_vllm_fp8.forward(x, topk_weights, topk_ids, layer.w13_weight, getattr(layer, f"w13_{self.suffix}"),
                                        layer.w2_weight, getattr(layer, f"w2_{self.suffix}"))
        limit = getattr(layer, "swiglu_limit", None)
        return torch.ops.moe_w8.fused_moe(
            x, topk_weights.to(torch.float32), ids,
            layer.w13_weight, getattr(layer, f"w13_{self.suffix}"),
            layer.w2_weight, getattr(layer, f"w2_{self.suffix}"),
            self.block[0], self.block[1], self.code_format, "silu", float(limit or 0.0),
        )


_logged_cpu_kernels: set[str] = set()


def _replace(layer: torch.nn.Module, name: str, data: torch.Tensor) -> None:
    """Swap a parameter's data for a differently shaped tensor, keeping its vLLM attributes."""
    old = getattr(layer, name)
    new = torch.nn.Parameter(data, requires_grad=False)
    for key, value in vars(old).items():
        if not key.startswith("_"):
            setattr(new, key, value)
    delattr(layer, name)
    layer.register_parameter(name, new)
