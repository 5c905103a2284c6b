"""Whether a checkpoint's routed experts are something ``neuron-w8`` can serve, as a list of problems.

:func:`unsupported_settings` reads the ``quantization_config``; :func:`validate_experts` walks every
routed-expert tensor of a :class:`vllm_moe_w8.codec.checkpoint.Checkpoint` (headers only): layout, dtype,
its scale and the scale grid's shape. Every problem names the file and tensor. ``inspect`` and
``convert`` report them; nothing here raises. Imports neither vLLM nor torch.
"""

from __future__ import annotations

from vllm_moe_w8.codec.checkpoint import SCALE_DTYPES, Checkpoint, grid_shape
from vllm_moe_w8.codec.model_config import SUPPORTED_ARCHITECTURES, quant_format, quantization_config


def unsupported_settings(config: dict) -> list[str]:
    """quantization_config settings neuron-w8 cannot serve (the plugin refuses them at start-up too)."""
    qc = quantization_config(config) or {}
    q = quant_format(config)
    where = "config.json quantization_config"
    out = []
    if q.kind == "unknown":
        out.append(f"{where}: quant_method {qc.get('quant_method')!r} ({q.method}) is not one neuron-w8 serves; "
                   "it serves block FP8 (quant_method 'fp8' with weight_block_size), compressed-tensors per-channel FP8, "
                   "or a `vllm-moe-w8 convert` output")
    if q.kind == "block" and q.method == "fp8":
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            out.append(f"{where}: activation_scheme {scheme!r}: neuron-w8 supports 'dynamic' activations only "
                       "(weights FP8, activations stay in the model dtype)")
        if qc.get("fmt", "e4m3") != "e4m3":
            out.append(f"{where}: fmt {qc.get('fmt')!r}: neuron-w8 supports 'e4m3' (OCP E4M3FN) weights")
    if q.kind == "per-channel":
        for group in (qc.get("config_groups") or {}).values():
            act = (group or {}).get("input_activations") or {}
            if act and not act.get("dynamic", True):
                out.append(f"{where}: compressed-tensors input_activations are static (dynamic: false); neuron-w8 "
                           "supports dynamic or absent input activations only")
    return out


def validate_experts(ckpt: Checkpoint) -> list[str]:
    """Problems with the routed-expert tensors, each naming the file and tensor."""
    problems: list[str] = [f"{ckpt.path / 'config.json'}: {p.split(': ', 1)[1]}" if p.startswith("config.json") else p
                           for p in unsupported_settings(ckpt.config)]
    q = ckpt.quant
    arch = ckpt.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        problems.append(
            f"{ckpt.path / 'config.json'}: architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    prefixes = SUPPORTED_ARCHITECTURES.get(arch, ())
    n_experts = 0
    for en, info in ckpt.experts():
        if en.suffix != "weight":
            continue
        n_experts += 1
        where = f"{ckpt.path / info.file}: tensor '{en.name}'"
        if prefixes and not en.prefix.startswith(prefixes):
            problems.append(f"{where}: name does not match {arch}'s layout (expected a prefix among {list(prefixes)})")
        if len(info.shape) != 2:
            problems.append(f"{where}: expert weight must be 2-D [out, in], has shape {list(info.shape)}")
            continue
        expected_dtype = "U8" if q.kind == "neuron-w8" else "F8_E4M3"
        if q.kind in ("block", "per-channel", "neuron-w8") and info.dtype != expected_dtype:
            if _skipped(en.name, q.skip) or info.dtype in ("BF16", "F16", "F32"):
                continue  # unquantised expert (listed as skipped): nothing to check
            problems.append(f"{where}: dtype {info.dtype}, expected {expected_dtype} for a {q.kind} checkpoint")
            continue
        if not info.is_fp8 and info.dtype != "U8":
            continue
        scale = ckpt.scale_for(en)
        if scale is None:
            problems.append(
                f"{where}: FP8 weight without its scale ('{en.stem}.{q.scale_suffix or 'weight_scale_inv'}' is not in the checkpoint); "
                "re-download the shard holding it or fix the index"
            )
            continue
        swhere = f"{ckpt.path / scale.file}: tensor '{scale.name}'"
        if scale.dtype not in SCALE_DTYPES:
            problems.append(f"{swhere}: scale dtype {scale.dtype}; expected F32, BF16 or F16")
        if q.block is None:
            continue
        expected = grid_shape(info.shape, q.block)
        got = tuple(scale.shape)
        ok = got == expected or (q.block[1] == 0 and got == (expected[0],))
        if not ok:
            tile = "per-channel [out, 1]" if q.block == (1, 0) else f"{q.block[0]}x{q.block[1]} tiles"
            problems.append(
                f"{swhere}: scale grid {list(got)} does not fit weight {list(info.shape)} with {tile}: expected {list(expected)} "
                "(check quantization_config.weight_block_size)"
            )
    if q.kind in ("block", "per-channel", "neuron-w8") and n_experts == 0:
        problems.append(f"{ckpt.path}: no routed-expert tensors ('...mlp.experts.{{e}}.{{gate,up,down}}_proj.weight') found")
    return problems


def _skipped(name: str, skip: list[str]) -> bool:
    return any(s and (s in name) for s in skip)
