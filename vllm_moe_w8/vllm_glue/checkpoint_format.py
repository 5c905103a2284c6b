"""What a checkpoint's ``quantization_config`` says, as far as the ``neuron-w8`` method cares.

:func:`parse_checkpoint_format` classifies the three formats the method serves (native block FP8,
compressed-tensors per-channel FP8, checkpoints converted by ``vllm-moe-w8 convert``) into a frozen
:class:`CheckpointFormat` and refuses anything else with :class:`UnsupportedCheckpoint`, naming what was
found and what is supported. :func:`check_architecture` does the same for the model's architecture, and
:func:`validate_local_checkpoint` reads a local checkpoint's shard headers to fail fast, naming the file
and tensor, before vLLM loads anything. Used by the config (``quant_config``) and read by the methods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

from vllm_moe_w8.about import QUANTIZATION_NAME
from vllm_moe_w8.codec import fp8
from vllm_moe_w8.codec.model_config import SUPPORTED_ARCHITECTURES as MODEL_ARCHITECTURES

logger = init_logger("vllm.neuron_w8")

SUPPORTED_ARCHITECTURES = tuple(MODEL_ARCHITECTURES)  # one list: the codec's, with each architecture's expert prefixes
SUPPORTED_BLOCK = [128, 128]
SUPPORTED_FORMATS_TEXT = (
    "block FP8 (quant_method 'fp8', weight_block_size [128, 128], activation_scheme 'dynamic'), "
    "compressed-tensors per-channel FP8 (weights type 'float', num_bits 8, strategy 'channel'; dynamic "
    "or no input activations), or a checkpoint converted by `vllm-moe-w8 convert` (quant_method 'neuron-w8')"
)


class UnsupportedCheckpoint(ValueError):
    """The checkpoint's quantization_config is not one neuron-w8 can serve."""


@dataclass(frozen=True)
class CheckpointFormat:
    """What the checkpoint stores, as far as the plugin cares.

    ``kind``: 'block' (native block FP8), 'channel' (compressed-tensors per-channel) or 'converted'.
    ``linear_block``: tile of the non-expert linear scales ((128, 128) or per-channel (1, 0)).
    ``linear_scale_suffix``: the non-expert scale tensor's name ('weight_scale_inv' / 'weight_scale').
    ``expert_block`` / ``expert_scale_suffix``: the same for routed experts.
    ``mode`` / ``code_format``: for converted checkpoints, the stored repack (codes already final).
    """

    kind: str
    linear_block: tuple[int, int]
    linear_scale_suffix: str
    expert_block: tuple[int, int]
    expert_scale_suffix: str
    ignored: tuple[str, ...] = ()
    mode: str | None = None
    code_format: str = "e4m3fn"
    checkpoint_mode: str | None = None  # a 'mode' key the user put in an fp8 checkpoint's config
    raw: dict = field(default_factory=dict, compare=False)

    @property
    def converted(self) -> bool:
        return self.kind == "converted"


def _ignored_list(cfg: dict) -> list[str]:
    out: list[str] = []
    for key in ("modules_to_not_convert", "ignored_layers", "ignore"):
        value = cfg.get(key) or []
        if isinstance(value, str):
            value = [value]
        out.extend(str(v) for v in value)
    return out


def _parse_block_fp8(cfg: dict) -> CheckpointFormat:
    block = cfg.get("weight_block_size")
    scheme = cfg.get("activation_scheme", "dynamic")
    if block is None:
        raise UnsupportedCheckpoint(
            "quantization_config has quant_method 'fp8' without weight_block_size (per-tensor FP8); "
            f"neuron-w8 supports {SUPPORTED_FORMATS_TEXT}"
        )
    if list(block) != SUPPORTED_BLOCK:
        raise UnsupportedCheckpoint(
            f"quantization_config weight_block_size is {list(block)}; neuron-w8 supports block FP8 with "
            f"weight_block_size {SUPPORTED_BLOCK} only (all Qwen/GLM FP8 checkpoints use it)"
        )
    if scheme != "dynamic":
        raise UnsupportedCheckpoint(
            f"quantization_config activation_scheme is {scheme!r}; neuron-w8 supports 'dynamic' activations only "
            "(weights are FP8, activations stay in the model dtype)"
        )
    fmt = cfg.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise UnsupportedCheckpoint(f"quantization_config fmt is {fmt!r}; neuron-w8 supports 'e4m3' (OCP E4M3FN) weights")
    mode = cfg.get("mode")
    if mode is not None and mode not in fp8.MODES:
        raise UnsupportedCheckpoint(f"quantization_config mode is {mode!r}; choose one of {', '.join(fp8.MODES)}")
    return CheckpointFormat(
        kind="block", linear_block=(128, 128), linear_scale_suffix="weight_scale_inv",
        expert_block=(128, 128), expert_scale_suffix="weight_scale_inv",
        ignored=tuple(_ignored_list(cfg)), checkpoint_mode=mode, raw=dict(cfg),
    )


