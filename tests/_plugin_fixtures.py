"""Helpers for the plugin tests: a real vLLM ``RoutedExperts`` layer built in-process for any TP/EP rank,
loaded through its own ``weight_loader`` from a synthetic FP8 checkpoint, and an independent float64 MoE.

The checkpoint experts are quantised by ``tiny_models`` (the project's checkpoint generator) and
dequantised for the reference by ``tiny_models.dequantize_exact`` (torch's own float8_e4m3fn
conversion), not by the plugin's codecs.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from vllm_moe_w8 import tiny_models

PREFIX = "model.layers.0.mlp.experts"


@dataclass
class ExpertCheckpoint:
    """Per-expert checkpoint tensors (as a model's load_weights hands them over) + exact fp32 weights."""

    fmt: str  # "block" | "channel"
    weights: dict  # (e, shard) -> float8_e4m3fn [N, K]
    scales: dict  # (e, shard) -> scale grid
    dense: dict  # (e, shard) -> exact fp32 [N, K]
    num_experts: int
    hidden: int
    inter: int

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.fmt == "block" else "weight_scale"


def make_checkpoint(num_experts=4, hidden=256, inter=384, fmt="block", scale_dtype=torch.bfloat16, seed=0) -> ExpertCheckpoint:
    gen = torch.Generator().manual_seed(seed)
    weights, scales, dense = {}, {}, {}
    for e in range(num_experts):
        for shard, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            w = torch.randn(shape, generator=gen) * 0.05
            if fmt == "block":
                codes, scale = tiny_models.quantize_block(w, scale_dtype)
                exact = tiny_models.dequantize_exact(codes, scale, (128, 128))
            else:
                codes, scale = tiny_models.quantize_channel(w, scale_dtype)
                exact = tiny_models.dequantize_exact(codes, scale, None)
            weights[e, shard], scales[e, shard], dense[e, shard] = codes, scale, exact
    return ExpertCheckpoint(fmt, weights, scales, dense, num_experts, hidden, inter)


def quant_config_for(fmt: str):
    from vllm_moe_w8.vllm_glue.quant_config import NeuronW8Config

    if fmt == "block":
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    else:
        cfg = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {"dynamic": True, "num_bits": 8, "type": "float", "strategy": "token"},
                                          "weights": {"dynamic": False, "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
        }
    return NeuronW8Config.from_config(cfg)


@contextmanager
def vllm_context(additional_config: dict | None = None):
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(additional_config=additional_config or {})):
        yield


def make_layer(quant_config, ckpt: ExpertCheckpoint, *, tp=(1, 0), ep=(1, 0), top_k=2, swiglu_limit=None, additional_config=None,
               dtype=None):
    """A real ``RoutedExperts`` for TP rank ``tp[1]`` of ``tp[0]`` or EP rank ``ep[1]`` of ``ep[0]`` (activations in
    ``dtype``, float32 unless given)."""
    dtype = dtype or torch.float32
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    tp_size, tp_rank = tp
    ep_size, ep_rank = ep
    n = ckpt.num_experts
    local = n // ep_size
    pc = FusedMoEParallelConfig(
        tp_size=tp_size, pcp_size=1, dp_size=1, ep_size=ep_size, tp_rank=tp_rank, pcp_rank=0, dp_rank=0,
        ep_rank=ep_rank, sp_size=1, use_ep=ep_size > 1, all2all_backend="naive", enable_eplb=False,
    )
    cfg = FusedMoEConfig(
        num_experts=n, experts_per_token=top_k, hidden_dim=ckpt.hidden, intermediate_size=ckpt.inter,
        num_local_experts=local, num_logical_experts=n, activation=MoEActivation.SILU, device="cpu",
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=pc, in_dtype=dtype,
    )
    if ep_size > 1:
        emap = torch.full((n,), -1, dtype=torch.int32)
        emap[ep_rank * local:(ep_rank + 1) * local] = torch.arange(local, dtype=torch.int32)
    else:
        emap = None
    manager = SimpleNamespace(
        local_num_experts=local, placement_strategy="linear", expert_map=emap, expert_mask=None, routing_tables=None,
        map_global_to_local=(lambda g: int(emap[g])) if emap is not None else (lambda g: g),
    )
    with vllm_context(additional_config):
        layer = RoutedExperts(PREFIX, dtype, cfg, quant_config, expert_map_manager=manager, swiglu_limit=swiglu_limit)
    return layer


def load_layer(layer, ckpt: ExpertCheckpoint, process: bool = True) -> int:
    """Feed every checkpoint expert tensor through the layer's weight loaders, like a model's load_weights."""
    loaded = 0
    for (e, shard), w in ckpt.weights.items():
        stem = "w2" if shard == "w2" else "w13"
        for suffix, tensor in (("weight", w), (ckpt.scale_suffix, ckpt.scales[e, shard])):
            name = f"{stem}_{suffix}"
            param = getattr(layer, name)
            ok = param.weight_loader(param=param, loaded_weight=tensor, weight_name=f"{PREFIX}.{name}", shard_id=shard, expert_id=e, return_success=True)
            loaded += bool(ok)
    if process:
        layer.quant_method.process_weights_after_loading(layer)
    return loaded


def routing(num_tokens: int, num_experts: int, top_k: int, hidden: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def dense_moe(ckpt: ExpertCheckpoint, x, topk_weights, topk_ids, swiglu_limit: float = 0.0) -> torch.Tensor:
    """float64 MoE straight from the checkpoint's exact weights (no plugin code involved)."""
    xd = x.double()
    out = torch.zeros(x.shape[0], ckpt.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate = ckpt.dense[e, "w1"].double() @ xd[t]
            up = ckpt.dense[e, "w3"].double() @ xd[t]
            if swiglu_limit > 0:
                gate = gate.clamp(max=swiglu_limit)
                up = up.clamp(-swiglu_limit, swiglu_limit)
            h = torch.nn.functional.silu(gate) * up
            out[t] += float(topk_weights[t, j]) * (ckpt.dense[e, "w2"].double() @ h)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)


@contextmanager
def plugin_log():
    """The messages logged on ``vllm.neuron_w8`` at INFO and above meanwhile (as vLLM's logging shows them)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("vllm.neuron_w8")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
