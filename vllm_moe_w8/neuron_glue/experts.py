"""The Neuron experts module: vllm-neuron's MoE blocks with 1-byte experts.

A built vllm-neuron MoE block (Qwen3-MoE's ``Qwen3MoeExperts``, Qwen3.5-MoE's ``Qwen3_5SparseMoeBlock``)
is turned into ours in place (:func:`adopt`): its BF16 expert parameters are dropped (they were only
ever allocated on the meta device), the kernel-layout codes and scales
(:class:`vllm_moe_w8.kernels.host.KernelWeights`) become its only expert storage, and its class gains
our ``forward`` in front of its own. Everything else stays vllm-neuron's: the post-attention norm, the
router weight, the shared expert, the process groups and its parameter names and loaders, so its own
``load_weights`` fills them as before.

Forward, per phase, with the same norm, routing and collectives as the module it replaces:
* Qwen3-MoE: RMSNorm -> softmax router over all experts -> top-k (renormalised when the config's
  ``norm_topk_prob``) -> routed experts on this rank -> decode: all-reduce over the MoE group; prefill
  (sequence-parallel input): all-gather over the TP group first, reduce-scatter over the MoE group after.
* Qwen3.5-MoE: the layer's norm -> softmax -> top-k -> renormalise -> routed experts + vllm-neuron's
  shared expert (``_shared_expert``) -> its ``_combine`` (all-reduce, or reduce-scatter in SP prefill).
Global expert ids become local ids of this EP rank (linear placement); other ranks' experts are -1.

The kernel call is ``_W8Routed.w8_runner`` (signature ``(x, topk_weights, topk_ids, kw, *, lnc, swiglu_limit,
where)``), by default :func:`run_kernels`: :func:`vllm_moe_w8.neuron_glue.kernel_launch.run_routed_experts`, the one
launch path of the NKI kernels (``wrap_nki(kernel)[lnc]``; selective / dense decode, block prefill: one launch per call). On a
Neuron device it launches them with vllm-neuron's ``wrap_nki`` (anything missing is an error, never a CPU
fallback); elsewhere the same calls run in the project's NKI interpreter and the log says so.

Trace-safe: vllm-neuron's runner compiles the whole model with ``torch.compile(fullgraph=True)``. Everything the
forward needs from the host (the kernels' backend and callers, the LNC, Qwen3.5's ``SEQUENCE_PARALLEL`` flag) is
resolved once in :func:`adopt`; the forward is torch ops on the input's device (local ids, padding mask,
affinities) and kernel launches whose constants do not depend on the routing, with no Python branch on a
tensor's value.
"""

from __future__ import annotations

import re

import torch

from vllm_moe_w8.kernels.host import KernelWeights
from vllm_moe_w8.neuron_glue import interfaces, kernel_launch, loaders, shared_expert
from vllm_moe_w8.neuron_glue.interfaces import MoeTarget, NeuronGlueError

BUFFERS = ("w8_w13", "w8_w13_scales", "w8_w2", "w8_w2_scales")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def run_kernels(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, kw: KernelWeights, *, lnc: int,
                swiglu_limit: float, where: kernel_launch.Backend) -> torch.Tensor:
    """Routed sum [T, H] fp32 of this rank's experts, through the kernels' launch path (see the module docstring)."""
    return kernel_launch.run_routed_experts(x, topk_weights, topk_ids, kw, lnc=lnc, swiglu_limit=swiglu_limit, where=where)


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (fp32), top-k, optional L1 renormalisation: (weights fp32 [T, k], global ids [T, k])."""
    logits = x.float() @ router_weight.float().T
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def local_ids(ids: torch.Tensor, first: int, num_local: int) -> torch.Tensor:
    """Global expert ids -> this EP rank's local ids; experts of other ranks -> -1."""
    local = ids - first
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))