def _parse_compressed_tensors(cfg: dict) -> CheckpointFormat:
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise UnsupportedCheckpoint(f"compressed-tensors quantization_config has no config_groups; neuron-w8 supports {SUPPORTED_FORMATS_TEXT}")
    for name, group in groups.items():
        w = group.get("weights") or {}
        a = group.get("input_activations")
        found = f"config_groups[{name!r}].weights = {{type: {w.get('type')!r}, num_bits: {w.get('num_bits')!r}, strategy: {w.get('strategy')!r}}}"
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise UnsupportedCheckpoint(f"compressed-tensors {found} is not FP8; neuron-w8 supports {SUPPORTED_FORMATS_TEXT}")
        if w.get("strategy") != "channel":
            raise UnsupportedCheckpoint(
                f"compressed-tensors {found}: neuron-w8 supports the per-channel strategy ('channel', weight_scale [out, 1]) "
                f"for compressed-tensors; other formats supported: {SUPPORTED_FORMATS_TEXT}"
            )
        if w.get("dynamic"):
            raise UnsupportedCheckpoint(f"compressed-tensors {found} has dynamic weights; neuron-w8 needs stored FP8 weights")
        if a is not None and not a.get("dynamic", False):
            raise UnsupportedCheckpoint(
                f"compressed-tensors config_groups[{name!r}].input_activations is static (strategy {a.get('strategy')!r}); "
                "neuron-w8 supports dynamic or absent input activations only"
            )
    return CheckpointFormat(
        kind="channel", linear_block=(1, 0), linear_scale_suffix="weight_scale",
        expert_block=(1, 0), expert_scale_suffix="weight_scale",
        ignored=tuple(_ignored_list(cfg)), raw=dict(cfg),
    )


def _parse_converted(cfg: dict) -> CheckpointFormat:
    mode = cfg.get("mode")
    if mode not in fp8.MODES:
        raise UnsupportedCheckpoint(f"neuron-w8 quantization_config mode is {mode!r}; expected one of {', '.join(fp8.MODES)} (re-run `vllm-moe-w8 convert`)")
    code_format = cfg.get("code_format", fp8.CODE_FORMAT[mode])
    if code_format != fp8.CODE_FORMAT[mode]:
        raise UnsupportedCheckpoint(f"neuron-w8 quantization_config code_format {code_format!r} does not match mode {mode!r} (expected {fp8.CODE_FORMAT[mode]!r})")
    source = cfg.get("source") or {}
    if not isinstance(source, dict):
        raise UnsupportedCheckpoint("neuron-w8 quantization_config 'source' must be the original quantization_config (a dict)")
    src = parse_checkpoint_format(source) if source else None
    if src is not None and src.converted:
        raise UnsupportedCheckpoint("neuron-w8 quantization_config 'source' is itself a neuron-w8 config; it must be the original FP8 config")
    if src is None:
        block = cfg.get("weight_block_size") or SUPPORTED_BLOCK
        if list(block) != SUPPORTED_BLOCK:
            raise UnsupportedCheckpoint(f"neuron-w8 quantization_config weight_block_size {list(block)}; expected {SUPPORTED_BLOCK}")
        src = CheckpointFormat("block", (128, 128), "weight_scale_inv", (128, 128), "weight_scale_inv")
    expert_block = (fp8.OUTPUT_BLOCK_ROWS, 0) if mode == "output-block" else src.expert_block
    if cfg.get("expert_block_size") is not None:  # the converter's tile (refined when converted for a ragged TP)
        eb = cfg["expert_block_size"]
        if not (isinstance(eb, (list, tuple)) and len(eb) == 2 and int(eb[0]) >= 1 and int(eb[1]) >= 0):
            raise UnsupportedCheckpoint(f"neuron-w8 quantization_config expert_block_size {eb!r}; expected [rows >= 1, cols >= 0]")
        eb = (int(eb[0]), int(eb[1]))
        if mode == "output-block" and eb[1] != 0:
            raise UnsupportedCheckpoint(f"neuron-w8 quantization_config expert_block_size {list(eb)} with mode output-block; expected [rows, 0]")
        expert_block = eb
    if cfg.get("expert_block_size"):  # written by `convert` (refined tile when converted for a ragged TP split)
        expert_block = tuple(int(b) for b in cfg["expert_block_size"])
    return CheckpointFormat(
        kind="converted", linear_block=src.linear_block, linear_scale_suffix=src.linear_scale_suffix,
        expert_block=expert_block, expert_scale_suffix="weight_scale_inv",
        ignored=tuple(_ignored_list(cfg)) + src.ignored, mode=mode, code_format=code_format, raw=dict(cfg),
    )


