"""Break tiny FP8 checkpoints in the ways real downloads and exports break (for the reliability tests).

Every function takes a checkpoint folder written by :func:`vllm_moe_w8.tiny_models.write_checkpoint`
(or a copy, see :func:`copy_checkpoint`), changes it in place and returns what it broke, so a test can
assert that the error names exactly that file / tensor / setting. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
# One routed-expert projection of layer 1 (every tiny architecture has >= 2 layers and >= 8 experts).
EXPERT = "experts.3.up_proj"


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A private copy (shards hard-linked would share corruption, so files are copied)."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX).read_text())["weight_map"]


def expert_name(path: Path, suffix: str = "weight", expert: str = EXPERT) -> str:
    """The full checkpoint name of ``<...>.layers.1.mlp.<expert>.<suffix>`` (any prefix)."""
    names = [n for n in weight_map(path) if n.endswith(f".1.mlp.{expert}.{suffix}")]
    if len(names) != 1:
        raise LookupError(f"{path}: expected one tensor '*.1.mlp.{expert}.{suffix}', found {names}")
    return names[0]


def shard_of(path: Path, name: str) -> str:
    return weight_map(path)[name]


def _read_shard(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _rewrite_shard(file: Path, tensors: dict[str, torch.Tensor], metadata) -> None:
    save_file(tensors, str(file), metadata=metadata or {"format": "pt"})


def edit_tensor(path: Path, name: str, fn) -> str:
    """Replace tensor ``name`` by ``fn(tensor)`` in its shard (shape/dtype may change); returns the shard name."""
    shard = shard_of(path, name)
    tensors, meta = _read_shard(path / shard)
    tensors[name] = fn(tensors[name]).contiguous()
    _rewrite_shard(path / shard, tensors, meta)
    return shard


def drop_tensor(path: Path, name: str, keep_in_index: bool) -> str:
    """Remove ``name`` from its shard; ``keep_in_index``: the index still lists it (a shard missing a tensor)."""
    shard = shard_of(path, name)
    tensors, meta = _read_shard(path / shard)
    del tensors[name]
    _rewrite_shard(path / shard, tensors, meta)
    if not keep_in_index:
        index = json.loads((path / INDEX).read_text())
        del index["weight_map"][name]
        (path / INDEX).write_text(json.dumps(index, indent=2))
    return shard


def truncate_shard(path: Path, keep_fraction: float = 0.6, shard: str | None = None) -> str:
    """Cut a shard's data short (an interrupted download); returns the shard name."""
    shard = shard or sorted(set(weight_map(path).values()))[-1]
    file = path / shard
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep_fraction)])
    return shard


def garble_header(path: Path, shard: str | None = None) -> str:
    """Overwrite the JSON header of a shard with bytes that are not JSON (a corrupt file)."""
    shard = shard or sorted(set(weight_map(path).values()))[0]
    file = path / shard
    data = bytearray(file.read_bytes())
    data[8:40] = b"\xff\xfe{not json at all}\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c"[:32]
    file.write_bytes(bytes(data))
    return shard


def remove_shard(path: Path, shard: str | None = None) -> str:
    """Delete a shard file that the index still names."""
    shard = shard or sorted(set(weight_map(path).values()))[-1]
    (path / shard).unlink()
    return shard


def set_scale_value(path: Path, value: float, name: str | None = None) -> str:
    """Set one element of an expert's scale grid to ``value`` (0, negative, NaN, inf); returns the tensor name."""
    name = name or expert_name(path, scale_suffix(path))

    def fn(t):
        t = t.clone()
        t.view(-1)[t.numel() // 2] = value
        return t

    edit_tensor(path, name, fn)
    return name


def double_scale_tile(path: Path, name: str | None = None) -> str:
    """Double the first scale of an expert's grid (one 128x128 tile, or one row's per-channel scale): a
    plausible, finite export bug that only the served numbers reveal; returns the tensor name."""
    name = name or expert_name(path, scale_suffix(path))

    def fn(t):
        t = t.clone()
        t.view(-1)[0] = t.view(-1)[0] * 2
        return t

    edit_tensor(path, name, fn)
    return name


def set_nan_code(path: Path, code: int = 0x7F, name: str | None = None) -> str:
    """Write the e4m3fn NaN byte ``code`` (0x7F or 0xFF) into an expert weight; returns the tensor name."""
    name = name or expert_name(path, "weight")

    def fn(t):
        b = t.view(torch.uint8).clone()
        b[1, 2] = code
        return b.view(t.dtype)

    edit_tensor(path, name, fn)
    return name


def wrong_scale_grid(path: Path, name: str | None = None) -> str:
    """Give an expert's scale one column too many (a grid that does not fit its weight)."""
    name = name or expert_name(path, scale_suffix(path))
    edit_tensor(path, name, lambda t: torch.cat([t, t[:, :1]], dim=1))
    return name


def scale_suffix(path: Path) -> str:
    wm = weight_map(path)
    return "weight_scale_inv" if any(n.endswith(".weight_scale_inv") for n in wm) else "weight_scale"


def edit_config(path: Path, fn) -> None:
    """Apply ``fn(config_dict)`` to config.json (``fn`` edits in place)."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    fn(cfg)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def quant_config(cfg: dict) -> dict:
    """The quantization_config dict of a config (top level or text_config)."""
    if "quantization_config" in cfg:
        return cfg["quantization_config"]
    return cfg["text_config"]["quantization_config"]


def set_quant(path: Path, **values) -> None:
    """Set keys of the quantization_config (e.g. ``weight_block_size=[64, 64]``)."""
    edit_config(path, lambda cfg: quant_config(cfg).update(values))


def set_architecture(path: Path, arch: str) -> None:
    edit_config(path, lambda cfg: cfg.__setitem__("architectures", [arch]))
