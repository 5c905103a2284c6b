"""Registration on a Neuron platform: make ``--quantization neuron-w8`` take effect under vllm-neuron.

:func:`install` (called by ``vllm_moe_w8.register()`` in every vLLM process when the current platform
is vllm-neuron's) does three things, each by wrapping, never by copying vllm-neuron code:

1. the platform class: ``neuron-w8`` joins ``supported_quantization`` (so vLLM's
   ``verify_quantization`` passes), and ``check_and_update_config`` first checks, when neuron-w8 is
   requested, that the installed vllm-neuron can take it (generation, architecture, settings) so a
   start-up that cannot work stops there, naming the architecture, the version and what is supported;
2. the factories of the supported MoE families (``from_configs`` of the class vLLM's registry resolves):
   when neuron-w8 is requested, each built model's BF16 MoE blocks become ours
   (:func:`vllm_moe_w8.neuron_glue.experts.adopt`);
3. that model's ``load_weights`` / ``load_weights_lite`` (:mod:`vllm_moe_w8.neuron_glue.model_load`): sizes
   checked against the checkpoint, FP8 tensors of the other layers reach vllm-neuron's loaders dequantised on
   every loader thread, then our loader fills the experts (:mod:`vllm_moe_w8.neuron_glue.loaders`).
"""

from __future__ import annotations

import logging

from vllm_moe_w8.about import QUANTIZATION_NAME
from vllm_moe_w8.neuron_glue import experts, glm_experts, interfaces, launch_checks, loaders, mixers, model_load, settings
from vllm_moe_w8.neuron_glue import glm_moe_dsa  # noqa: F401  (adds GLM-5's bank to glm_experts.BANKS)
from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

logger = logging.getLogger("vllm.neuron_w8")
WRAPPED = "_neuron_w8_wrapped"


def install(platform_cls: type) -> None:
    """Idempotent; see the module docstring."""
    extend_platform(platform_cls)
    if interfaces.generation_error() is not None:
        return  # refused in check_and_update_config / verify_quantization, only when neuron-w8 is asked for
    for target in interfaces.TARGETS:
        try:
            factory = interfaces.import_attr(*target.factory)
        except (ImportError, AttributeError) as e:
            logger.debug("neuron-w8: %s not wrapped: %s", target.factory, e)
            continue
        wrap_factory(factory, target)


def extend_platform(platform_cls: type) -> None:
    supported = list(getattr(platform_cls, "supported_quantization", None) or [])
    if QUANTIZATION_NAME not in supported:
        platform_cls.supported_quantization = supported + [QUANTIZATION_NAME]
    for name, hook in (("check_and_update_config", _precheck_config), ("verify_quantization", _precheck_name)):
        current = getattr(platform_cls, name, None)
        if current is None or getattr(current, WRAPPED, False):
            continue
        original = current.__func__

        def wrapped(cls, arg, _original=original, _hook=hook):
            _hook(arg)
            return _original(cls, arg)

        setattr(wrapped, WRAPPED, True)
        wrapped.__doc__ = original.__doc__
        setattr(platform_cls, name, classmethod(wrapped))


def _precheck_name(quant) -> None:
    if isinstance(quant, str) and quant.lower() == QUANTIZATION_NAME:
        err = interfaces.generation_error()
        if err:
            raise NeuronGlueError(err)


def _precheck_config(vllm_config) -> None:
    """When neuron-w8 is requested: the installed vllm-neuron serves this architecture, the launch gives its model what
    it requires (:mod:`launch_checks`) and the settings are valid."""
    if not settings.requested(vllm_config):
        return
    err = interfaces.generation_error()
    if err:
        raise NeuronGlueError(err)
    model_config = vllm_config.model_config
    arch = architecture_of(model_config.hf_config)
    target, factory, _ = interfaces.resolve_target(arch)
    check_registered(arch, factory)
    launch_checks.check(arch, vllm_config)  # what the installed fork requires of this launch (ODS, TP, pins)
    settings.resolve(quant_config_of(model_config.hf_config), getattr(vllm_config, "additional_config", None))


# The public vllm-neuron trees read (DEVELOPING.md pins the files) whose registry (model/registry.py get_models())
# lists each architecture neuron-w8 adopts; vLLM resolves an unlisted architecture to its own model class,
# which vllm-neuron's runner cannot build.
REGISTERED_IN = {
    "Qwen3MoeForCausalLM": "none of the trees read registers it (vllm-project/vllm-neuron model/registry.py @5528be7, "
                           "jinhuang12/vllm-neuron and whn09/vllm-neuron list no Qwen3MoeForCausalLM, although "
                           "upstream has model/qwen3_moe/)",
    "Qwen3_5MoeForConditionalGeneration": "whn09/vllm-neuron model/registry.py @3de9ea3",
    "GlmMoeDsaForCausalLM": "jinhuang12/vllm-neuron model/registry.py @3a1e231 (not @83b3499, which lists "
                            "DeepseekV4ForCausalLM instead)",
    "Glm5NextForConditionalGeneration": "none of the trees read registers it (jinhuang12/vllm-neuron model/registry.py "
                                        "@83b3499 and @3a1e231 do not list it, although model/glm5_next/__init__.py "
                                        "@b097661 exports its factory)",
}
REGISTRY = ("vllm_neuron.model.registry", "get_models")


