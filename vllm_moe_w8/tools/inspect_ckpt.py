"""``vllm-moe-w8 inspect``: what a checkpoint is, and whether the plugin can serve it.

Reads config.json and every shard's header (nothing else) for the report: architecture, FP8 format,
experts, top-k, shapes, scale dtypes, which tensors are FP8 and which are kept unquantised. Validation
(missing/truncated shards, a scale missing or on the wrong grid, an unknown architecture) makes the
report carry ``errors``, each naming the file and tensor; the command then exits 1.

``--scan`` reads the routed-expert weights too (one tensor at a time): per layer, how many scale
tiles hold E4M3FN-only codes 0x78..0x7E (the tiles pow2 will halve), a histogram of those codes,
and any NaN code (0x7F/0xFF), which is an error.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

from vllm_moe_w8.codec.checkpoint import Checkpoint, CheckpointError
from vllm_moe_w8.codec.checkpoint_checks import validate_experts
from vllm_moe_w8.codec.model_config import SUPPORTED_ARCHITECTURES

FN_ONLY_CODES = tuple(range(0x78, 0x7F))  # magnitudes finite only in e4m3fn (256..448)
NAN_MAG = 0x7F


def _pattern(name: str) -> str:
    """A tensor name with its numbers replaced, to summarise ~64k names in a few lines."""
    return re.sub(r"\.\d+\.", ".{n}.", re.sub(r"\.\d+\.", ".{n}.", name))


def _category(name: str) -> str:
    if ".mlp.experts." in name and re.search(r"\.experts\.\d+\.", name):
        return "routed experts"
    if name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", "shared_expert_gate.weight")):
        return "routers"
    if name.startswith(("model.visual.", "visual.", "model.vision")):
        return "vision"
    if "shared_expert" in name:
        return "shared experts"
    if "attn" in name or "attention" in name:
        return "attention"
    if ".mlp." in name:
        return "dense MLP"
    return "other"


def inspect_checkpoint(path, scan: bool = False, progress: bool = True) -> dict[str, Any]:
    errors: list[str] = []
    try:
        ckpt = Checkpoint(path)
    except CheckpointError as e:
        return {"path": str(path), "errors": [str(e)], "warnings": []}
    errors += ckpt.problems
    errors += validate_experts(ckpt)
    cfg = ckpt.text_config
    q = ckpt.quant
    report: dict[str, Any] = {
        "path": str(ckpt.path),
        "architecture": ckpt.architecture,
        "supported": ckpt.architecture in SUPPORTED_ARCHITECTURES,
        "format": q.kind,
        "format_description": q.describe(),
        "quant_method": q.method,
        "weight_block_size": list(q.block) if q.block else None,
        "skip_list": q.skip,  # modules_to_not_convert / ignored_layers / ignore, as the checkpoint spells it
        "shards": len(ckpt.shard_files),
        "tensors": len(ckpt.tensors),
        "total_bytes": ckpt.total_bytes(),
        "hidden_size": cfg.get("hidden_size"),
        "moe_intermediate_size": cfg.get("moe_intermediate_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "num_experts": cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts"),
        "top_k": cfg.get("num_experts_per_tok"),
        "warnings": [],
    }
    # Experts found in the tensors
    layers: dict[str, set[int]] = defaultdict(set)
    shapes: Counter = Counter()
    scale_dtypes: Counter = Counter()
    weight_dtypes: Counter = Counter()
    for en, info in ckpt.experts():
        if en.suffix == "weight":
            layers[en.layer_key].add(en.expert)
            shapes[f"{en.proj} {list(info.shape)}"] += 1
            weight_dtypes[info.dtype] += 1
            scale = ckpt.scale_for(en)
            if scale is not None:
                scale_dtypes[f"{scale.name.rsplit('.', 1)[1]} {scale.dtype} {list(scale.shape)}"] += 1
    report["expert_layers"] = len(layers)
    report["experts_per_layer"] = sorted({len(v) for v in layers.values()})
    report["expert_weight_shapes"] = dict(shapes)
    report["expert_weight_dtypes"] = dict(weight_dtypes)
    report["expert_scales"] = dict(scale_dtypes)
    n_cfg = report["num_experts"]
    for key, experts in layers.items():
        if n_cfg and len(experts) != int(n_cfg):
            errors.append(f"{ckpt.path}: layer '{key}' has {len(experts)} experts' weights, config says {n_cfg} (missing tensors?)")
        for e in sorted(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if f"{key}.mlp.experts.{e}.{proj}.weight" not in ckpt.tensors:
                    errors.append(f"{ckpt.path}: tensor '{key}.mlp.experts.{e}.{proj}.weight' is missing")

    # FP8 vs kept tensors, summarised by name pattern
    fp8: Counter = Counter()
    kept: Counter = Counter()
    by_cat: dict[str, Counter] = defaultdict(Counter)
    for name, info in ckpt.tensors.items():
        if name.endswith(("_scale_inv", "_scale", "input_scale")):
            continue
        cat = _category(name)
        if info.is_fp8 or (q.kind == "neuron-w8" and info.dtype == "U8"):
            fp8[_pattern(name)] += 1
            by_cat[cat]["fp8"] += 1
        elif len(info.shape) == 2:
            kept[f"{_pattern(name)} ({info.dtype})"] += 1
            by_cat[cat]["kept"] += 1
    report["fp8_tensors"] = sum(fp8.values())
    report["fp8_patterns"] = dict(sorted(fp8.items()))
    report["kept_2d_patterns"] = dict(sorted(kept.items()))
    report["by_category"] = {k: dict(v) for k, v in sorted(by_cat.items())}

    if scan and not errors:
        try:
            report["scan"] = scan_experts(ckpt, progress=progress)
            errors += report["scan"].pop("errors")
        except CheckpointError as e:
            errors.append(str(e))
    elif scan:
        report["warnings"].append("--scan skipped: fix the errors above first")
    report["errors"] = errors
    return report


def scan_experts(ckpt: Checkpoint, progress: bool = True) -> dict[str, Any]:
    """Read every FP8 routed-expert weight: per-layer tiles pow2 shifts, e4m3fn-only code counts, NaNs."""
    import torch
    from safetensors import safe_open
    from tqdm.auto import tqdm

    q = ckpt.quant
    block = q.block or (128, 128)
    bn, bk = block
    items = [(en, info) for en, info in ckpt.experts() if en.suffix == "weight" and info.is_fp8]
    per_layer: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    by_file: dict[str, list] = defaultdict(list)
    for en, info in items:
        by_file[info.file].append((en, info))
    bar = tqdm(total=sum(i.nbytes for _, i in items), unit="B", unit_scale=True, desc="scan experts", disable=not progress)
    for fname, group in by_file.items():
        with safe_open(str(ckpt.path / fname), framework="pt") as f:
            for en, info in group:
                codes = f.get_tensor(en.name).view(torch.uint8)
                scale_info = ckpt.scale_for(en)
                if scale_info is not None:
                    sc = (f.get_tensor(scale_info.name) if scale_info.file == fname else ckpt.load(scale_info.name)).float()
                    bad = ~torch.isfinite(sc) | (sc <= 0)
                    if bool(bad.any()):
                        idx = tuple(int(i) for i in bad.nonzero()[0])
                        errors.append(
                            f"{ckpt.path / scale_info.file}: tensor '{scale_info.name}' has {int(bad.sum())} non-finite or "
                            f"non-positive scale(s), first at {idx} = {float(sc[idx])}; a dequantisation scale must be a finite "
                            "positive number: re-export or re-download the checkpoint"
                        )
                mag = codes & 0x7F
                layer = per_layer.setdefault(en.layer_key, {"tiles": 0, "tiles_shifted": 0, "fn_only_codes": Counter(), "nan_codes": 0, "values": 0})
                hist = torch.bincount(mag.flatten().long(), minlength=128)
                for c in FN_ONLY_CODES:
                    if int(hist[c]):
                        layer["fn_only_codes"][f"0x{c:02X}"] += int(hist[c])
                nan = int(hist[NAN_MAG])
                if nan:
                    idx = tuple(int(i) for i in (mag == NAN_MAG).nonzero()[0])
                    errors.append(f"{ckpt.path / fname}: tensor '{en.name}' holds {nan} NaN code(s) (0x7F/0xFF), first at {idx}; re-export the checkpoint")
                layer["nan_codes"] += nan
                layer["values"] += codes.numel()
                n, k = codes.shape
                tn = bn
                tk = bk if bk else k
                gn, gk = -(-n // tn), -(-k // tk)
                padded = torch.nn.functional.pad(mag, (0, gk * tk - k, 0, gn * tn - n))
                tile_max = padded.reshape(gn, tn, gk, tk).amax(dim=(1, 3))
                layer["tiles"] += gn * gk
                layer["tiles_shifted"] += int((tile_max >= 0x78).sum())
                bar.update(info.nbytes)
    bar.close()
    out_layers = {}
    for key in sorted(per_layer, key=lambda s: (re.sub(r"\d+$", "", s), int(re.search(r"(\d+)$", s).group(1)))):
        v = per_layer[key]
        out_layers[key] = {**v, "fn_only_codes": dict(sorted(v["fn_only_codes"].items())),
                           "shifted_share": v["tiles_shifted"] / v["tiles"] if v["tiles"] else 0.0}
    total_tiles = sum(v["tiles"] for v in per_layer.values())
    shifted = sum(v["tiles_shifted"] for v in per_layer.values())
    return {"layers": out_layers, "tiles": total_tiles, "tiles_shifted": shifted,
            "nan_codes": sum(v["nan_codes"] for v in per_layer.values()), "errors": errors}


def format_report(r: dict[str, Any]) -> str:
    if "architecture" not in r:
        return "\n".join(f"ERROR: {e}" for e in r["errors"])
    lines = [
        f"{r['path']}",
        f"  architecture: {r['architecture']} ({'supported' if r['supported'] else 'NOT supported'})",
        f"  format: {r['format_description']}",
        f"  {r['shards']} shard(s), {r['tensors']} tensors, {r['total_bytes'] / 1e9:.3f} GB",
        f"  hidden {r['hidden_size']}, moe_intermediate {r['moe_intermediate_size']}, layers {r['num_hidden_layers']}, "
        f"experts {r['num_experts']}, top-k {r['top_k']}",
        f"  routed-expert layers found: {r['expert_layers']} (experts per layer: {r['experts_per_layer']})",
        "  expert weights: " + ", ".join(f"{k} x{v}" for k, v in r["expert_weight_shapes"].items()),
        "  expert weight dtypes: " + ", ".join(f"{k} x{v}" for k, v in r["expert_weight_dtypes"].items()),
        "  expert scales: " + (", ".join(f"{k} x{v}" for k, v in r["expert_scales"].items()) or "none"),
        f"  FP8 tensors: {r['fp8_tensors']}; by category: "
        + ", ".join(f"{c} {v.get('fp8', 0)} FP8 / {v.get('kept', 0)} kept" for c, v in r["by_category"].items()),
        f"  skip list in quantization_config: {r['skip_list'] or 'none'}",
        "  kept unquantised (2-D):",
    ]
    lines += [f"    {p} x{n}" for p, n in list(r["kept_2d_patterns"].items())[:30]]
    if "scan" in r:
        s = r["scan"]
        share = s["tiles_shifted"] / s["tiles"] if s["tiles"] else 0
        lines.append(f"  scan: {s['tiles_shifted']}/{s['tiles']} scale tiles hold e4m3fn-only codes ({share:.1%} will be halved by pow2); NaN codes: {s['nan_codes']}")
        for key, v in s["layers"].items():
            hist = " ".join(f"{c}:{n}" for c, n in v["fn_only_codes"].items())
            lines.append(f"    {key}: {v['tiles_shifted']}/{v['tiles']} tiles shifted; {hist}" + (f"; NaN {v['nan_codes']}" if v["nan_codes"] else ""))
    for w in r["warnings"]:
        lines.append(f"WARNING: {w}")
    for e in r["errors"]:
        lines.append(f"ERROR: {e}")
    lines.append("OK" if not r["errors"] else f"{len(r['errors'])} problem(s)")
    return "\n".join(lines)
