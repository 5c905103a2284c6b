"""``vllm-moe-w8 convert``: write a pre-converted neuron-w8 checkpoint, so start-up does no repack.

Format (DEVELOPING.md, "Converted checkpoints"): every FP8 routed-expert weight keeps its name and
holds uint8 codes already in the mode's code format; its scale is written as float32
``...weight_scale_inv`` on the mode's grid; every other tensor and file is copied as it was;
``config.json`` gets a ``neuron-w8`` quantization_config that keeps the original under ``source``.
The codes and scales are exactly :func:`vllm_moe_w8.codec.fp8.repack`'s output (never a second codec).

Robustness:
* streams shard by shard: memory holds one shard (plus the odd scale/weight pair split across two);
* atomic: everything is written into ``OUT.partial-<key>`` (key = source fingerprint + settings) and
  renamed to OUT at the end; each shard is written as ``*.tmp`` and renamed when complete, and listed
  in ``.progress.json``, so an interrupted run leaves no half-written OUT, and running the same
  command again resumes (finished shards are kept, the rest redone);
* an existing OUT converted from the same source with the same settings is left alone; any other OUT
  is refused unless ``force``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from vllm_moe_w8.about import __version__
from vllm_moe_w8.codec.checkpoint import (
    INDEX_NAME,
    Checkpoint,
    CheckpointError,
    parse_expert_name,
)
from vllm_moe_w8.codec.checkpoint_checks import validate_experts
from vllm_moe_w8.codec.model_config import quantization_config

MANIFEST = "neuron_w8_convert.json"
PROGRESS = ".progress.json"
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
OUT_SCALE_SUFFIX = "weight_scale_inv"


def _fail(message: str, **extra) -> dict[str, Any]:
    return {"ok": False, "errors": [message], "message": message, **extra}


def conversion_key(fingerprint: dict, mode: str, tp: int, ep: bool) -> str:
    blob = json.dumps({"src": fingerprint["sha256"], "mode": mode, "tp": tp, "ep": ep, "v": __version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def neuron_w8_quant_config(source_qc: dict, mode: str, expert_block: tuple[int, int], tp: int, ep: bool) -> dict:
    """The quantization_config a converted checkpoint carries (see DEVELOPING.md)."""
    from vllm_moe_w8.codec.fp8 import CODE_FORMAT

    src_block = source_qc.get("weight_block_size")
    qc = {
        "quant_method": "neuron-w8",
        "mode": mode,
        "code_format": CODE_FORMAT[mode],
        # the source's tile for everything still in the source format (non-expert FP8 linears)
        "weight_block_size": list(src_block) if src_block else None,
        # the tile of every converted expert's weight_scale_inv grid ([1, 0]: per row; [128, 0]: per 128 rows)
        "expert_block_size": list(expert_block),
        "expert_scale_dtype": "float32",
        "converted_for": {"tp": tp, "ep": ep},
        "source": source_qc,
        "converted_by": f"vllm-moe-w8 {__version__}",
    }
    skip = source_qc.get("modules_to_not_convert") or source_qc.get("ignored_layers") or source_qc.get("ignore")
    if skip is not None:
        qc["modules_to_not_convert"] = list(skip)
    return qc


def _write_config(src_cfg: dict, qc: dict) -> dict:
    cfg = json.loads(json.dumps(src_cfg))
    cfg["quantization_config"] = qc
    tc = cfg.get("text_config")
    if isinstance(tc, dict) and "quantization_config" in tc:
        tc["quantization_config"] = qc
    return cfg


def refined_block(block: tuple[int, int], inter: int, tp: int, ep: bool) -> tuple[int, int]:
    """The scale tile the plugin uses on a rank (the rule of ``vllm_glue.expert_loading.rank_block``, DEVELOPING.md):
    under TP without EP, a tile dimension that I/tp does not divide is refined to gcd(I/tp, tile)."""
    if ep or tp <= 1:
        return block
    size = inter // tp
    bn, bk = block
    if bn > 1 and size % bn:
        bn = math.gcd(size, bn)
    if bk > 0 and size % bk:
        bk = math.gcd(size, bk)
    return bn, bk


def regrid(scale, shape: tuple[int, int], src: tuple[int, int], dst: tuple[int, int]):
    """A scale grid over ``src`` tiles as a grid over the finer ``dst`` tiles (each carries its parent's scale)."""
    if src == dst:
        return scale
    grid = scale if scale.dim() == 2 else scale.unsqueeze(1)
    if src[0] != dst[0]:
        grid = grid.repeat_interleave(src[0] // dst[0], dim=0)[: math.ceil(shape[0] / dst[0])]
    if src[1] and src[1] != dst[1]:
        grid = grid.repeat_interleave(src[1] // dst[1], dim=1)[:, : math.ceil(shape[1] / dst[1])]
    return grid.contiguous()


class _ShardConverter:
    """Converts the tensors of one shard; expert weight/scale pairs may live in different shards."""

    def __init__(self, ckpt: Checkpoint, mode: str, tile: tuple[int, int]):
        self.ckpt = ckpt
        self.mode = mode
        self.fp8_block = tuple(ckpt.quant.block) if ckpt.quant.block else (128, 128)
        self.tile = tile  # pow2/lut: the tile the plugin would repack per rank (refined under ragged TP)
        self.expert_blocks: set[tuple[int, int]] = set()
        self.stats = None
        self.repacked_weights = 0

    def _pair(self, stem: str, f, cache: dict):
        """(weight, scale) names of an FP8 expert projection, or None if it is not one."""
        w = self.ckpt.tensors.get(f"{stem}.weight")
        if w is None or not w.is_fp8:
            return None
        for suffix in SCALE_SUFFIXES:
            if f"{stem}.{suffix}" in self.ckpt.tensors:
                return f"{stem}.weight", f"{stem}.{suffix}"
        raise CheckpointError(f"{self.ckpt.path / w.file}: tensor '{stem}.weight' has no weight_scale_inv/weight_scale")

    def _repack(self, stem: str, f, fname: str, cache: dict):
        from vllm_moe_w8.codec import fp8

        if stem in cache:
            return cache[stem]
        wname, sname = self._pair(stem, f, cache)
        tensors = {}
        for n in (wname, sname):
            tensors[n] = f.get_tensor(n) if self.ckpt.tensors[n].file == fname else self.ckpt.load(n)
        weight, scale = tensors[wname], tensors[sname]
        try:
            if self.ckpt.quant.kind != "block":
                block = "channel"
            elif self.mode != "output-block" and self.tile != self.fp8_block:
                fp8.repack(weight, scale, mode="lut", block=self.fp8_block, name=wname)  # validates the source grid
                shape = (weight.shape[0], weight.shape[1])
                scale, block = regrid(scale, shape, self.fp8_block, self.tile), self.tile
            else:
                block = self.fp8_block
            rep = fp8.repack(weight, scale, mode=self.mode, block=block, name=wname)
        except ValueError as e:  # name the shard too: the codec only knows the tensor
            raise CheckpointError(f"{self.ckpt.path / self.ckpt.tensors[wname].file}: {e}") from e
        cache[stem] = rep
        return rep

    def convert(self, fname: str) -> tuple[dict[str, Any], dict[str, str]]:
        """Tensors of the output shard ``fname`` and a map output name -> source name."""
        import torch
        from safetensors import safe_open

        out: dict[str, Any] = {}
        names: dict[str, str] = {}
        cache: dict[str, Any] = {}
        with safe_open(str(self.ckpt.path / fname), framework="pt") as f:
            for info in self.ckpt.tensors_in(fname):
                en = parse_expert_name(info.name)
                pair = self._pair(en.stem, f, cache) if en is not None and en.suffix in ("weight",) + SCALE_SUFFIXES else None
                if pair is None:
                    out[info.name] = f.get_tensor(info.name)
                    names[info.name] = info.name
                    continue
                rep = self._repack(en.stem, f, fname, cache)
                self.expert_blocks.add(tuple(rep.block))
                if en.suffix == "weight":
                    out[info.name] = rep.codes.contiguous()
                    names[info.name] = info.name
                    self.repacked_weights += 1
                    self.stats = rep.stats if self.stats is None else self.stats.add(rep.stats)
                else:
                    new = f"{en.stem}.{OUT_SCALE_SUFFIX}"
                    out[new] = rep.scale_grid.to(torch.float32).contiguous()
                    names[new] = info.name
        return out, names


def _copy_other_files(src: Path, dst: Path, shard_files: set[str]) -> list[str]:
    copied = []
    for entry in sorted(src.iterdir()):
        if entry.name in shard_files or entry.name in (INDEX_NAME, "config.json", MANIFEST) or entry.name.endswith(".safetensors"):
            continue
        if entry.name.startswith(".") or ".partial-" in entry.name:
            continue
        target = dst / entry.name
        if entry.is_dir():
            shutil.copytree(entry, target, dirs_exist_ok=True)
        else:
            shutil.copy2(entry, target)
        copied.append(entry.name)
    return copied


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def convert_checkpoint(src, out, mode: str = "pow2", tp: int = 1, ep: bool = False, force: bool = False,
                       progress: bool = True) -> dict[str, Any]:
    """Convert ``src`` into ``out``; returns a summary dict (``ok``, ``errors``, ``message``, stats)."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from vllm_moe_w8.codec.fp8 import MODES
    from vllm_moe_w8.tools.model_shape import PlanError, model_shape
    from vllm_moe_w8.tools.plan import tp_advice

    t0 = time.perf_counter()
    if mode not in MODES:
        return _fail(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    try:
        ckpt = Checkpoint(src)
    except CheckpointError as e:
        return _fail(str(e))
    src_path, out = ckpt.path.resolve(), Path(out)
    if out.resolve() == src_path:
        return _fail(f"{out}: OUT must differ from the source checkpoint")
    q = ckpt.quant
    if q.kind == "neuron-w8":
        return _fail(f"{src_path}: already a neuron-w8 converted checkpoint (quant_method neuron-w8); nothing to convert")
    if q.kind not in ("block", "per-channel"):
        return _fail(f"{src_path / 'config.json'}: quantization {q.describe()} is not a supported FP8 format (block FP8 or per-channel compressed-tensors)")
    problems = ckpt.problems + validate_experts(ckpt)
    if problems:
        return _fail("; ".join(problems[:5]), errors_all=problems)
    try:
        warnings, errors = tp_advice(model_shape(ckpt.config), tp, ep)
    except PlanError as e:
        return _fail(f"{src_path / 'config.json'}: {e}")
    if errors:
        return _fail("; ".join(errors))

    fingerprint = ckpt.fingerprint()
    key = conversion_key(fingerprint, mode, tp, ep)
    if out.exists():
        manifest = _read_json(out / MANIFEST)
        same = manifest is not None and manifest.get("key") == key
        if same and not force:
            return {"ok": True, "errors": [], "warnings": warnings, "out": str(out), "up_to_date": True,
                    "message": f"{out}: already converted from this checkpoint with mode {mode} (use --force to redo)"}
        if not force:
            why = "it is not a vllm-moe-w8 conversion" if manifest is None else "it was converted from another checkpoint or with other settings"
            return _fail(f"{out}: exists and {why}; choose another OUT or pass --force to replace it")

    partial = out.parent / f"{out.name}.partial-{key}"
    for stale in out.parent.glob(f"{out.name}.partial-*"):
        if stale != partial and stale.is_dir():
            shutil.rmtree(stale)  # an interrupted run with another source/settings: redo cleanly
    partial.mkdir(parents=True, exist_ok=True)
    prog_path = partial / PROGRESS
    prog = _read_json(prog_path) or {}
    if prog.get("key") != key:
        prog = {"key": key, "done": {}}
    done: dict[str, dict] = prog["done"]

    src_block = tuple(q.block) if q.block else (128, 128)
    tile = refined_block(src_block, int(ckpt.text_config["moe_intermediate_size"]), tp, ep) if q.kind == "block" else src_block
    if mode == "output-block" and tp > 1 and not ep:
        warnings.append(
            "output-block under TP without EP: the converted scales are per 128 rows of each whole tensor; converting at "
            "load time would requantise each rank's slice on its own, so the two differ (both within output-block's error). "
            "Use --ep for a bit-identical match"
        )
    conv = _ShardConverter(ckpt, mode, tile)
    weight_map: dict[str, str] = {}
    resumed = 0
    total_size = 0
    shards = ckpt.shard_files
    bar = tqdm(total=sum(ckpt.file_sizes.get(s, 0) for s in shards), unit="B", unit_scale=True,
               desc=f"convert ({mode})", disable=not progress)
    for fname in shards:
        target = partial / fname
        rec = done.get(fname)
        if rec and target.is_file() and target.stat().st_size == rec["size"]:
            weight_map.update({n: fname for n in rec["tensors"]})
            total_size += rec["data_bytes"]
            resumed += 1
            bar.update(ckpt.file_sizes[fname])
            continue
        tensors, _ = conv.convert(fname)
        tmp = partial / (fname + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, target)
        data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        done[fname] = {"size": target.stat().st_size, "tensors": sorted(tensors), "data_bytes": data_bytes}
        prog_path.write_text(json.dumps(prog))
        weight_map.update({n: fname for n in tensors})
        total_size += data_bytes
        del tensors
        bar.update(ckpt.file_sizes[fname])
    bar.close()

    if len(conv.expert_blocks) > 1:
        return _fail(f"{src_path}: expert scale grids differ between tensors ({sorted(conv.expert_blocks)}); cannot describe them with one expert_block_size")
    expert_block = next(iter(conv.expert_blocks)) if conv.expert_blocks else tuple(_expert_block_of(mode, q))
    if not conv.expert_blocks and resumed:
        expert_block = tuple(prog.get("expert_block") or expert_block)
    prog["expert_block"] = list(expert_block)
    prog_path.write_text(json.dumps(prog))

    qc = neuron_w8_quant_config(quantization_config(ckpt.config) or {}, mode, expert_block, tp, ep)
    (partial / "config.json").write_text(json.dumps(_write_config(ckpt.config, qc), indent=2) + "\n")
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (partial / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    copied = _copy_other_files(src_path, partial, set(shards))
    stats = conv.stats
    summary = {
        "ok": True,
        "errors": [],
        "warnings": warnings,
        "out": str(out),
        "source": str(src_path),
        "mode": mode,
        "code_format": qc["code_format"],
        "expert_block_size": list(expert_block),
        "tp": tp,
        "ep": ep,
        "shards": len(shards),
        "shards_resumed": resumed,
        "expert_weights_repacked": conv.repacked_weights,
        "blocks": stats.blocks if stats else 0,
        "blocks_shifted": stats.blocks_shifted if stats else 0,
        "values_changed": stats.values_changed if stats else 0,
        "max_abs_error": stats.max_abs_error if stats else 0.0,
        "files_copied": copied,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    manifest = {"key": key, "source": str(src_path), "source_fingerprint": fingerprint, "mode": mode, "tp": tp, "ep": ep,
                "converted_by": qc["converted_by"], "summary": {k: v for k, v in summary.items() if k not in ("ok", "errors")}}
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    prog_path.unlink(missing_ok=True)

    old = None
    if out.exists():  # --force: swap in the new one, then drop the old
        old = out.parent / f"{out.name}.old-{key}"
        os.replace(out, old) if out.is_dir() else os.replace(out, old)
    os.replace(partial, out)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    shifted = f"{summary['blocks_shifted']}/{summary['blocks']} tiles halved" if mode == "pow2" else f"{summary['blocks']} tiles"
    summary["message"] = (
        f"{out}: {summary['expert_weights_repacked']} expert weights converted to neuron-w8 {mode} ({shifted}, "
        f"{summary['values_changed']} values rounded, max abs error {summary['max_abs_error']:.3g}); "
        f"{len(shards)} shards ({resumed} resumed), {len(copied)} other files copied in {summary['seconds']:.1f} s"
        + "".join(f"\nWARNING: {w}" for w in warnings)
    )
    return summary


def _expert_block_of(mode: str, q) -> tuple[int, int]:
    if mode == "output-block":
        return (128, 0)
    return tuple(q.block) if q.block else (128, 128)
