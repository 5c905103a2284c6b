"""GLM-5 under vllm-neuron: the fork jinhuang12/vllm-neuron's ``model/glm_moe_dsa`` with 1-byte routed experts.

The swap point is ``moe.GlmMoeDsaRoutedExperts`` inside ``GlmMoeDsaMoE`` (DEVELOPING.md pins the files), adopted as a
routed-expert bank of :mod:`vllm_moe_w8.neuron_glue.glm_experts`: its per-expert ``ModuleList`` of ``BlockFP8Linear``
gate/up/down (``torch.float8_e4m3fn`` bytes re-rounded by 240/448 at load, scales x 448/240) is released, the kernel
layout of :mod:`vllm_moe_w8.neuron_glue.loaders` (uint8 codes, exact pow2 by default, output-block opt-in) becomes the
only expert storage, and ``forward(hidden_states, affinities [T, E], selected_experts, *, is_decode)`` returns this
rank's routed sum from the fork's affinities (``W8RoutedBank.w8_bank_forward``: trace-safe, one kernel launch through
``kernel_launch.run_routed_experts``). The router (``GlmMoeDsaNoAuxRouter``: sigmoid, correction bias for the
selection, normalised x ``routed_scaling_factor``), the shared expert and the decoder's all-reduce stay the fork's.

Layout (:func:`rank_plan`): the fork's model passes ``expert_parallel_size = tensor_parallel_size`` (TP64 = EP64): pure
EP over the TP world, rank ``r`` owns whole experts ``[r*L, (r+1)*L)`` (``L = E / world``: 4 of 256 at TP64; the
bank's ``global_expert_ids``), each at full width (``tp_degree`` 1).

Load (:func:`account_routed_experts`): the fork's ``load_weights`` maps every parameter to one checkpoint key and
refuses unless the mapped keys equal its rank-local plan (``_account_manifest``). The released experts' keys are read
by neuron-w8's loader instead (``loaders.expert_keys``: per-expert ``...mlp.experts.<g>.<proj>.weight`` and
``weight_scale_inv`` of this rank's experts), so exactly those are added to what the fork accounts. The fork's FP8
loaders keep loading every other FP8 tensor themselves (no dequantising hook for this model).
"""

from __future__ import annotations

from vllm_moe_w8.codec.model_config import SUPPORTED_ARCHITECTURES
from vllm_moe_w8.neuron_glue import glm_experts
from vllm_moe_w8.neuron_glue.interfaces import MoeTarget, NeuronGlueError
from vllm_moe_w8.neuron_glue.loaders import RankPlan, expert_keys

FORK = "fork jinhuang12/vllm-neuron model/glm_moe_dsa/moe.py @02ef711"
ACCOUNT = "_account_manifest"  # model.py @02ef711: GlmMoeDsaForCausalLM._account_manifest(manifest, mappings)


class W8GlmMoeDsaRoutedExperts(glm_experts.W8RoutedBank):
    """``GlmMoeDsaRoutedExperts.forward(hidden_states [T, H], affinities [T, E], selected_experts [T, k], *,
    is_decode)``: this rank's routed sum [T, H] in the input's dtype (the decoder layer all-reduces)."""

    def forward(self, hidden_states, affinities, selected_experts=None, *, is_decode=False):
        # the affinities carry the selection (zero outside it); the kernels' schedule follows T, not is_decode
        return self.w8_bank_forward(hidden_states, affinities)


def rank_plan(bank, sizes: glm_experts.Sizes) -> RankPlan:
    """This rank's whole experts in the fork's pure-EP placement, checked against the bank and the model config."""
    num, ep, rank = int(bank.num_experts), int(bank.expert_parallel_size), int(bank.expert_parallel_rank)
    plan = RankPlan(num, ep, rank, 1, 0, int(bank.intermediate_size), int(bank.hidden_size))
    where = f"neuron-w8 on Neuron: GlmMoeDsaRoutedExperts ({num} experts, expert_parallel_size {ep}, rank {rank})"
    if ep < 1 or num % ep or int(bank.num_local_experts) != num // ep:
        raise NeuronGlueError(f"{where}: num_local_experts {bank.num_local_experts} is not {num} / {ep} ({FORK})")
    owned = tuple(int(g) for g in bank.global_expert_ids)
    if owned != tuple(range(plan.first_expert, plan.first_expert + plan.num_local)):
        raise NeuronGlueError(
            f"{where}: the bank owns experts {owned[:8]}, not the linear placement [{plan.first_expert}, "
            f"{plan.first_expert + plan.num_local}) neuron-w8's loader reads ({FORK}: local_expert_start = rank x L); "
            "its placement changed"
        )
    if (sizes.hidden, sizes.intermediate) != (plan.hidden_size, plan.intermediate_size):
        raise NeuronGlueError(
            f"{where}: the bank was built with hidden {plan.hidden_size} / intermediate {plan.intermediate_size}, the "
            f"model config says {sizes.hidden} / {sizes.intermediate}"
        )
    return plan


def release_experts(bank, target: MoeTarget) -> None:
    """The fork's per-expert modules (float8_e4m3fn parameters, meta only) leave the bank; nothing maps them again."""
    for name in target.bf16_params:
        delattr(bank, name)


def account_routed_experts(model, blocks, architecture: str) -> None:
    """Wrap the built model's ``_account_manifest`` so that the adopted banks' expert keys, read by neuron-w8's loader,
    count as accounted (module docstring). ``blocks``: [(module name, adopted bank)]."""
    prefix = SUPPORTED_ARCHITECTURES[architecture][0]
    original = getattr(model, ACCOUNT, None)
    if not callable(original):
        raise NeuronGlueError(
            f"neuron-w8 on Neuron: {type(model).__module__}.{type(model).__name__} has no {ACCOUNT}(manifest, mappings) "
            "(fork jinhuang12/vllm-neuron model/glm_moe_dsa/model.py @02ef711); its load interface changed"
        )
    candidates = [k for _, bank in blocks for k in expert_keys(prefix, bank.w8_layer, bank.w8_plan)]

    def account(manifest, mappings):
        present = manifest.by_key
        ours = {f"neuron-w8 routed expert <- {k}": k for k in candidates if k in present}
        return original(manifest, {**mappings, **ours})

    setattr(model, ACCOUNT, account)


# GLM-5 has no SwiGLU clamp; its top-k is the bank's
glm_experts.BANKS["glm_moe_dsa"] = glm_experts.BankAdoption(
    W8GlmMoeDsaRoutedExperts, rank_plan, lambda bank: 0.0, lambda bank: int(bank.top_k), release=release_experts,
    prepare_model=account_routed_experts)
