"""The built model's ``load_weights`` (and ``load_weights_lite``) with neuron-w8's experts.

vllm-neuron's runner (upstream ``vllm/worker/neuron_model_runner.py`` @9fc042ea, ``load_model``) builds the
model on the meta device, then either calls ``model.load_weights(path, device, download_dir)`` and moves the
model to the device, or, with ``VLLM_NEURON_CPU_COMPILE``, calls ``model.load_weights_lite(path, cpu,
download_dir)`` and moves the model to meta (the graph is compiled without weights). Both are wrapped here:

* :func:`wrap` ``load_weights``: first the built model's sizes are compared with the checkpoint's
  (:func:`check_sizes`: a vllm-neuron config that lost ``num_experts`` builds its default expert count);
  then vllm-neuron's own load runs with :mod:`slice_hook` active on every thread (non-expert FP8 tensors
  dequantised, scales from the checkpoint's own index); then each adopted block's experts are read, repacked
  and laid out (:mod:`loaders`) and stored on ``device``.
* ``load_weights_lite``: every adopted block gets meta buffers of the kernel layout's shapes and dtypes
  (:func:`meta_weights`), so the compiled graph sees the experts it will run with; then vllm-neuron's own. A model
  without one (whn09 ``qwen3_5/model.py`` @3de9ea3: the runner then only moves it to meta) gets one that does the
  first part only.
* A weights-free ``load_weights`` call (the later fork's GLM-5.3 ``load_weights_lite`` is
  ``self.load_weights(path, meta, cache_dir, reader=_MetaShapeCheckpoint(...))``): any keyword is passed on to
  vllm-neuron's own, and with a ``reader`` or a meta ``device`` no expert is read: the blocks get the meta buffers.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from vllm_moe_w8.codec.model_config import SUPPORTED_ARCHITECTURES, text_config
from vllm_moe_w8.neuron_glue import experts, interfaces, loaders, mixers, slice_hook
from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

logger = logging.getLogger("vllm.neuron_w8")
CHECKPOINT_CLASS = ("vllm_neuron.utils.checkpoints", "SafetensorsCheckpoint")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def checkpoint_class():
    try:
        cls = interfaces.import_attr(*CHECKPOINT_CLASS)
    except (ImportError, AttributeError) as e:
        raise NeuronGlueError(f"neuron-w8 on Neuron: {'.'.join(CHECKPOINT_CLASS)} is missing ({e}); interface changed") from e
    if "_get_slice" not in vars(cls):
        raise NeuronGlueError(f"neuron-w8 on Neuron: {'.'.join(CHECKPOINT_CLASS)} has no _get_slice (interface changed)")
    return cls


def checkpoint_sizes(config: dict) -> dict[str, int | None]:
    """Routed experts, hidden and per-expert intermediate size from a checkpoint's config.json."""
    t = text_config(config)
    count = next((t[k] for k in EXPERT_COUNT_KEYS if isinstance(t.get(k), int)), None)
    return {"experts": count, "hidden": t.get("hidden_size"), "intermediate": t.get("moe_intermediate_size")}


def check_sizes(model_path: str, config: dict, plans: list[tuple[str, loaders.RankPlan]], version: str) -> None:
    """Refuse a built model whose expert count, hidden or intermediate size differs from the checkpoint's."""
    want = checkpoint_sizes(config)
    for name, plan in plans:
        built = {"experts": plan.num_experts, "hidden": plan.hidden_size, "intermediate": plan.intermediate_size}
        for what, value in built.items():
            if want[what] is not None and value != want[what]:
                cause = (
                    " A likely cause: transformers 5's PretrainedConfig.to_dict() renames num_experts to "
                    "num_local_experts, and vllm-neuron's Qwen3MoeConfig.from_configs then falls back to its default "
                    "(128 experts); use a vllm-neuron whose config reads num_local_experts, or transformers < 5"
                    if what == "experts" else ""
                )
                raise NeuronGlueError(
                    f"neuron-w8 on Neuron: vllm-neuron {version} built {name} with {what} = {value}, but the checkpoint "
                    f"{model_path} has {what} = {want[what]} (config.json); loading would fail on the router's shape "
                    f"or serve a different model.{cause}"
                )


meta_weights = loaders.meta_weights  # kernel-layout buffers on meta (loaders.meta_weights)


def wrap(model, arch: str, cfg, dtype, dequantise_non_experts: bool = True) -> None:
    """Wrap the built model's ``load_weights`` and ``load_weights_lite`` (see the module docstring).
    ``dequantise_non_experts=False``: a model that loads its own FP8 non-expert tensors (vllm-neuron's GLM models)
    gets them as the checkpoint has them (no :mod:`slice_hook`)."""
    original = getattr(model, "load_weights", None)
    if original is None:
        raise NeuronGlueError(f"neuron-w8 on Neuron: the {arch} model has no load_weights (interface changed)")
    checkpoint_cls = checkpoint_class() if dequantise_non_experts else None
    prefix = SUPPORTED_ARCHITECTURES[arch][0]

    def set_meta_weights():
        for _, block in experts.adopted_blocks(model):
            block.w8_set_meta(cfg.mode)
        if mixers.adopted_mixers(model):
            mixers.set_meta(model)

    def load_weights(checkpoint_path, device, cache_dir=None, **kwargs):
        if kwargs.get("reader") is not None or torch.device(device).type == "meta":
            set_meta_weights()  # a weights-free load (shapes only): read no expert
            logger.info("neuron-w8 on Neuron: a weights-free load_weights (reader=%s, device %s): the experts get meta "
                        "buffers of the kernel layout (no weights read)", type(kwargs.get("reader")).__name__, device)
            return original(checkpoint_path, device, cache_dir, **kwargs)
        source = loaders.ExpertSource(loaders.resolve_checkpoint_dir(checkpoint_path, cache_dir), prefix)
        blocks = experts.adopted_blocks(model)
        check_sizes(checkpoint_path, source.ckpt.config, [(n, b.w8_plan) for n, b in blocks],
                    interfaces.vllm_neuron_version())
        hook = slice_hook.active(checkpoint_cls, source.ckpt, cfg.fmt, dtype) if dequantise_non_experts else contextlib.nullcontext()
        with hook:
            original(checkpoint_path, device, cache_dir, **kwargs)
        loads, plan = [], None
        for _, block in blocks:
            loads += block.w8_load(source, cfg, device)
            plan = block.w8_plan
        loaders.log_totals(loads, cfg, plan, layers=len(blocks))
        if mixers.adopted_mixers(model):
            launches = mixers.load(source, model, device, check=cfg.self_check)
            logger.info("neuron-w8 on Neuron: loaded %d 1-byte projection groups of %d mixers (q+k+v, o_proj, "
                        "in_proj_qkv+z, out_proj)", launches, len(mixers.adopted_mixers(model)))

    model.load_weights = load_weights
    lite = getattr(model, "load_weights_lite", None)

    def load_weights_lite(checkpoint_path, device, cache_dir=None, **kwargs):
        set_meta_weights()
        logger.info("neuron-w8 on Neuron: VLLM_NEURON_CPU_COMPILE: the experts get meta buffers of the kernel "
                    "layout (no weights read); the graph is compiled for them")
        return lite(checkpoint_path, device, cache_dir, **kwargs) if lite is not None else None

    model.load_weights_lite = load_weights_lite