def check_registered(arch: str, factory: type) -> None:
    """The installed vllm-neuron's registry lists ``arch`` with the factory neuron-w8 wraps, else refuse naming the trees."""
    version = interfaces.vllm_neuron_version()
    try:
        models = dict(interfaces.import_attr(*REGISTRY)())
    except Exception as e:  # noqa: BLE001  (any failure: the registry cannot be read)
        raise NeuronGlueError(f"neuron-w8 on Neuron: cannot read vllm-neuron {version}'s {'.'.join(REGISTRY)}() ({e})") from e
    registered = models.get(arch)
    if registered is None or not (isinstance(registered, type) and issubclass(registered, factory) or registered is factory):
        found = "does not list it" if registered is None else f"maps it to {registered!r}, not {factory.__module__}.{factory.__name__}"
        raise NeuronGlueError(
            f"neuron-w8 on Neuron: architecture {arch}: vllm-neuron {version}'s registry ({'.'.join(REGISTRY)}()) {found}, "
            f"so vLLM would build a model class vllm-neuron cannot run. vllm-neuron trees whose registry lists "
            f"{arch}: {REGISTERED_IN.get(arch, 'none known')}. Install one of those, or serve without --quantization "
            "neuron-w8"
        )


def architecture_of(hf_config) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        raise NeuronGlueError("neuron-w8 on Neuron: the model's config.json names no architecture")
    return archs[0]


def quant_config_of(hf_config) -> dict | None:
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None and getattr(hf_config, "text_config", None) is not None:
        cfg = getattr(hf_config.text_config, "quantization_config", None)
    if cfg is not None and not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    return cfg


def wrap_factory(factory: type, target: interfaces.MoeTarget) -> None:
    current = factory.from_configs
    if getattr(current, WRAPPED, False):
        return
    original = current.__func__

    def from_configs(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        vllm_config = current_vllm_config()
        if not settings.requested(vllm_config):
            return model
        return convert_model(model, vllm_config)

    setattr(from_configs, WRAPPED, True)
    factory.from_configs = classmethod(from_configs)


def current_vllm_config():
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


def rank_plan(block, target: interfaces.MoeTarget) -> loaders.RankPlan:
    tp_degree = int(block.tp_degree)
    if target.kind == "qwen3_5_moe" and block.ep_degree > 1:
        tp_rank = int(block.ep_tp_group.rank_in_group)
    else:
        tp_rank = int(block.tp_group.rank_in_group) % tp_degree
    num_experts = block.total_num_experts if target.kind == "qwen3_moe" else block.num_experts
    return loaders.RankPlan(int(num_experts), int(block.ep_degree), int(block.ep_rank), tp_degree, tp_rank,
                            int(block.intermediate_size), int(block.hidden_size))


def convert_model(model, vllm_config):
    """Adopt every BF16 MoE block of a built vllm-neuron model and wrap its ``load_weights``."""
    model_config = vllm_config.model_config
    arch = architecture_of(model_config.hf_config)
    target, _, block_cls = interfaces.resolve_target(arch)
    cfg = settings.resolve(quant_config_of(model_config.hf_config), getattr(vllm_config, "additional_config", None))
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, block_cls)]
    if not blocks:
        raise NeuronGlueError(
            f"neuron-w8 on Neuron: the {arch} model vllm-neuron {interfaces.vllm_neuron_version()} built has no "
            f"{target.block[1]} module; its interface changed (DEVELOPING.md, 'vllm-neuron interfaces we use')"
        )
    plans = []
    bank = target.kind in glm_experts.BANKS  # a GLM routed-expert bank (glm_experts), else a Qwen MoE block (experts)
    for name, block in blocks:
        plans.append(glm_experts.rank_plan(block, target, model_config.hf_config) if bank else rank_plan(block, target))
        plans[-1].validate(name)
        (glm_experts if bank else experts).adopt(block, target, name, plans[-1], cfg, arch)
    prepare = glm_experts.BANKS[target.kind].prepare_model if bank else None
    if prepare is not None:
        prepare(model, blocks, arch)
    linears, kept = mixers.adopt(model, cfg) if target.kind == "qwen3_5_moe" else ([], [])
    # the GLM models load their own FP8 non-expert tensors (bytes + scales): no dequantising hook for them
    model_load.wrap(model, arch, cfg, dtype=model_config.dtype, dequantise_non_experts=not bank)
    shared = sorted({getattr(b, "w8_shared_why", "") for _, b in blocks} - {""})
    logger.info(
        "neuron-w8 on Neuron: %s (vllm-neuron %s): %d MoE blocks use 1-byte experts (mode %s from %s, LNC %d)%s",
        arch, interfaces.vllm_neuron_version(), len(blocks), cfg.mode, cfg.mode_source, cfg.lnc,
        f"; shared expert: {'; '.join(shared)}" if shared else "",
    )
    if target.kind == "qwen3_5_moe":
        logger.info("neuron-w8 on Neuron: %s: %d attention / Gated-DeltaNet mixers run their FP8 projections at 1 byte "
                    "(the block-scaled linear kernel)%s", arch, len(linears),
                    "" if cfg.non_expert_w8 else f"; all stay BF16 (non_expert_layers bf16 from {cfg.non_expert_source})")
        for name, why in kept:
            logger.warning("neuron-w8 on Neuron: %s keeps vllm-neuron's BF16 projections: %s", name, why)
    return model
