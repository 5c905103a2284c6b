"""``NeuronW8LinearMethod``: non-expert FP8 linear layers, dequantised once to the model dtype (or, where vLLM's
own FP8 linear kernel runs the layer on this CPU, kept at 1 byte for it: :mod:`.cpu_vllm_fp8_linear`).

FP8 checkpoints quantise more than the routed experts: attention q/k/v/o, shared experts, Qwen3.5's
linear-attention ``in_proj_qkv`` / ``in_proj_z`` / ``out_proj``, dense MLPs, GLM's MLA projections.
They are a small share of the bytes, so they are served in BF16 (the model's dtype): loaded as FP8
bytes + scales, dequantised exactly (:func:`vllm_moe_w8.codec.fp8.dequantize_checkpoint` semantics) in
``process_weights_after_loading``, then handed over to vLLM's own ``UnquantizedLinearMethod`` (its
platform GEMM dispatch; MLA reads such a layer's weight directly).

Scales are stored **one row per weight row** (``[N_rank, ceil(K_rank / bk)]``, or ``[N_rank, 1]``
per-channel): the incoming block grid is refined by the loader wrapper before vLLM's own (v1) loader
of the layer shards it. With row-granular scales every layer kind — replicated, column/row parallel,
merged gate/up, QKV with replicated KV heads — slices the scale exactly like its weight, so ragged
shards (a 64-row k_proj in a 128-row block, a per-rank size that is not a multiple of 128) need no
special case. Columns of a row-parallel layer whose per-rank input is not a multiple of the block
are refined to ``gcd(K_rank, bk)`` the same way.

Where :func:`.cpu_vllm_fp8_linear.decide` picks vLLM's FP8 W8A16 linear kernel (AMX hosts where the layout fits, or
``VLLM_MOE_W8_CPU_LINEAR=vllm-fp8``), the loaded FP8 weight is VNNI-prepacked for it instead (the prepacked copy
replaces the bytes: 1 byte per weight, no BF16 copy) and the per-row scales are folded back to its tile grid.
Every layer reports its path to the model's :class:`.load_summary.LinearLoadSummary`.

A layer whose checkpoint weight arrives in BF16/FP16/FP32 (a router or projection the checkpoint did
not quantise but did not list in ``modules_to_not_convert``) is kept as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.utils import set_weight_attrs

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.vllm_glue import cpu_vllm_fp8_linear
from vllm_moe_w8.vllm_glue.checkpoint_format import CheckpointFormat
from vllm_moe_w8.vllm_glue.load_summary import LinearLoadSummary


def _refine_rows_cols(scale: torch.Tensor, block: tuple[int, int], n_full: int | None, col_tile: int, k_full: int) -> torch.Tensor:
    """Block grid [ceil(N/bn), ceil(K/bk)] -> per-row grid [N, ceil(K/col_tile)] (exact: tiles inherit scales)."""
    bn, bk = block
    if scale.dim() == 1:
        scale = scale.unsqueeze(1)
    out = scale.float().repeat_interleave(bn, dim=0)
    if n_full is not None:
        out = out[:n_full]
    if bk and col_tile != bk:
        out = out.repeat_interleave(bk // col_tile, dim=1)[:, : math.ceil(k_full / col_tile)]
    return out.contiguous()


class NeuronW8LinearMethod(LinearMethodBase):
    """FP8 (block or per-channel) linear layer served in the model dtype (see the module docstring)."""

    def __init__(self, fmt: CheckpointFormat, prefix: str = "", summary: LinearLoadSummary | None = None):
        self.fmt = fmt
        self.prefix = prefix
        self.summary = summary if summary is not None else LinearLoadSummary()
        self.block = fmt.linear_block
        self.suffix = fmt.linear_scale_suffix
        self.hand_over = True  # after dequantising, serve with vLLM's UnquantizedLinearMethod (tests may turn off)

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int], input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        vllm_loader = extra_weight_attrs.pop("weight_loader")
        n_rank = sum(output_partition_sizes)
        k_rank = input_size_per_partition
        bn, bk = self.block
        input_sharded = k_rank != input_size
        col_tile = bk if (bk == 0 or not input_sharded or k_rank % bk == 0) else math.gcd(k_rank, bk)
        self.col_tile = col_tile
        layer.weight_block_size = list(self.block) if bk else None
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = k_rank
        layer.output_size_per_partition = n_rank
        layer.orig_dtype = params_dtype
        layer.neuron_w8_fp8 = True
        layer.neuron_w8_vllm_fp8_tile = 0  # > 0: served by vLLM's FP8 kernel with [tile, 128] scale tiles
        self.summary.layer_created()

        weight = torch.nn.Parameter(torch.empty(n_rank, k_rank, dtype=torch.float8_e4m3fn), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        set_weight_attrs(weight, {"weight_loader": self._weight_loader(layer, vllm_loader, params_dtype)})
        layer.register_parameter("weight", weight)

        g_k = 1 if bk == 0 else math.ceil(k_rank / col_tile)
        scale = torch.nn.Parameter(torch.ones(n_rank, g_k, dtype=torch.float32), requires_grad=False)
        attrs = {"output_dim": 0}
        if bk and input_sharded:
            attrs["input_dim"] = 1
        set_weight_attrs(scale, attrs)
        set_weight_attrs(scale, extra_weight_attrs)
        set_weight_attrs(scale, {"weight_loader": self._scale_loader(layer, vllm_loader, input_size)})
        layer.register_parameter(self.suffix, scale)

    def _where(self, shard_id) -> str:
        return f"{self.prefix}" + (f" (shard {shard_id!r})" if shard_id is not None else "")

    def _weight_loader(self, layer, vllm_loader, params_dtype):
        def load(param, loaded_weight, *args, **kwargs):
            shard_id = args[0] if args else kwargs.get("loaded_shard_id")
            if loaded_weight.dtype in (torch.float8_e4m3fn, torch.uint8):
                if not getattr(layer, "neuron_w8_fp8", True):
                    raise ValueError(f"neuron-w8: {self._where(shard_id)}.weight is FP8 but another shard of this fused layer was high precision")
                loaded_weight = loaded_weight.view(torch.float8_e4m3fn)
                layer.neuron_w8_loaded_fp8 = True
            elif loaded_weight.is_floating_point() and loaded_weight.element_size() >= 2:
                if getattr(layer, "neuron_w8_fp8", True):
                    if getattr(layer, "neuron_w8_loaded_fp8", False):
                        raise ValueError(f"neuron-w8: {self._where(shard_id)}.weight is {loaded_weight.dtype} but another shard of this fused layer was FP8")
                    # Not quantised in the checkpoint: keep this layer in high precision.
                    param.data = torch.empty(param.shape, dtype=params_dtype)
                    layer.neuron_w8_fp8 = False
                    layer._parameters.pop(self.suffix, None)
            else:
                raise ValueError(f"neuron-w8: {self._where(shard_id)}.weight has dtype {loaded_weight.dtype}; expected float8_e4m3fn (or BF16 for an unquantised layer)")
            return vllm_loader(param, loaded_weight, *args, **kwargs)

        return load

    def _scale_loader(self, layer, vllm_loader, input_size):
        def load(param, loaded_weight, *args, **kwargs):
            shard_id = args[0] if args else kwargs.get("loaded_shard_id")
            if not loaded_weight.is_floating_point() or loaded_weight.element_size() < 2:
                raise ValueError(f"neuron-w8: {self._where(shard_id)}.{self.suffix} has dtype {loaded_weight.dtype}; expected float32/bfloat16/float16")
            n_full = layer.output_size if shard_id is None else None  # fused shards: the layer's loader narrows rows
            grid = _refine_rows_cols(loaded_weight, self.block, n_full, self.col_tile, input_size)
            return vllm_loader(param, grid, *args, **kwargs)

        return load

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "neuron_w8_processed", False):
            return
        layer.neuron_w8_processed = True
        if not getattr(layer, "neuron_w8_fp8", True) or layer.weight.dtype != torch.float8_e4m3fn:
            weight = layer.weight.data
            self.summary.layer_processed("as-loaded", f"kept as loaded: {weight.dtype} in the checkpoint", self.prefix,
                                         weight.numel() * weight.element_size())
            return
        codes = layer.weight.data.view(torch.uint8)
        scale = getattr(layer, self.suffix).data
        n, k = codes.shape
        block = (1, self.col_tile)
        nan = (codes & 0x7F) == fp8.NAN_MAG
        if bool(nan.any()):
            i, j = (int(v) for v in nan.nonzero()[0])
            raise ValueError(f"neuron-w8: {self.prefix}.weight holds {int(nan.sum())} FP8 NaN code(s), first at [{i}, {j}]; re-export the checkpoint")
        bad = ~torch.isfinite(scale) | (scale <= 0)
        if bool(bad.any()):
            raise ValueError(f"neuron-w8: {self.prefix}.{self.suffix} has {int(bad.sum())} non-finite or non-positive scale(s) (unloaded or corrupt)")
        if codes.device.type == "cpu":
            use, why = cpu_vllm_fp8_linear.decide(n, k, self.col_tile, layer.orig_dtype, scale,
                                                  bool(getattr(layer, "_cpu_skip_gemm_dispatch", False)))
            if use:
                self._keep_for_vllm_fp8(layer, scale, why)
                return
        else:
            why = "dequantised to the model dtype"
        dense = torch.empty(n, k, dtype=layer.orig_dtype)
        rows = max(1, (1 << 24) // max(k, 1))  # bound the fp32 temporary to ~64 MB
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            part = fp8.decode_e4m3fn(codes[r0:r1]) * fp8.expand_scales(scale[r0:r1], (r1 - r0, k), block)
            dense[r0:r1] = part.to(layer.orig_dtype)
        layer._parameters.pop(self.suffix, None)
        layer.weight = torch.nn.Parameter(dense, requires_grad=False)
        layer.neuron_w8_dequantized = True
        self.summary.layer_processed("dequant", why, self.prefix, dense.numel() * dense.element_size())
        if self.hand_over:
            self._hand_over(layer)

    def _keep_for_vllm_fp8(self, layer, scale: torch.Tensor, why: str) -> None:
        """The FP8 bytes prepacked for vLLM's kernel (replacing them: one resident copy) and its scale grid."""
        packed, grid, tile = cpu_vllm_fp8_linear.prepack(layer.weight.data, scale)
        layer._parameters.pop(self.suffix, None)
        layer.weight = torch.nn.Parameter(packed, requires_grad=False)
        layer.neuron_w8_scale_grid = torch.nn.Parameter(grid, requires_grad=False)
        layer.neuron_w8_vllm_fp8_tile = tile
        self.summary.layer_processed("vllm-fp8", why, self.prefix, packed.numel() * packed.element_size())

    def _hand_over(self, layer) -> None:
        """From here on the layer *is* an unquantised layer: let vLLM's own method serve it (its platform GEMM
        dispatch on CPU, and MLA's kv_b_proj handling, which reads unquantised weights directly)."""
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        method = UnquantizedLinearMethod()
        layer.quant_method = method
        method.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.neuron_w8_vllm_fp8_tile:
            return cpu_vllm_fp8_linear.forward(x, layer.weight, layer.neuron_w8_scale_grid, layer.neuron_w8_vllm_fp8_tile, bias)
        weight = layer.weight
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.linear(x, weight, bias)
