"""STAND-IN: GLM-5.3-Flash's ``load_weights`` in the fork's order (jinhuang12/vllm-neuron ``model/glm5_next/model_fp8.py``,
later stored version; names from ``weight_loaders_fp8.py`` @659d671 ``build_weight_mappings`` / ``_add_moe_mlp``):

1. the key map: parameter ``model.layers.{i}.<...>`` <- checkpoint ``model.language_model.layers.{i}.<...>``; a routed
   bank's ``mlp.experts.<proj>_weight`` <- the list of every expert's ``weight`` and ``weight_scale_inv``, interleaved;
   the router ``mlp.experts.router_weight`` / ``router_bias`` <- ``mlp.gate.weight`` / ``e_score_correction_bias``;
2. a placeholder per *declared* parameter name that has a mapping, with its loader (the fork's stacked-bank loader
   is not reproduced: an adopted bank declares none);
3. ``SafetensorsCheckpoint.load_sharded_pipelined`` (the 4-thread pool), ``load_state_dict(assign=True)``; FP8 tensors
   stay FP8 bytes;
4. every scale grid read out of band as a plain ``<proj>_weight_scale_inv`` attribute of its module (a bank's: its
   local experts' grids stacked, cut to its column);
5. ``_run_load_time_preps``: ``prepare_scale_operands(**six operands)`` on every module whose class has it (operand
   names from its declared names whose grid is present), then ``RELEASED_AFTER_PREP`` released.

Sharding: a declared leaf's shard comes from ``model_fp8._SHARD_GEOMETRY``, looked up by its module's class name.
The router weight is stored ``[H, E]`` (the fork's router reads the expert count off dim 1; which step of the fork
turns the checkpoint's ``[E, H]`` round was not read, the stand-in's loader does). ``reader``: the shape-only
rehearsal (``load_weights_lite``): every step on meta, tensors made from the checkpoint headers
(:class:`MetaShapeCheckpoint`), no data read, no ``load_sharded_pipelined``."""

import torch
from torch import nn

from vllm_neuron.parallel import neuron_parallel_state as ps
from vllm_neuron.utils.checkpoints import SafetensorsCheckpoint
from vllm_neuron.utils.weight_loader import SafetensorsWeightLoader, set_weight_loader

SUFFIX = "weight_scale_inv"
CKPT_PREFIX, PARAM_PREFIX = "model.language_model", "model"
DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F32": torch.float32}
PROJS = ("gate_proj", "up_proj", "down_proj")


def build_weight_mappings(text_config) -> dict:
    m = {}
    for i in range(text_config.num_hidden_layers):
        c, p = f"{CKPT_PREFIX}.layers.{i}", f"{PARAM_PREFIX}.layers.{i}"
        m[f"{p}.post_attention_layernorm_weight"] = f"{c}.post_attention_layernorm.weight"
        m[f"{p}.mlp.experts.router_weight"] = f"{c}.mlp.gate.weight"
        m[f"{p}.mlp.experts.router_bias"] = f"{c}.mlp.gate.e_score_correction_bias"
        for leaf in PROJS:
            m[f"{p}.mlp.experts.{leaf}_weight"] = [k for e in range(text_config.n_routed_experts)
                                                   for k in (f"{c}.mlp.experts.{e}.{leaf}.weight",
                                                             f"{c}.mlp.experts.{e}.{leaf}.{SUFFIX}")]
            if text_config.n_shared_experts:
                m[f"{p}.mlp.shared_experts.{leaf}_weight"] = [f"{c}.mlp.shared_experts.{leaf}.weight",
                                                              f"{c}.mlp.shared_experts.{leaf}.{SUFFIX}"]
    return m


def dequantize(codes: torch.Tensor, grid: torch.Tensor, block: int = 128) -> torch.Tensor:
    s = grid.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[: codes.shape[0], : codes.shape[1]]
    return codes.float() * s


def _keys(v):
    return v if isinstance(v, list) else [v]


TRANSPOSED = ("router_weight",)  # stored [H, E]: the fork's router takes the expert count from dim 1


def _shard(module, name, full_shape):
    """(dim, size) of a declared leaf split over the ranks (model_fp8._SHARD_GEOMETRY, by class name), or None."""
    from .model_fp8 import _shard_geometry_for

    geometry = _shard_geometry_for(module, name, ps.get_tp_group().world_size)
    if geometry is None:
        return None
    dim, shards = geometry
    return dim, full_shape[dim] // shards


class _MetaSlice:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = list(shape), dtype

    def get_shape(self):
        return self.shape

    def get_dtype(self):
        return self.dtype

    def __getitem__(self, index):
        return torch.empty(self.shape, dtype=DTYPES[self.dtype], device="meta")[index]


class MetaShapeCheckpoint:
    """The rehearsal's reader: the checkpoint's headers (shape, dtype), every read a meta tensor; no data read."""

    def __init__(self, checkpoint_path, cache_dir=None):
        self.headers = SafetensorsCheckpoint(checkpoint_path, cache_dir)

    def _ensure_indexed(self):
        self.headers._ensure_indexed()

    def _get_slice(self, key):
        sl = self.headers._get_slice(key)
        return _MetaSlice(sl.get_shape(), sl.get_dtype())


