"""STAND-IN: vllm_neuron/utils/checkpoints.py SafetensorsCheckpoint (_get_slice, load_sharded_pipelined).

As Infinity-AI-Institute/vllm-neuron ``utils/checkpoints.py`` @cd76a78 does: the file list is the index's shard
files, sorted; the tensor -> file index (``_tensor_name_to_file``) starts empty and grows shard by shard; a
parameter is handed to a ``ThreadPoolExecutor(max_workers=4)`` as soon as every checkpoint key it maps to is
indexed, and ``_process_param`` runs on the worker thread: its weight loader on ``_get_slice`` of each key,
then a cast to the parameter's dtype; strict loading raises for a parameter whose keys are missing once every
shard is indexed.

Of the real loader's interleavings, this one is fixed: the tasks handed out after a shard is indexed finish
before the next shard is indexed (the real page-cache thread may be that slow), so a ``_get_slice`` of a key
in a later shard fails here as it can there."""

import concurrent.futures
import json
import os
import threading
from typing import NamedTuple

import torch
from safetensors import safe_open

from .weight_loader import get_weight_loader

WORKERS = 4
worker_threads: set = set()  # names of the threads _process_param ran on (tests read it)


class CheckpointLoadResult(NamedTuple):
    state_dict: dict
    missing_keys: list
    unexpected_keys: list


class SafetensorsCheckpoint:
    def __init__(self, model_name_or_path, cache_dir=None):
        self._dir = model_name_or_path
        with open(os.path.join(model_name_or_path, "model.safetensors.index.json")) as f:
            self._weight_map = json.load(f)["weight_map"]
        self._safetensor_file_names = sorted(set(self._weight_map.values()))
        self._tensor_name_to_file = {}  # populated lazily, shard by shard
        self._open_safetensor_files = {}

    def _index(self, file_name):
        path = os.path.join(self._dir, file_name)
        self._open_safetensor_files[path] = safe_open(path, framework="pt", device="cpu")
        for key in self._open_safetensor_files[path].keys():
            if self._weight_map.get(key) == file_name:
                self._tensor_name_to_file[key] = path

    def _ensure_indexed(self):
        for file_name in self._safetensor_file_names:
            if os.path.join(self._dir, file_name) not in self._open_safetensor_files:
                self._index(file_name)

    def _get_slice(self, key):
        path = self._tensor_name_to_file[key]
        return self._open_safetensor_files[path].get_slice(key)

    def _process_param(self, name, keys, weight_loader, rank, target_dtype):
        worker_threads.add(threading.current_thread().name)
        tensor = weight_loader.load([self._get_slice(k) for k in keys], rank)
        return name, tensor.to(target_dtype)

    def load_sharded_pipelined(self, rank, world_size, model, mappings, device, dtype_override=None, strict=True):
        state, missing, done = {}, [], set()
        params = list(model.named_parameters())
        with concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS) as pool:
            for i, file_name in enumerate(self._safetensor_file_names):
                self._index(file_name)
                last = i == len(self._safetensor_file_names) - 1
                futures = []
                for name, param in params:
                    if name in done:
                        continue
                    keys = mappings.get(name, name)
                    keys = keys if isinstance(keys, list) else [keys]
                    if not all(k in self._tensor_name_to_file for k in keys):
                        if last:
                            absent = [k for k in keys if k not in self._tensor_name_to_file]
                            if strict:
                                raise RuntimeError(f"Checkpoint key(s) not found for parameter '{name}': {absent}")
                            missing.append(name)
                            done.add(name)
                        continue
                    target = (dtype_override or {}).get(name, param.dtype)
                    futures.append(pool.submit(self._process_param, name, keys, get_weight_loader(param), rank, target))
                    done.add(name)
                for fut in futures:
                    name, tensor = fut.result()
                    state[name] = tensor.to(device)
        return CheckpointLoadResult(state, missing, [])
