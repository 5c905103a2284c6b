"""What the installed vllm-neuron offers, and every vllm-neuron name neuron-w8 relies on.

The names below are the contract pinned in DEVELOPING.md ("vllm-neuron interfaces we use", with file
and commit). Each is looked up here, once, so that a vllm-neuron whose interface moved stops the
start-up with one message naming the architecture, the installed vllm-neuron version, what was
missing and what is supported, instead of failing somewhere inside a model.

Generations: the *current* one (vllm-neuron 0.24.x; its own model classes under ``vllm_neuron.model``,
run by ``vllm_neuron.vllm.worker.neuron_model_runner``) is supported. The *older* one (0.2.x, the
NxD Inference backend, ``vllm_neuron.worker.neuronx_distributed_model_loader``) is refused.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass

SUPPORTED_VLLM_NEURON_TEXT = (
    "vllm-neuron's current generation (0.24.x: its own model classes under vllm_neuron/model/, the native "
    "torch.compile backend, vLLM 0.24)"
)


class NeuronGlueError(RuntimeError):
    """neuron-w8 cannot take effect on this vllm-neuron: the message says why and what is supported."""


@dataclass(frozen=True)
class MoeTarget:
    """One vllm-neuron MoE model family whose BF16 MoE module neuron-w8 replaces."""

    kind: str  # "qwen3_moe" | "qwen3_5_moe"
    architectures: tuple[str, ...]  # Hugging Face architecture names served through it
    factory: tuple[str, str]  # (module, class): the registry's factory, whose from_configs we wrap
    block: tuple[str, str]  # (module, class): the BF16 MoE module replaced in the built model
    block_attrs: tuple[str, ...]  # attributes of a built block that our forward reads
    bf16_params: tuple[str, ...]  # the BF16 expert parameters dropped from the block
    block_methods: tuple[str, ...] = ()  # methods of the block our forward calls


QWEN3_MOE = MoeTarget(
    kind="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    factory=("vllm_neuron.model.qwen3_moe", "Qwen3MoeForCausalLM"),
    block=("vllm_neuron.model.qwen3_moe.model_bf16", "Qwen3MoeExperts"),
    block_attrs=(
        "tp_group", "moe_group", "ep_degree", "ep_rank", "tp_degree", "num_local_experts", "total_num_experts",
        "num_experts_per_token", "norm_topk_prob", "hidden_size", "intermediate_size", "intermediate_size_per_rank",
        "post_attention_layernorm", "router_weight", "cross_dp_ep", "mlp_dp_size",
    ),
    bf16_params=("gate_up_proj_weight", "down_proj_weight"),
)

QWEN3_5_MOE = MoeTarget(
    kind="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration",),  # the text-only layout: NOT_REPLACED below
    factory=("vllm_neuron.model.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    block=("vllm_neuron.model.qwen3_5.moe", "Qwen3_5SparseMoeBlock"),
    block_attrs=(
        "tp_group", "world_size", "ep_degree", "ep_rank", "tp_degree", "num_local_experts", "num_experts", "top_k",
        "hidden_size", "intermediate_size", "inter_per_rank", "router_weight", "dtype",
        "shared_per_rank", "shared_gate_proj_weight", "shared_up_proj_weight", "shared_down_proj_weight",
        "shared_expert_gate_weight",
    ),
    bf16_params=("experts_gate_up_weight", "experts_down_weight"),
    block_methods=("_shared_expert", "_combine"),
)

# GLM routed-expert banks (fork jinhuang12/vllm-neuron): a module whose forward takes this rank's tokens and the
# router's affinities over ALL experts [T, E] and returns this rank's routed sum [T, H]; adopted by
# neuron_glue.glm_experts (the router, the shared expert and the collectives stay the fork's).
GLM5_NEXT = MoeTarget(
    kind="glm5_next",
    architectures=("Glm5NextForConditionalGeneration",),
    factory=("vllm_neuron.model.glm5_next", "Glm5NextForConditionalGeneration"),
    block=("vllm_neuron.model.glm5_next.model_fp8", "Glm5NextRoutedExperts"),
    block_attrs=("num_routed_experts", "num_experts_per_tok", "tp_degree", "ep_degree", "num_local_experts",
                 "swiglu_limit", "router_weight", "router_bias"),
    bf16_params=("gate_proj_weight", "up_proj_weight", "down_proj_weight"),  # the fork's FP8 bank (declared)
    block_methods=("route_tokens", "prepare_scale_operands", "local_expert_indices"),
)

GLM_MOE_DSA = MoeTarget(  # GLM-5: adopted by neuron_glue.glm_moe_dsa (a bank of glm_experts)
    kind="glm_moe_dsa",
    architectures=("GlmMoeDsaForCausalLM",),
    factory=("vllm_neuron.model.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    block=("vllm_neuron.model.glm_moe_dsa.moe", "GlmMoeDsaRoutedExperts"),
    block_attrs=("hidden_size", "intermediate_size", "num_experts", "top_k", "expert_parallel_size",
                 "expert_parallel_rank", "num_local_experts", "local_expert_start", "global_expert_ids"),
    bf16_params=("experts",),  # the fork's per-expert ModuleList of BlockFP8Linear (float8_e4m3fn) gate/up/down
)

TARGETS = (QWEN3_MOE, QWEN3_5_MOE, GLM5_NEXT, GLM_MOE_DSA)

# Architectures of checkpoints neuron-w8 supports whose experts it does not replace under vllm-neuron: why, and
# what to use instead (refused at start-up by resolve_target; sources in DEVELOPING.md, "vllm-neuron interfaces").
NOT_REPLACED = {
    "Qwen3_5MoeForCausalLM": "vllm-neuron has no model for the text-only Qwen3.5-MoE layout (flat config.json, tensors "
                             "under model.layers.*): it serves Qwen3.5-MoE only as Qwen3_5MoeForConditionalGeneration, "
                             "whose config reader (qwen3_5 Qwen3_5Config.from_hf) requires a nested text_config and whose "
                             "load_weights reads every text tensor under model.language_model.*. Under vllm-neuron serve "
                             "the multimodal checkpoint (architectures [\"Qwen3_5MoeForConditionalGeneration\"], the "
                             "layout Qwen/Qwen3.5-*-FP8 ship); this text-only checkpoint is served by neuron-w8 on vLLM's "
                             "own model classes (the vLLM-generic path)",
}

# Present only in the dense-only Qwen3.5 generation: what composing our MoE block would need from it.
QWEN3_5_DENSE_ONLY_MISSING = (
    "vllm_neuron.model.qwen3_5.moe.Qwen3_5SparseMoeBlock (the MoE slot of Qwen3_5DecoderLayer, called as "
    "mlp(hidden_states, is_prefill, norm, positions, rank) on the un-normalised residual), a registry factory for "
    "Qwen3_5MoeForConditionalGeneration, Qwen3_5TextConfig.moe (num_experts, moe_intermediate_size, "
    "shared_expert_intermediate_size) and load_weights mappings for the router and shared expert: the dense model "
    "builds Qwen3_5MLP unconditionally and maps only dense MLP tensors, so our block cannot be composed in without "
    "copying its decoder layer"
)


def vllm_neuron_version() -> str:
    """The installed vllm-neuron's version ('not installed' when absent)."""
    try:
        return importlib.metadata.version("vllm-neuron")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import vllm_neuron

        return str(getattr(vllm_neuron, "__version__", "unknown (no package metadata)"))
    except ImportError:
        return "not installed"


