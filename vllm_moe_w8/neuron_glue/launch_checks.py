"""What a vllm-neuron fork requires of a launch, checked at start-up (before it fails deep inside the model build).

Called from the platform's ``check_and_update_config`` when neuron-w8 is requested
(:func:`vllm_moe_w8.neuron_glue.registration._precheck_config`), after the architecture and the registry passed.
Every requirement is read from the installed fork where it lives (its class attributes and config reader), so a
fork that changes a pin changes the check with it; each unmet one is listed with its remedy, all at once, followed
by a command line that starts.

GLM-5 (fork jinhuang12/vllm-neuron ``model/glm_moe_dsa``; DEVELOPING.md pins the files):

* on-device sampling greedy, or off: ``model.py`` @02ef711 ``GlmMoeDsaForCausalLM.__init__`` raises "GLM-5.2 on-device
  sampling supports greedy only" unless ``neuron_config.on_device_sampling_config`` is ``None`` or ``all_greedy``,
  and the runner's ``NeuronConfig.from_dict`` of a launch without ``neuron_config`` is sampling, not greedy
  (``model/neuron_config.py`` @289de16: the key absent -> ``OnDeviceSamplingConfig()``, ``all_greedy=False``);
* ``--tensor-parallel-size`` = ``factory.GlmMoeDsaForCausalLM.SUPPORTED_TENSOR_PARALLEL_SIZE`` (64 @7d00445; the
  factory reads vLLM's TP world size);
* the architecture pins ``config.GlmMoeDsaConfig._EXPECTED_VALUES`` and ``_EXPECTED_QUANTIZATION`` (@4175881), and
  ``torch_dtype`` bfloat16, against the checkpoint's config.json.

GLM-5.3-Flash (fork ``model/glm5_next``, the later stored versions DEVELOPING.md names):

* a ``vision_config`` in config.json (``config.Glm5NextConfig.from_configs`` reads ``top_level["vision_config"]``);
* ``num_experts_per_tok`` exactly 8 and 8 .. 512 routed experts (``functional/moe/router.py``
  ``noaux_tc_rmsnorm_router_topk``: ``NOAUX_TC_K = 8``, ``nisa.max8``; the expert count is the router weight's
  dim 1, at most 512);
* ``text_config.layer_types`` only the fork's two families (``config.KDA_LAYER_TYPE`` / ``DSA_LAYER_TYPE``, read from
  the installed fork): transformers releases with huggingface/transformers#48974 (5.19.0 has it) rename
  ``deepseek_sparse_attention`` to ``indexed_attention`` in every config vLLM hands over, and the fork's
  ``Glm5NextTextConfig`` refuses the renamed entry ("unrecognised attention families").
"""

from __future__ import annotations

import importlib
import json

from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

GLM5 = "GlmMoeDsaForCausalLM"
GLM5_NEXT = "Glm5NextForConditionalGeneration"
GREEDY_ODS = '{"neuron_config": {"on_device_sampling_config": {"all_greedy": true}}}'
NOAUX_TC_K = 8  # fork functional/moe/router.py: top_k must be exactly 8 (nisa.max8 emits 8 values per token)
NOAUX_TC_MAX_EXPERTS = 512  # the router's expert-count bound (nkilib's gemm moving free-dim maximum)

SERVE = {
    GLM5: ("NEURON_LOGICAL_NC_CONFIG=2 vllm serve zai-org/GLM-5-FP8 --quantization neuron-w8 "
           "--tensor-parallel-size {tp} --additional-config '" + GREEDY_ODS + "'"),
}


def _as_dict(hf_config) -> dict:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    return json.loads(json.dumps(hf_config, default=lambda o: vars(o)))  # a namespace (tests)


def _neuron_config_section(vllm_config) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get("neuron_config") if isinstance(extra, dict) else None
    return dict(section) if isinstance(section, dict) else {}


def _runner_neuron_config(vllm_config):
    """The NeuronConfig vllm-neuron's runner builds from ``additional_config["neuron_config"]``."""
    cls = importlib.import_module("vllm_neuron.model.neuron_config").NeuronConfig
    return cls.from_dict(_neuron_config_section(vllm_config))


def _tensor_parallel_size(vllm_config) -> int | None:
    pc = getattr(vllm_config, "parallel_config", None)
    tp = getattr(pc, "tensor_parallel_size", None)
    return int(tp) if tp is not None else None


