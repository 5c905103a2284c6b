"""Safetensors shards with ``model.safetensors.index.json``: write a tensor dict split into N shards, read
all of a checkpoint's tensors back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

def write_shards(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """Split tensors in order into ``num_shards`` files of about equal bytes + the index."""
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    target = total / num_shards
    shards: list[dict[str, torch.Tensor]] = [{}]
    acc = 0
    for name in names:
        t = tensors[name]
        if acc >= target * len(shards) and len(shards) < num_shards:
            shards.append({})
        shards[-1][name] = t.contiguous()
        acc += t.numel() * t.element_size()
    while len(shards) < num_shards:  # tiny plans: move the last tensor out so every shard exists
        donor = max(shards, key=len)
        last = list(donor)[-1]
        shards.append({last: donor.pop(last)})
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def load_all(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out