def has_module(name: str) -> bool:
    """Whether ``name`` can be imported (found on the path), without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def generation() -> str:
    """'current', 'nxdi' (0.2.x NxD Inference backend), 'absent' or 'unknown'."""
    if not has_module("vllm_neuron"):
        return "absent"
    if has_module("vllm_neuron.model.registry") and has_module("vllm_neuron.vllm.worker.neuron_model_runner"):
        return "current"
    if has_module("vllm_neuron.worker.neuronx_distributed_model_loader"):
        return "nxdi"
    return "unknown"


def generation_error() -> str | None:
    """Why neuron-w8 cannot work with the installed vllm-neuron at all, or None."""
    gen = generation()
    version = vllm_neuron_version()
    if gen == "current":
        return None
    if gen == "nxdi":
        return (
            f"neuron-w8 needs {SUPPORTED_VLLM_NEURON_TEXT}; the installed vllm-neuron {version} is the older "
            "generation (NxD Inference backend, vllm_neuron/worker/neuronx_distributed_model_loader.py), which compiles "
            "NxD Inference models and has no expert module to replace. Install vllm-neuron 0.24.x from the Neuron SDK "
            "(2.31 or later) with its vLLM 0.24.0"
        )
    return (
        f"neuron-w8 needs {SUPPORTED_VLLM_NEURON_TEXT}; the installed vllm-neuron ({version}) has neither "
        "vllm_neuron.model.registry with vllm_neuron.vllm.worker.neuron_model_runner nor the older NxD Inference loader"
    )


def supported_text() -> str:
    names = [a for t in TARGETS for a in t.architectures]
    return ", ".join(names)


def import_attr(module: str, name: str):
    mod = importlib.import_module(module)
    return getattr(mod, name)


def resolve_target(architecture: str) -> tuple[MoeTarget, type, type]:
    """(target, factory class, block class) for an architecture, or :class:`NeuronGlueError` saying why not."""
    version = vllm_neuron_version()
    header = f"neuron-w8 on Neuron: architecture {architecture} with vllm-neuron {version}"
    if architecture in NOT_REPLACED:
        raise NeuronGlueError(f"{header}: {NOT_REPLACED[architecture]}. neuron-w8 replaces the experts of: {supported_text()}")
    target = next((t for t in TARGETS if architecture in t.architectures), None)
    if target is None:
        raise NeuronGlueError(f"{header}: not supported. neuron-w8 replaces the experts of: {supported_text()}")
    try:
        factory = import_attr(*target.factory)
        block = import_attr(*target.block)
    except (ImportError, AttributeError) as e:
        missing = f"{target.factory[0]}.{target.factory[1]} / {target.block[0]}.{target.block[1]}"
        if target is QWEN3_5_MOE and has_module("vllm_neuron.model.qwen3_5"):
            raise NeuronGlueError(
                f"{header}: this vllm-neuron has the dense Qwen3.5 model but no MoE variant; missing: "
                f"{QWEN3_5_DENSE_ONLY_MISSING} ({e}). neuron-w8 replaces the experts of: {supported_text()}"
            ) from e
        raise NeuronGlueError(
            f"{header}: this vllm-neuron has no {missing} ({e}); its model for this architecture is missing or its "
            f"interface changed. neuron-w8 replaces the experts of: {supported_text()} (interfaces in DEVELOPING.md)"
        ) from e
    if not callable(getattr(factory, "from_configs", None)):
        raise NeuronGlueError(f"{header}: {target.factory[0]}.{target.factory[1]} has no from_configs (interface changed)")
    return target, factory, block


def check_block(block, target: MoeTarget, where: str) -> None:
    """A built BF16 MoE module has every attribute, parameter and method our replacement uses."""
    missing = [a for a in target.block_attrs + target.bf16_params + target.block_methods if not hasattr(block, a)]
    if missing:
        raise NeuronGlueError(
            f"neuron-w8 on Neuron: {where} ({type(block).__module__}.{type(block).__name__}, vllm-neuron "
            f"{vllm_neuron_version()}) lacks {missing}; its interface changed from the one neuron-w8 was written "
            "against (DEVELOPING.md, 'vllm-neuron interfaces we use')"
        )