def _glm5(vllm_config) -> tuple[list[str], dict]:
    factory = importlib.import_module("vllm_neuron.model.glm_moe_dsa.factory").GlmMoeDsaForCausalLM
    cfg_cls = importlib.import_module("vllm_neuron.model.glm_moe_dsa.config").GlmMoeDsaConfig
    problems = []
    ods = getattr(_runner_neuron_config(vllm_config), "on_device_sampling_config", None)
    if ods is not None and not getattr(ods, "all_greedy", False):
        problems.append(
            "on-device sampling must be greedy: the fork's glm_moe_dsa/model.py refuses to build otherwise ('GLM-5.2 "
            "on-device sampling supports greedy only'), and vllm-neuron's NeuronConfig samples (all_greedy false) unless "
            f"told otherwise. Remedy: --additional-config '{GREEDY_ODS}' (or \"on_device_sampling_config\": null to "
            "sample on the host)"
        )
    want_tp = int(factory.SUPPORTED_TENSOR_PARALLEL_SIZE)
    tp = _tensor_parallel_size(vllm_config)
    if tp is not None and tp != want_tp:
        problems.append(f"--tensor-parallel-size is {tp}; the fork's GlmMoeDsaForCausalLM builds only at "
                        f"SUPPORTED_TENSOR_PARALLEL_SIZE = {want_tp}. Remedy: --tensor-parallel-size {want_tp}")
    config = _as_dict(vllm_config.model_config.hf_config)
    pins = [f"{k} = {config.get(k)!r} (the fork pins {v!r})" for k, v in cfg_cls._EXPECTED_VALUES.items()
            if config.get(k) != v]
    quant = config.get("quantization_config") or config.get(getattr(cfg_cls, "_CHECKPOINT_QUANTIZATION_FIELD", ""))
    quant = quant if isinstance(quant, dict) else {}
    pins += [f"quantization_config.{k} = {quant.get(k)!r} (the fork pins {v!r})"
             for k, v in getattr(cfg_cls, "_EXPECTED_QUANTIZATION", {}).items() if quant.get(k) != v]
    dtype = config.get("torch_dtype", config.get("dtype"))
    if dtype is not None and str(dtype).replace("torch.", "") != "bfloat16":
        pins.append(f"torch_dtype = {dtype!r} (the fork requires bfloat16)")
    if pins:
        problems.append("the checkpoint is not the model the fork's GlmMoeDsaConfig is pinned to: " + "; ".join(pins)
                        + ". Remedy: serve the GLM-5 FP8 checkpoint the fork pins")
    return problems, {"tp": want_tp}


def _glm5_next(vllm_config) -> tuple[list[str], dict]:
    config = _as_dict(vllm_config.model_config.hf_config)
    problems = []
    if config.get("vision_config") is None:
        problems.append("config.json has no vision_config: the fork's Glm5NextConfig.from_configs reads "
                        "top_level['vision_config'] (KeyError). Remedy: serve the released multimodal checkpoint, whose "
                        "config.json carries text_config and vision_config")
    text = config.get("text_config") or {}
    fork = importlib.import_module("vllm_neuron.model.glm5_next.config")
    families = (fork.KDA_LAYER_TYPE, fork.DSA_LAYER_TYPE)
    unknown = sorted({t for t in text.get("layer_types") or () if t not in families})
    if unknown:
        import transformers

        problems.append(
            f"text_config.layer_types carries {unknown}, which the fork's Glm5NextTextConfig refuses (it knows "
            f"{list(families)}): transformers {transformers.__version__} renames the checkpoint's "
            f"'{fork.DSA_LAYER_TYPE}' to 'indexed_attention' in every config (huggingface/transformers#48974). Remedy: "
            "a transformers release without that rename (the fork was written against 5.16.1), or a fork whose "
            "config reader accepts the new name")
    k, experts = text.get("num_experts_per_tok"), text.get("n_routed_experts")
    if k is not None and int(k) != NOAUX_TC_K:
        problems.append(f"text_config.num_experts_per_tok = {k}: the fork's noaux_tc router selects exactly "
                        f"{NOAUX_TC_K} experts per token (NoauxTcRouterError otherwise); no remedy but a top-"
                        f"{NOAUX_TC_K} checkpoint")
    if experts is not None and not NOAUX_TC_K <= int(experts) <= NOAUX_TC_MAX_EXPERTS:
        problems.append(f"text_config.n_routed_experts = {experts}: the fork's router serves {NOAUX_TC_K} .. "
                        f"{NOAUX_TC_MAX_EXPERTS} experts")
    return problems, {}


REQUIREMENTS = {GLM5: _glm5, GLM5_NEXT: _glm5_next}
SOURCES = {GLM5: "fork jinhuang12/vllm-neuron model/glm_moe_dsa (factory @7d00445, model @02ef711, config @4175881)",
           GLM5_NEXT: "fork jinhuang12/vllm-neuron model/glm5_next (config.py and functional/moe/router.py, the later "
                      "stored versions)"}


def check(arch: str, vllm_config) -> None:
    """Refuse a launch the installed fork would refuse while building ``arch``, naming every requirement and remedy."""
    rule = REQUIREMENTS.get(arch)
    if rule is None:
        return
    try:
        problems, fill = rule(vllm_config)
    except (ImportError, AttributeError) as e:
        raise NeuronGlueError(f"neuron-w8 on Neuron: {arch}: cannot read the installed fork's launch requirements "
                              f"({SOURCES[arch]}): {e}; its interface changed") from e
    if problems:
        serve = SERVE.get(arch)
        for key, value in fill.items():
            serve = serve.replace("{" + key + "}", str(value)) if serve else serve
        tail = f" A launch that starts: {serve}" if serve else ""
        raise NeuronGlueError(f"neuron-w8 on Neuron: {arch}: the vllm-neuron fork ({SOURCES[arch]}) would refuse this "
                              f"launch while building the model: " + " | ".join(problems) + "." + tail)