def _cut(t, dim, lo, hi):
    return t[lo:hi] if dim == 0 else t[:, lo:hi]


def materialise(model, mappings, headers, device) -> int:
    made = 0
    for path, module in model.named_modules():
        for name in getattr(module, "declared_param_names", ()):
            keys = _keys(mappings.get(f"{path}.{name}", []))
            if not keys:
                continue
            if len(keys) > 2:
                raise NotImplementedError(f"stand-in: the fork's stacked expert-bank loader is not reproduced ({path}.{name})")
            sl = headers._get_slice(keys[0])
            shape = list(sl.get_shape())
            if name in TRANSPOSED:
                shape = shape[::-1]
                param = nn.Parameter(torch.empty(shape, dtype=DTYPES[sl.get_dtype()], device=device), requires_grad=False)
                module.register_parameter(name, param)
                set_weight_loader(param, SafetensorsWeightLoader(transform=lambda slices, rank: slices[0][:].T.contiguous()))
                made += 1
                continue
            shard = _shard(module, name, shape)
            if shard is not None:
                shape[shard[0]] = shard[1]

                def transform(slices, rank, _shard=shard):
                    dim, size = _shard
                    return _cut(slices[0][:], dim, rank * size, (rank + 1) * size)

                loader = SafetensorsWeightLoader(transform=transform)
            else:
                loader = SafetensorsWeightLoader(transform=lambda slices, rank: slices[0][:])
            param = nn.Parameter(torch.empty(shape, dtype=DTYPES[sl.get_dtype()], device=device), requires_grad=False)
            module.register_parameter(name, param)
            set_weight_loader(param, loader)
            made += 1
    return made


def _bank_grid(bank, leaf, scale_keys, checkpoint):
    ep = int(bank.ep_degree)
    ep_rank = ps.get_neuron_ep_rank() if ep > 1 else 0
    column_group = ps.get_neuron_ep_tp_group() if ep > 1 else ps.get_tp_group()
    shards, column = int(bank.tp_degree) // ep, column_group.rank_in_group
    grids = []
    for e in bank.local_expert_indices(ep_rank):
        g = checkpoint._get_slice(scale_keys[e])[:]
        rows = g.shape[1 if leaf == "down_proj_weight" else 0] // shards
        grids.append(_cut(g, 1 if leaf == "down_proj_weight" else 0, column * rows, (column + 1) * rows))
    return torch.stack(grids)


def load_out_of_band_scales(model, checkpoint, mappings, device) -> int:
    checkpoint._ensure_indexed()
    rank, read = ps.get_tp_group().rank_in_group, 0
    for param_name, value in mappings.items():
        keys = _keys(value)
        if len(keys) < 2:
            continue
        path, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(path)
        attr = f"{leaf[: -len('_weight')]}_{SUFFIX}"
        if len(keys) > 2:  # a routed bank: its local experts' grids, stacked
            grid = _bank_grid(module, leaf, keys[1::2], checkpoint)
        else:
            grid = checkpoint._get_slice(keys[1])[:]
            shard = _shard(module, leaf, list(checkpoint._get_slice(keys[0]).get_shape()))
            if shard is not None:
                dim, size = shard
                grid = _cut(grid, dim, rank * size // 128, (rank + 1) * size // 128)
        setattr(module, attr, grid.to(dtype=torch.float32, device=device))
        read += 1
    return read


def _release(module, *names):
    for name in names:
        if name in module._parameters:
            module._parameters[name] = None
        elif name in module.__dict__:
            delattr(module, name)


def run_load_time_preps(model) -> int:
    calls = 0
    for _, module in model.named_modules():
        if hasattr(type(module), "prepare_scale_operands"):
            operands = {}
            for leaf in getattr(module, "declared_param_names", ()):
                grid = f"{leaf[: -len('_weight')]}_{SUFFIX}"
                if leaf.endswith("_weight") and getattr(module, grid, None) is not None:
                    operands[leaf] = getattr(module, leaf)
                    operands[f"{leaf[: -len('_weight')]}_scale"] = getattr(module, grid)
            module.prepare_scale_operands(**operands)
            calls += 1
        _release(module, *getattr(type(module), "RELEASED_AFTER_PREP", ()))
    return calls


def load_weights(model, checkpoint_path, device, cache_dir=None, reader=None) -> None:
    mappings = build_weight_mappings(model.text_config)
    headers = reader if reader is not None else SafetensorsCheckpoint(checkpoint_path, cache_dir)
    headers._ensure_indexed()
    materialise(model, mappings, headers, device)
    if reader is not None:  # the shape-only rehearsal: every later step on meta, from the headers
        load_out_of_band_scales(model, reader, mappings, device)
        run_load_time_preps(model)
        model.last_load = "rehearsal"
        return
    checkpoint = SafetensorsCheckpoint(checkpoint_path, cache_dir)
    rank = ps.get_tp_group().rank_in_group
    state = checkpoint.load_sharded_pipelined(rank, model.world_size, model, mappings, device).state_dict
    model.load_state_dict(state, strict=False, assign=True)
    load_out_of_band_scales(model, checkpoint, mappings, device)
    run_load_time_preps(model)
    model.last_load = "weights"
