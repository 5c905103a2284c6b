"""Checks run on a loaded rank in either tree (``_glue_ranks.Job(extra="_glue_extras:<fn>")``): each returns tensors
the test judges against its float64 reference. The fault variants are applied in the rank and undone after, so one
load serves the gate and its fault twins."""

from __future__ import annotations

import torch

import _glue_ranks as gr
from test_neuron_glue_tp_probe import TensorSlice  # a safetensors slice over real values, for the loaders

SHARED_CASES = (("decode", 6, 11), ("prefill", 160, 12))  # selective decode; the block prefill kernel


def shared_expert(model, family, rank, job) -> dict:
    """Per MoE layer and case: the normed input and this rank's shared-expert partial sum through the kernels
    (``w8_shared_expert``), plus its fault variants: gate ignored, the routed expert next to the slot, one scale
    tile of its gate projection doubled."""
    out = []
    with torch.no_grad():
        for layer in family.moe_layers(model):
            out.append(_shared_layer(family, layer))
    return out


def _shared_layer(family, layer) -> dict:
    bank = family.bank(layer)
    res = {"layout": bank.w8_shared.layout, "plan": bank.w8_shared.plan.__dict__.copy(), "cases": {}}
    size = bank.hidden_size
    for name, tokens, seed in SHARED_CASES:
        normed = layer.post_attention_layernorm(gr.hidden(tokens, seed, size).to(bank.dtype))
        case = {"normed": normed, "ok": bank.w8_shared_expert(normed)}
        # faults on this rank's bank only (stand-in ranks are threads of one process)
        bank.w8_shared_affinity = lambda x: torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        try:
            case["ungated"] = bank.w8_shared_expert(normed)
        finally:
            del bank.w8_shared_affinity
        if bank.w8_shared.layout == "slot":
            bank.w8_shared_ids = lambda ids: torch.full_like(ids[:, :1], bank.w8_plan.num_local - 1)
            try:
                case["slot_off_by_one"] = bank.w8_shared_expert(normed)
            finally:
                del bank.w8_shared_ids
        scales = bank.w8_w13_scales if bank.w8_shared.layout == "slot" else bank.w8_shared_w13_scales
        index = (scales.shape[0] - 1, 0, 0)  # the shared expert's first gate tile
        scales[index] *= 2
        try:
            case["scale_tile_doubled"] = bank.w8_shared_expert(normed)
        finally:
            scales[index] /= 2
        res["cases"][name] = case
    return res


# ---- Qwen3.5's attention and Gated-DeltaNet mixers (neuron_glue/mixers.py) -----------------------------------

BLOCK_SIZE = 16  # KV page rows
T_PREFILL, REQS = 64, 4  # one prefilled sequence (the delta rule chunks by 64), then REQS decode requests reading its pages
ROTARY_FACTOR = 0.25  # the tiny Qwen3.5's partial_rotary_factor


