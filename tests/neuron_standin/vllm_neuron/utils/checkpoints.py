"""STAND-IN: vllm_neuron/utils/checkpoints.py SafetensorsCheckpoint (_get_slice, load_sharded_pipelined).

Upstream's loader runs each parameter's weight loader on the slices of its mapped checkpoint keys (the
parameter name itself when unmapped) and casts the result to the parameter's dtype; strict loading
raises for a parameter whose keys are missing."""

import json
import os
from typing import NamedTuple

import torch
from safetensors import safe_open

from .weight_loader import get_weight_loader


class CheckpointLoadResult(NamedTuple):
    state_dict: dict
    missing_keys: list
    unexpected_keys: list


class SafetensorsCheckpoint:
    def __init__(self, model_name_or_path, cache_dir=None):
        self._dir = model_name_or_path
        with open(os.path.join(model_name_or_path, "model.safetensors.index.json")) as f:
            self._tensor_name_to_file = {k: os.path.join(model_name_or_path, v) for k, v in json.load(f)["weight_map"].items()}
        self._open = {}

    def _get_slice(self, key):
        path = self._tensor_name_to_file[key]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt", device="cpu")
        return self._open[path].get_slice(key)

    def load_sharded_pipelined(self, rank, world_size, model, mappings, device, dtype_override=None, strict=True):
        state, missing = {}, []
        for name, param in model.named_parameters():
            keys = mappings.get(name, name)
            keys = keys if isinstance(keys, list) else [keys]
            absent = [k for k in keys if k not in self._tensor_name_to_file]
            if absent:
                if strict:
                    raise RuntimeError(f"Checkpoint key(s) not found for parameter '{name}': {absent}")
                missing.append(name)
                continue
            tensor = get_weight_loader(param).load([self._get_slice(k) for k in keys], rank)
            state[name] = tensor.to(param.dtype).to(device)
        return CheckpointLoadResult(state, missing, [])