def padding_mask(positions: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
    """True for real tokens of a padded prefill (positions rise to the last real token, then padding)."""
    if positions is None or positions.dim() != 1 or positions.shape[0] != tokens:
        return None
    return torch.arange(tokens, device=positions.device) <= torch.argmax(positions)


class _W8Routed:
    """Storage and the routed-expert computation shared by both blocks (mixed in front of vllm-neuron's class)."""

    w8_runner = staticmethod(run_kernels)

    def w8_setup(self, plan, settings, layer: int, launch_backend: kernel_launch.Backend, sequence_parallel: bool) -> None:
        self.w8_plan, self.w8_settings, self.w8_layer = plan, settings, layer
        self.w8_mode = settings.mode
        self.w8_backend, self.w8_sequence_parallel = launch_backend, sequence_parallel
        for name in BUFFERS:
            self.register_buffer(name, None, persistent=False)

    def w8_set_weights(self, kw: KernelWeights, device=None) -> None:
        for name, t in zip(BUFFERS, (kw.w13, kw.w13_scales, kw.w2, kw.w2_scales)):
            setattr(self, name, t.to(device) if device is not None else t)

    def w8_kernel_weights(self) -> KernelWeights:
        if self.w8_w13 is None:
            raise NeuronGlueError(f"neuron-w8: layer {self.w8_layer}: experts used before load_weights filled them")
        return KernelWeights(self.w8_w13, self.w8_w13_scales, self.w8_w2, self.w8_w2_scales, self.w8_mode)

    def w8_load(self, source, cfg, device) -> list:
        """Read this block's experts from the checkpoint (``loaders``) and keep them on ``device``: its LayerLoads."""
        ld = loaders.load_layer_experts(source, self.w8_layer, self.w8_plan, cfg)
        self.w8_set_weights(ld.weights, device)
        return [ld]

    def w8_set_meta(self, mode: str) -> None:
        """Meta buffers of the kernel layout (a weights-free load)."""
        self.w8_set_weights(loaders.meta_weights(self.w8_plan, mode))

    def w8_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, real: torch.Tensor | None,
                  extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """This rank's routed sum [T, H] in x's dtype; ``extra``: (weights, local ids) columns appended after the
        global -> local mapping (the shared expert's slot)."""
        plan = self.w8_plan
        lids = local_ids(ids, plan.first_expert, plan.num_local)
        if extra is not None:
            weights, lids = torch.cat([weights, extra[0]], dim=1), torch.cat([lids, extra[1]], dim=1)
        return self.w8_run(x, weights, lids, real, self.w8_kernel_weights())

    def w8_run(self, x, weights, lids, real, kw: KernelWeights) -> torch.Tensor:
        if real is not None:
            lids = torch.where(real[:, None], lids, torch.full_like(lids, -1))
        with torch.no_grad():  # inference only (vllm-neuron's forward runs under no_grad too)
            out = self.w8_runner(x.detach(), weights.detach(), lids, kw, lnc=self.w8_settings.lnc,
                                 swiglu_limit=self.w8_settings.swiglu_limit, where=self.w8_backend)
        return out.to(x.dtype)


class W8Qwen3MoeExperts(_W8Routed):
    """``forward(hidden_states, positions, is_decode, rank)`` of vllm-neuron's ``Qwen3MoeExperts``."""

    def forward(self, hidden_states, positions, is_decode, rank):
        x = self.post_attention_layernorm(hidden_states)
        if not is_decode and self.tp_group.world_size > 1:
            x = self.tp_group.all_gather(x, dim=0)
        weights, ids = route(x, self.router_weight, self.num_experts_per_token, bool(self.norm_topk_prob))
        real = None if is_decode else padding_mask(positions, x.shape[0])
        out = self.w8_routed(x, weights, ids, real)
        if self.moe_group.world_size > 1:
            out = self.moe_group.all_reduce(out) if is_decode else self.moe_group.reduce_scatter(out, dim=0)
        return out


class W8Qwen3_5SparseMoeBlock(_W8Routed):
    """``forward(hidden_states, is_prefill, norm, positions, rank)`` of vllm-neuron's ``Qwen3_5SparseMoeBlock``; the
    shared expert through the same kernels when :mod:`shared_expert` adopted it (``w8_shared``), else vllm-neuron's."""

    w8_shared = None  # shared_expert.SharedPlan, or None: vllm-neuron's BF16 _shared_expert

    def forward(self, hidden_states, is_prefill, norm, positions=None, rank=None):
        hidden_states = hidden_states.to(self.dtype)
        normed = norm(hidden_states)
        if is_prefill and self.world_size > 1 and self.w8_sequence_parallel:
            normed = self.tp_group.all_gather(normed, dim=0)
        weights, ids = route(normed, self.router_weight, self.top_k, True)
        real = padding_mask(positions, normed.shape[0]) if is_prefill else None
        if self.w8_shared is None:
            out = self.w8_routed(normed, weights, ids, real) + self._shared_expert(normed)
        elif self.w8_shared.layout == "slot":  # routed + shared in one launch
            out = self.w8_routed(normed, weights, ids, real, extra=(self.w8_shared_affinity(normed), self.w8_shared_ids(ids)))
        else:
            out = self.w8_routed(normed, weights, ids, real) + self.w8_shared_expert(normed, real)
        return self._combine(out, is_prefill=is_prefill)

    def w8_shared_affinity(self, normed: torch.Tensor) -> torch.Tensor:
        return shared_expert.affinity(normed, self.shared_expert_gate_weight)

    def w8_shared_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The shared expert's local id for every token [T, 1]: the routed bank's last slot, or its own bank's 0."""
        return torch.full_like(ids[:, :1], self.w8_plan.num_local if self.w8_shared.layout == "slot" else 0)

    def w8_shared_expert(self, normed: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shared-expert partial sum alone (gated), through the kernels, in normed's dtype."""
        aff = self.w8_shared_affinity(normed)
        ids = self.w8_shared_ids(aff.to(torch.int64))
        if self.w8_shared.layout == "slot":
            return self.w8_run(normed, aff, ids, real, self.w8_kernel_weights())
        if self.w8_shared_w13 is None:
            raise NeuronGlueError(f"neuron-w8: layer {self.w8_layer}: shared expert used before load_weights filled it")
        kw = KernelWeights(self.w8_shared_w13, self.w8_shared_w13_scales, self.w8_shared_w2, self.w8_shared_w2_scales,
                           self.w8_mode)
        return self.w8_run(normed, aff, ids, real, kw)

    def w8_load(self, source, cfg, device) -> list:
        if self.w8_shared is None:
            return super().w8_load(source, cfg, device)
        where = f"layer {self.w8_layer} shared expert"
        routed = loaders.load_layer_experts(source, self.w8_layer, self.w8_plan, cfg)
        shared = loaders.load_layer_experts(source, self.w8_layer, self.w8_shared.plan, cfg,
                                            read=shared_expert.reader(source, self.w8_layer),
                                            cut=shared_expert.cutter(self.w8_shared, where))
        if self.w8_shared.layout == "slot":
            self.w8_set_weights(shared_expert.in_slot(routed.weights, shared.weights), device)
        else:
            self.w8_set_weights(routed.weights, device)
            self.w8_set_shared(shared.weights, device)
        return [routed, shared]

    def w8_set_meta(self, mode: str) -> None:
        if self.w8_shared is None:
            return super().w8_set_meta(mode)
        slot = self.w8_shared.layout == "slot"
        self.w8_set_weights(loaders.meta_weights(self.w8_plan, mode, extra_experts=1 if slot else 0))
        if not slot:
            self.w8_set_shared(loaders.meta_weights(self.w8_shared.plan, mode))

    def w8_set_shared(self, kw: KernelWeights, device=None) -> None:
        for name, t in zip(shared_expert.BUFFERS, (kw.w13, kw.w13_scales, kw.w2, kw.w2_scales)):
            setattr(self, name, t.to(device) if device is not None else t)


def _qwen3_5_sequence_parallel() -> bool:
    from importlib import import_module

    try:
        return bool(import_module("vllm_neuron.model.qwen3_5.flags").SEQUENCE_PARALLEL)
    except (ImportError, AttributeError) as e:
        raise NeuronGlueError(
            f"neuron-w8: vllm_neuron.model.qwen3_5.flags.SEQUENCE_PARALLEL is missing ({e}); the Qwen3.5 MoE block's "
            "interface changed (DEVELOPING.md, 'vllm-neuron interfaces we use')"
        ) from e


MIXINS = {"qwen3_moe": W8Qwen3MoeExperts, "qwen3_5_moe": W8Qwen3_5SparseMoeBlock}
_classes: dict[tuple[type, type], type] = {}


def _w8_class(cls: type, mixin: type) -> type:
    """``mixin`` in front of vllm-neuron's ``cls``. The class keeps ``cls``'s ``__name__``: fork code looks modules
    up by class name (jinhuang12 ``glm5_next`` ``_SHARD_GEOMETRY.get(type(module).__name__)``), which must still find
    the adopted module; ``__qualname__`` (``W8<name>``) and ``isinstance(m, _W8Routed)`` say it is ours."""
    key = (cls, mixin)
    if key not in _classes:
        _classes[key] = type(cls.__name__, (mixin, cls), {"__module__": __name__, "__qualname__": f"W8{cls.__name__}"})
    return _classes[key]


def layer_index(module_name: str) -> int:
    m = LAYER_RE.search(module_name)
    if m is None:
        raise NeuronGlueError(f"neuron-w8: cannot tell the layer of MoE module {module_name!r} (expected '...layers.<i>....')")
    return int(m.group(1))


def adopt(block, target: MoeTarget, module_name: str, plan, settings, architecture: str = "") -> None:
    """Turn one built vllm-neuron MoE block into ours in place (see the module docstring)."""
    interfaces.check_block(block, target, f"{architecture} {module_name}".strip())
    if getattr(block, "cross_dp_ep", False) or getattr(block, "mlp_dp_size", 1) > 1:
        raise NeuronGlueError(
            f"neuron-w8 on Neuron: {module_name}: expert parallelism across data-parallel replicas and MLP data "
            "parallelism (neuron_config.mlp_dp_size > 1) are not supported; keep expert parallelism inside one "
            "tensor-parallel group"
        )
    shared, shared_why = shared_expert.decide(block, plan, settings) if target.kind == "qwen3_5_moe" else (None, "")
    for name in target.bf16_params + (tuple(shared_expert.PARAMS.values()) if shared else ()):
        delattr(block, name)
    sequence_parallel = _qwen3_5_sequence_parallel() if target.kind == "qwen3_5_moe" else False
    block.__class__ = _w8_class(type(block), MIXINS[target.kind])
    block.w8_setup(plan, settings, layer_index(module_name), kernel_launch.backend(), sequence_parallel)
    if target.kind == "qwen3_5_moe":
        block.w8_shared, block.w8_shared_why = shared, shared_why
        for name in shared_expert.BUFFERS:
            block.register_buffer(name, None, persistent=False)


def adopted_blocks(model) -> list:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _W8Routed)]