def _param_keys(kind: str, prefix: str) -> dict:
    """vllm-neuron's mixer parameter -> checkpoint key(s) (its load_weights' mappings, Qwen3.5 model.py @3de9ea3)."""
    if kind == "attention":
        keys = {f"{p}_weight": f"{prefix}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        keys.update({f"{n}.weight": f"{prefix}.self_attn.{n}.weight" for n in ("q_norm", "k_norm")})
        return keys
    la = f"{prefix}.linear_attn"
    keys = {f"{p}_weight": f"{la}.{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "out_proj", "conv1d")}
    keys.update(in_proj_ba_weight=[f"{la}.in_proj_b.weight", f"{la}.in_proj_a.weight"], norm_weight=f"{la}.norm.weight",
                dt_bias=f"{la}.dt_bias", A_log=f"{la}.A_log")
    return keys


def twin(mixer, kind: str, text_config, tensors: dict, prefix: str, dtype, rank: int):
    """A fresh vllm-neuron mixer of the same layer (its own class, unadopted) in ``dtype``, every parameter filled by its
    own weight loader from the checkpoint's exact values (FP8 dequantised, then rounded once to ``dtype``; ``dt_bias`` /
    ``A_log`` float32 as vllm-neuron keeps them: its delta rule runs in float32, so a DeltaNet twin is float32 there)."""
    import dataclasses
    import importlib

    from vllm_moe_w8.neuron_glue import mixers

    import _neuron_standin as st

    target = mixers.ATTENTION if kind == "attention" else mixers.DELTANET
    cls = getattr(importlib.import_module(target.module[0]), target.module[1])
    get_loader = importlib.import_module("vllm_neuron.utils.weight_loader").get_weight_loader
    module = cls(dataclasses.replace(text_config, torch_dtype=dtype), mixer.layer_idx)
    for name, keys in _param_keys(kind, prefix).items():
        param = module.get_parameter(name)
        keys = keys if isinstance(keys, list) else [keys]
        values = [(st.dequant(tensors, k) if k + "_scale_inv" in tensors else tensors[k].float()).double() for k in keys]
        got = get_loader(param).load([TensorSlice(v) for v in values], rank)
        with torch.no_grad():
            param.data = got.to(torch.float32 if name in ("dt_bias", "A_log") else dtype)  # as its load_weights keeps them
    return module


def _inputs(kind, size, head_dim, world, rank, dtype):
    """(prefill hidden [this rank's share], decode hidden [REQS], cos/sin for both)."""
    pre = gr.hidden(T_PREFILL, 21, size).to(dtype)
    dec = gr.hidden(REQS, 22, size).to(dtype)
    half = int(head_dim * ROTARY_FACTOR) // 2
    freqs = lambda pos: pos[:, None].double() / 10000.0 ** (torch.arange(half, dtype=torch.float64) / half)  # noqa: E731
    rope = {"prefill": freqs(torch.arange(T_PREFILL)), "decode": freqs(torch.full((REQS,), T_PREFILL))}
    return pre.chunk(world)[rank], dec, {k: (v.cos(), v.sin()) for k, v in rope.items()}


def _metadata(mixer, kind, phase, dtype, device="cpu"):
    """vllm-neuron's per-layer attention metadata for the phase, and (re)bound pages of ``dtype`` (prefill fresh)."""
    blocks = -(-T_PREFILL // BLOCK_SIZE)
    if phase == "prefill":
        if kind == "attention":
            mixer.kv_pages = torch.zeros(1 + blocks + REQS + 2, 2, mixer.num_kv_heads_per_rank, BLOCK_SIZE, mixer.head_dim,
                                         dtype=dtype, device=device)
        else:
            floats = (mixer.conv_kernel_size - 1) * mixer.conv_dim + mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim
            mixer.state_pages = torch.zeros(1 + REQS + 2, floats, dtype=torch.float32, device=device)
    name = mixer.layer_name
    if phase == "prefill":
        meta = {"max_query_len": T_PREFILL, "decode_token_threshold": 1, "block_size": BLOCK_SIZE,
                "slot_mapping": BLOCK_SIZE + torch.arange(T_PREFILL)}
        meta["block_table_tensor"] = torch.tensor([[1 + b for b in range(blocks)]] if kind == "attention" else [[1]])
    else:  # REQS requests continuing the prefilled sequence (attention) / on pages 1..REQS (DeltaNet)
        meta = {"max_query_len": 1, "decode_token_threshold": 1, "block_size": BLOCK_SIZE,
                "slot_mapping": BLOCK_SIZE * (1 + blocks) + torch.arange(REQS)}
        meta["block_table_tensor"] = (torch.tensor([[1 + b for b in range(blocks)]] * REQS) if kind == "attention"
                                      else torch.arange(1, REQS + 1)[:, None])
    return {name: {k: v.to(device) if torch.is_tensor(v) else v for k, v in meta.items()}}


def _run(mixer, kind, phase, hidden, rope, dtype, call=None, device="cpu"):
    meta = _metadata(mixer, kind, phase, dtype, device)
    positions = (torch.arange(T_PREFILL) if phase == "prefill" else torch.full((REQS,), T_PREFILL)).to(device)
    cos, sin = (t.to(dtype).to(device) for t in rope[phase])
    fn = mixer if call is None else call
    with torch.no_grad():
        if kind == "attention":
            return fn(hidden.to(dtype).to(device), positions, (cos, sin), meta)
        return fn(hidden.to(dtype).to(device), positions, meta)


def mixer_adoption(model, family, rank, job) -> list:
    """(layer, mixer kind, qualname, whether vllm-neuron still holds BF16 projections) per decoder layer."""
    out = []
    for layer in family.moe_layers(model):
        mixer = layer.linear_attn if layer.is_linear_attention else layer.self_attn
        names = ("in_proj_qkv_weight", "in_proj_z_weight", "out_proj_weight") if layer.is_linear_attention else \
            ("q_proj_weight", "k_proj_weight", "v_proj_weight", "o_proj_weight")
        bf16 = [n for n in names if isinstance(getattr(mixer, n, None), torch.nn.Parameter)]
        out.append((mixer.layer_idx, "deltanet" if layer.is_linear_attention else "attention", type(mixer).__qualname__,
                    bf16, [str(getattr(mixer, n).dtype) for n in bf16]))
    return out


def mixer_checks(model, family, rank, job) -> list:
    """Per mixer: vllm-neuron's forward (prefill then decode on the pages it wrote) of the adopted mixer, compiled
    (fullgraph, a second decode with other inputs must not recompile), against its float64 twin and today's BF16
    twin; each group's fused product against the twin's parameters; and the fault variants."""
    import _neuron_standin as st
    from vllm_moe_w8.neuron_glue import loaders, mixers

    from pathlib import Path

    tensors = st.checkpoint_tensors(Path(job.ckpt))
    source = loaders.ExpertSource(job.ckpt, "model.language_model.layers.")
    shapes = mixers.checkpoint_shapes(model.text_config)
    world = model.language_model.layers[0].mlp.world_size
    out = []
    for layer in family.moe_layers(model):
        mixer = layer.linear_attn if layer.is_linear_attention else layer.self_attn
        kind = "deltanet" if layer.is_linear_attention else "attention"
        prefix = f"model.language_model.layers.{mixer.layer_idx}"
        size = model.text_config.hidden_size
        pre, dec, rope = _inputs(kind, size, model.text_config.head_dim, world, rank, torch.bfloat16)
        res = {"kind": kind, "layer": mixer.layer_idx, "qualname": type(mixer).__qualname__,
               "released": [p for g in mixer.w8_target.groups for p in g.params if hasattr(mixer, p)],
               "kv_replicas": getattr(mixer, "num_kv_replicas", None)}
        rec = st.Recorder()
        compiled = torch.compile(mixer, backend=rec, fullgraph=True, dynamic=False)
        res["ours"] = {"prefill": _run(mixer, kind, "prefill", pre, rope, torch.bfloat16, compiled),
                       "decode": _run(mixer, kind, "decode", dec, rope, torch.bfloat16, compiled)}
        with torch._dynamo.config.patch(error_on_recompile=True):
            res["ours_second"] = _run(mixer, kind, "decode", dec.flip(0), rope, torch.bfloat16, compiled)
        res["graphs"], res["kernels"] = len(rec.graphs), [rec.kernels(g) for g in rec.graphs]
        for label, dtype in (("float64", torch.float64), ("bf16", torch.bfloat16)):
            ref = twin(mixer, kind, model.text_config, tensors, prefix, dtype, mixer.w8_rank)
            res[label] = {"prefill": _run(ref, kind, "prefill", pre, rope, dtype),
                          "decode": _run(ref, kind, "decode", dec, rope, dtype)}
            if label == "float64":
                res["float64_second"] = _run(ref, kind, "decode", dec.flip(0), rope, dtype)
                res["products"] = {}
                for g in mixer.w8_target.groups:
                    x = gr.hidden(8, 23, ref.get_parameter(g.params[0]).shape[0]).to(torch.bfloat16)  # [T, K]
                    want = x.double() @ torch.cat([ref.get_parameter(p) for p in g.params], dim=1)
                    with torch.no_grad():
                        res["products"][g.name] = (mixer.w8_matmul(x, g.name), want)
        res["faults"] = _mixer_faults(mixer, kind, source, shapes, pre, dec, rope, world)
        out.append(res)
    return out


def _mixer_faults(mixer, kind, source, shapes, pre, dec, rope, world) -> dict:
    """The adopted mixer's prefill and decode with one realistic loading fault each, the right weights restored after."""
    from vllm_moe_w8.neuron_glue import mixers

    group = mixer.w8_target.groups[0]  # q + k + v / in_proj_qkv + in_proj_z
    read = mixers.reader(source, mixer)

    def with_parts(change, rank=None):
        cuts = None if rank is None else mixers.plan_cuts(mixer.w8_target, mixer.w8_loaders, rank, shapes, mixer.w8_lnc,
                                                          "fault")[0]  # the loaders' rule run for another rank
        parts = mixers.group_parts(mixer, group, shapes, "fault", read, cuts=cuts)
        mixer.w8_set_linear(group.name, mixers.pack(change(parts), "fault"))
        try:
            return {ph: _run(mixer, kind, ph, x, rope, torch.bfloat16) for ph, x in (("prefill", pre), ("decode", dec))}
        finally:
            mixer.w8_set_linear(group.name, mixers.pack(mixers.group_parts(mixer, group, shapes, "fault", read), "ok"))

    def doubled(parts):  # the first scale tile of the last part (v / in_proj_z: no norm after it)
        codes, grid, name = parts[-1]
        grid = grid.clone()
        grid[0, 0] *= 2
        return parts[:-1] + [(codes, grid, name)]

    faults = {"scale_tile_doubled": with_parts(doubled),
              "last_two_parts_swapped": with_parts(lambda p: p[:-2] + [p[-1], p[-2]])}
    if world > 1:
        faults["other_ranks_shard"] = with_parts(lambda p: p, rank=(mixer.w8_rank + 1) % world)
    return faults


def mixer_meta_checks(model, family, rank, job) -> list:
    """VLLM_NEURON_CPU_COMPILE: after the weights-free load the adopted mixers' packed projections are meta buffers and
    vllm-neuron's forward traces on meta (fullgraph) for prefill and decode: (kind, buffer devices, output devices)."""
    import _neuron_standin as st

    out = []
    world = model.language_model.layers[0].mlp.world_size
    for layer in family.moe_layers(model):
        mixer = layer.linear_attn if layer.is_linear_attention else layer.self_attn
        kind = "deltanet" if layer.is_linear_attention else "attention"
        pre, dec, rope = _inputs(kind, model.text_config.hidden_size, model.text_config.head_dim, world, rank,
                                 torch.bfloat16)
        rec = st.Recorder()
        compiled = torch.compile(mixer, backend=rec, fullgraph=True, dynamic=False)
        outs = [_run(mixer, kind, ph, x, rope, torch.bfloat16, compiled, device="meta")
                for ph, x in (("prefill", pre), ("decode", dec))]
        buffers = sorted({b.device.type for n, b in mixer.named_buffers() if n.startswith("w8_")})
        out.append({"kind": kind, "buffers": buffers, "outputs": [o.device.type for o in outs], "graphs": len(rec.graphs),
                    "has_fp8_params": [g for g in mixer.w8_target.groups for p in g.params if hasattr(mixer, p)] != []})
    return out