def parse_checkpoint_format(cfg: dict | None) -> CheckpointFormat:
    """Classify a checkpoint's ``quantization_config``; :class:`UnsupportedCheckpoint` if neuron-w8 cannot serve it."""
    if not cfg:
        raise UnsupportedCheckpoint(
            "the model has no quantization_config (an unquantised checkpoint); neuron-w8 serves FP8 checkpoints: "
            f"{SUPPORTED_FORMATS_TEXT}. Serve a BF16 model without --quantization"
        )
    method = str(cfg.get("quant_method", "")).lower()
    if method == "fp8":
        return _parse_block_fp8(cfg)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    if method == QUANTIZATION_NAME:
        return _parse_converted(cfg)
    raise UnsupportedCheckpoint(f"quantization_config has quant_method {cfg.get('quant_method')!r}; neuron-w8 supports {SUPPORTED_FORMATS_TEXT}")


def check_architecture(hf_config: Any) -> None:
    """Raise :class:`UnsupportedCheckpoint` unless the model's architecture is one the plugin serves."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedCheckpoint(
            f"architecture {archs} is not supported by neuron-w8; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def validate_local_checkpoint(model: Any, fmt: CheckpointFormat) -> None:
    """Header-only check of a local checkpoint folder: fail fast, naming shard file and tensor.

    Catches what vLLM's own loader reports without the file name (truncated or garbled shards) or does
    not report at all (a tensor the index lists but its shard lacks, an expert weight without its scale:
    the parameter would keep its initial zeros / ones). Reads the index and each shard's JSON header
    (:class:`vllm_moe_w8.codec.checkpoint.Checkpoint`), never tensor data. A hub id, or a folder without
    safetensors files, is left to vLLM (the MoE method's loader-side check still covers its experts).
    """
    from vllm_moe_w8.codec import checkpoint as ck

    path = Path(str(model)).expanduser() if model else None
    if path is None or not path.is_dir() or not (
        (path / ck.INDEX_NAME).is_file() or any(path.glob("*.safetensors"))
    ):
        return
    t0 = time.perf_counter()
    try:
        ckpt = ck.Checkpoint(path)
    except ck.CheckpointError as exc:
        raise ck.CheckpointError(f"neuron-w8: checkpoint {path} cannot be read: {exc}") from exc
    problems = list(ckpt.problems)
    for en, info in ckpt.experts():
        listed = any(f"{en.stem}.{suffix}" in ckpt.weight_map for suffix in ("weight_scale_inv", "weight_scale"))
        if en.suffix == "weight" and info.dtype in ("F8_E4M3", "U8") and not listed:  # listed but absent: in .problems
            problems.append(
                f"{path / info.file}: tensor '{en.name}' has no scale: '{en.stem}.{fmt.expert_scale_suffix}' is not in "
                f"the checkpoint (its index {ck.INDEX_NAME} does not list it)"
            )
    if problems:
        shown = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        raise ck.CheckpointError(
            f"neuron-w8: checkpoint {path} is incomplete or corrupt (nothing was loaded): {shown} -- re-download the "
            "named file(s), or re-export / re-convert the checkpoint"
        )
    logger.debug("neuron-w8: checked %d shard headers (%d tensors) of %s in %.3f s",
                 len(ckpt.shard_files), len(ckpt.tensors), path, time.perf_counter() - t0)
