"""Memory plan per rank: routed-expert bytes (neuron-w8 vs BF16), other weights, KV cache, what fits.

Works from a config.json alone (a checkpoint folder, a config file, or one of the package's
``configs/*.json``), so users can decide before downloading hundreds of GB.

The model (stated in every report's ``assumptions``):

* Routed experts: MoE layers x E x 3·H·I parameters (gate, up, down), 1 byte each as neuron-w8 codes,
  2 as BF16; GB = 1e9 bytes. Per rank: with EP whole experts (ceil(E / ranks) on the fullest rank),
  without EP every expert's intermediate dim split by TP; with an EP degree below the rank count
  (``ep_size``, vllm-neuron's GLM layout: TP=64 as EP=16 x 4) the experts split over ``ep_size``
  groups and each expert's intermediate dim over the ranks of a group. The codes-only figure is the one
  CHECKPOINTS.md tabulates; ``expert_bytes_per_rank_w8`` adds the float32 scales on the mode's grid
  (refined to gcd(I/tp, 128) rows when I/tp is not a multiple of 128, as the plugin does).
* Other weights: embeddings, lm_head, attention, dense MLPs, shared experts, routers, counted from the
  config's shapes in BF16 (the plugin dequantises non-expert FP8 linears once at load). An estimate
  (norms, biases and convolution kernels are ignored); ``inspect`` reads the exact tensor sizes.
  Split by TP; MLA's latent projections and routers are counted as replicated.
* KV cache per token: standard attention 2 x KV heads per rank x head_dim x full-attention layers;
  MLA (kv_lora_rank + qk_rope_head_dim) per layer, replicated on every rank; a DSA indexer adds its
  FP8 key (index_head_dim bytes + a 4-byte scale) per indexed layer; linear-attention layers (Qwen3.5
  Gated DeltaNet, GLM KDA) keep a fixed recurrent state per sequence instead, reported separately.
* Tokens that fit: (HBM x utilisation - weights) / KV bytes per token, the batch x context product.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_moe_w8.codec.model_config import quant_format
from vllm_moe_w8.tools import decode_bytes
from vllm_moe_w8.tools.model_shape import ModelShape, PlanError, model_shape

GB = 1e9
BLOCK = 128
SCALE_BYTES = 4  # converted scales are float32
DEFAULT_HBM_GB = 96 * 2**30 / 4 / GB  # Trn2: 96 GiB per chip, 4 logical cores at LNC=2 -> 25.77 GB per rank
CORES_PER_CHIP = 8  # Trn2 physical NeuronCores; LNC=n pairs n of them into one logical core (one rank)
DEFAULT_UTILIZATION = 0.9
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_DECODE_BATCH = 128  # the largest decode bucket of the kernels (kernels.host.T_BUCKETS)


# -- the per-rank plan -----------------------------------------------------------------------
def _tile_rows(rows_per_rank: int) -> int:
    """Rows per scale tile on a rank: 128, refined to gcd(rows, 128) when the split is ragged."""
    return math.gcd(rows_per_rank, BLOCK) if rows_per_rank % BLOCK else BLOCK


def expert_scale_bytes(h: int, i_rank: int, mode: str, block: tuple[int, int]) -> int:
    """float32 scale bytes of one expert's gate+up+down on a rank holding ``i_rank`` of its I."""
    if block == (1, 0):  # per-channel source: one scale per output row (pow2/lut keep it)
        if mode == "output-block":
            return SCALE_BYTES * (2 * math.ceil(i_rank / _tile_rows(i_rank)) + math.ceil(h / BLOCK))
        return SCALE_BYTES * (2 * i_rank + h)
    r = _tile_rows(i_rank)
    if mode == "output-block":
        return SCALE_BYTES * (2 * math.ceil(i_rank / r) + math.ceil(h / BLOCK))
    gate_up = 2 * math.ceil(i_rank / r) * (math.ceil(h / block[1]) if block[1] else 1)
    down = math.ceil(h / block[0]) * (math.ceil(i_rank / r) if block[1] else 1)
    return SCALE_BYTES * (gate_up + down)


def other_params(s: ModelShape) -> dict[str, int]:
    """Parameter counts of the non-routed-expert weights, split into TP-sharded and replicated."""
    h = s.hidden
    a = s.attention
    sharded = replicated = 0
    emb = s.vocab * h * (1 if s.tied_embeddings else 2)
    sharded += emb
    if a["kind"] == "mla":
        qk = a["qk_nope_head_dim"] + a["qk_rope_head_dim"]
        per = 0
        if a["q_lora_rank"]:
            replicated += a["full_layers"] * h * a["q_lora_rank"]
            per += a["q_lora_rank"] * a["heads"] * qk
        else:
            per += h * a["heads"] * qk
        replicated += a["full_layers"] * h * (a["kv_lora_rank"] + a["qk_rope_head_dim"])
        per += a["kv_lora_rank"] * a["heads"] * (a["qk_nope_head_dim"] + a["v_head_dim"])
        per += a["heads"] * a["v_head_dim"] * h
        sharded += a["full_layers"] * per
        if a.get("indexer_layers"):
            replicated += a["indexer_layers"] * (
                (a["q_lora_rank"] or h) * a["index_n_heads"] * a["index_head_dim"] + h * a["index_head_dim"] + h * a["index_n_heads"]
            )
    else:
        q = a["heads"] * a["head_dim"] * (2 if a.get("gated_q") else 1)
        kv = 2 * a["kv_heads"] * a["head_dim"]
        sharded += a["full_layers"] * (h * (q + kv) + a["heads"] * a["head_dim"] * h)
    lin = a.get("linear")
    if lin:
        kdim = lin["key_heads"] * lin["key_dim"]
        vdim = lin["value_heads"] * lin["value_dim"]
        # q, k, v (+ z output gate), beta/decay gates, output projection
        sharded += a["linear_layers"] * (h * (2 * kdim + 2 * vdim) + 2 * h * lin["value_heads"] + vdim * h)
    sharded += len(s.dense_layers) * 3 * h * s.dense_intermediate
    sharded += len(s.moe_layers) * 3 * h * s.shared_intermediate
    replicated += len(s.moe_layers) * h * s.experts  # routers
    return {"sharded": sharded, "replicated": replicated}


def kv_bytes_per_token(s: ModelShape, tp: int, kv_dtype_bytes: int) -> tuple[int, list[str]]:
    a = s.attention
    notes = []
    if a["kind"] == "mla":
        per_layer = (a["kv_lora_rank"] + a["qk_rope_head_dim"]) * kv_dtype_bytes
        total = per_layer * a["full_layers"]
        notes.append(
            f"MLA: (kv_lora_rank {a['kv_lora_rank']} + qk_rope_head_dim {a['qk_rope_head_dim']}) x {kv_dtype_bytes} B x "
            f"{a['full_layers']} attention layers; the latent is replicated on every TP rank"
        )
        if a.get("indexer_layers"):
            total += a["indexer_layers"] * (a["index_head_dim"] + 4)
            notes.append(f"DSA indexer key: FP8 {a['index_head_dim']} B + 4 B scale x {a['indexer_layers']} indexer layers (vLLM's indexer cache layout)")
        return total, notes
    kv_heads_rank = max(1, a["kv_heads"] // tp) if a["kv_heads"] >= tp else 1
    if a["kv_heads"] < tp:
        notes.append(f"{a['kv_heads']} KV heads < TP {tp}: each rank keeps a replica of one KV head")
    total = 2 * kv_heads_rank * a["head_dim"] * kv_dtype_bytes * a["full_layers"]
    notes.append(
        f"standard attention: 2 (K,V) x {kv_heads_rank} KV heads per rank x head_dim {a['head_dim']} x {kv_dtype_bytes} B x "
        f"{a['full_layers']} full-attention layers"
    )
    return total, notes


def linear_state_bytes_per_seq(s: ModelShape, tp: int, state_dtype_bytes: int) -> tuple[int, list[str]]:
    a = s.attention
    lin = a.get("linear")
    if not lin:
        return 0, []
    vh = max(1, lin["value_heads"] // tp)
    kh = max(1, lin["key_heads"] // tp)
    recurrent = vh * lin["key_dim"] * lin["value_dim"]
    conv = (2 * kh * lin["key_dim"] + vh * lin["value_dim"]) * (lin["conv_kernel"] - 1)
    total = a["linear_layers"] * (recurrent + conv) * state_dtype_bytes
    return total, [
        f"{lin['kind']} linear attention: {a['linear_layers']} layers keep a fixed state per sequence "
        f"({vh} heads x {lin['key_dim']}x{lin['value_dim']} recurrent + conv tail of {lin['conv_kernel'] - 1}, {state_dtype_bytes} B), "
        "independent of context length"
    ]


def tp_advice(s: ModelShape, tp: int, ep: bool, dp: int = 1, ep_size: int | None = None) -> tuple[list[str], list[str]]:
    """(warnings, errors) about splitting attention over ``tp`` ranks and the experts over tp (or tp x dp with EP;
    with ``ep_size`` over that many expert groups, each expert's I over the tp x dp / ep_size ranks of a group)."""
    warnings, errors = [], []
    if tp < 1:
        return warnings, [f"--tp must be >= 1, got {tp}"]
    a = s.attention
    heads = a.get("heads") or 0
    if heads and heads % tp:
        errors.append(f"num_attention_heads {heads} is not divisible by TP={tp} (vLLM refuses it): choose TP among "
                      f"{[t for t in TP_CANDIDATES if heads % t == 0]}")
    kv = a.get("kv_heads") or 0
    if kv and (kv % tp if kv >= tp else tp % kv):
        errors.append(f"num_key_value_heads {kv} and TP={tp}: vLLM needs one to divide the other")
    lin = a.get("linear")
    if lin and (lin["value_heads"] % tp or lin["key_heads"] % tp):
        errors.append(f"linear-attention heads ({lin['key_heads']} key, {lin['value_heads']} value) are not divisible by TP={tp}")
    i = s.moe_intermediate
    ok = [t for t in TP_CANDIDATES if i % t == 0 and (i // t) % BLOCK == 0]
    if ep_size:
        if (tp * dp) % ep_size:
            return warnings, errors + [f"--ep-size {ep_size} does not divide the {tp * dp} ranks (TP x DP)"]
        if s.experts % ep_size:
            warnings.append(f"{s.experts} experts do not divide evenly over EP={ep_size}: the fullest group holds {math.ceil(s.experts / ep_size)}")
        tp = tp * dp // ep_size  # the ranks that split one expert's I
    elif ep:
        n = tp * dp
        if s.experts % n:
            warnings.append(f"{s.experts} experts do not divide evenly over EP={n}: the fullest rank holds {math.ceil(s.experts / n)}")
        return warnings, errors
    if i % tp:
        errors.append(f"moe_intermediate_size {i} is not divisible by TP={tp}; use --ep (whole experts per rank) or TP in {[t for t in TP_CANDIDATES if i % t == 0]}")
    elif (i // tp) % BLOCK:
        warnings.append(
            f"moe_intermediate_size / tp = {i}/{tp} = {i // tp} is not a multiple of 128: block scales do not split on block "
            f"boundaries. neuron-w8 handles it by refining the scale grid to {math.gcd(i // tp, BLOCK)}-row tiles (exact, "
            f"more scales); --ep avoids it (whole experts per rank). TP sizes with 128-aligned splits: {ok or 'none'}"
        )
    return warnings, errors


def make_plan(
    config: dict,
    tp: int = 1,
    ep: bool = False,
    dp: int = 1,
    hbm_gb: float | None = None,
    max_model_len: int | None = None,
    mode: str = "pow2",
    kv_dtype_bytes: int = 2,
    utilization: float = DEFAULT_UTILIZATION,
    source: str = "",
    ep_size: int | None = None,
    lnc: int = 2,
    decode_batch: int = DEFAULT_DECODE_BATCH,
) -> dict[str, Any]:
    if tp < 1:
        raise PlanError(f"--tp must be >= 1, got {tp}")
    if lnc not in (1, 2):
        raise PlanError(f"--lnc must be 1 or 2 (Trn2 logical core = 1 or 2 physical cores), got {lnc}")
    if ep_size is not None and not 1 <= ep_size <= tp * dp:
        raise PlanError(f"--ep-size must be between 1 and the {tp * dp} ranks (TP x DP), got {ep_size}")
    ep = ep or ep_size is not None
    if dp < 1:
        raise PlanError(f"--dp must be >= 1, got {dp}")
    s = model_shape(config)
    q = quant_format(config)
    block = q.block if q.kind in ("block", "per-channel", "neuron-w8") and q.block else (BLOCK, BLOCK)
    if q.kind == "neuron-w8" and q.mode:
        mode = q.mode  # a converted checkpoint's scale grid is fixed by its mode
    h, i, e = s.hidden, s.moe_intermediate, s.experts
    L = len(s.moe_layers)
    per_expert = 3 * h * i
    total_codes = L * e * per_expert
    if ep:
        groups = ep_size or tp * dp  # vLLM's EP group is TP x DP
        split = tp * dp // groups  # ranks sharing one expert's intermediate dim (1: whole experts)
        experts_rank = math.ceil(e / groups)
        i_rank = i // split if i % split == 0 else math.ceil(i / split)
        codes_rank = L * experts_rank * 3 * h * i_rank
    else:
        experts_rank = e
        i_rank = i // tp if i % tp == 0 else math.ceil(i / tp)
        codes_rank = L * e * 3 * h * i_rank
    scales_rank = L * experts_rank * expert_scale_bytes(h, i_rank, mode, block)
    scales_total = L * e * expert_scale_bytes(h, i, mode, block)
    other = other_params(s)
    other_rank = 2 * (math.ceil(other["sharded"] / tp) + other["replicated"])
    kv_tok, kv_notes = kv_bytes_per_token(s, tp, kv_dtype_bytes)
    state_seq, state_notes = linear_state_bytes_per_seq(s, tp, 2)
    warnings, errors = tp_advice(s, tp, ep, dp, ep_size)
    if decode_batch < 1:
        raise PlanError(f"--decode-batch must be >= 1, got {decode_batch}")
    decode = [decode_bytes.table(config, s, tp=tp, batch=b, experts_rank=experts_rank, i_rank=i_rank,
                                 expert_scale=expert_scale_bytes(h, i_rank, mode, block)) for b in sorted({1, decode_batch})]

    hbm = (hbm_gb if hbm_gb is not None else DEFAULT_HBM_GB * lnc / 2) * GB
    usable = hbm * utilization
    other_w8 = other_rank - decode_bytes.resident_saving(decode[0])  # decode[0]: batch 1
    w8_rank = codes_rank + scales_rank + other_w8
    bf16_rank = 2 * codes_rank + other_rank
    fit = {}
    for label, weights in (("w8", w8_rank), ("bf16", bf16_rank)):
        free = usable - weights
        entry: dict[str, Any] = {"weights_bytes": int(weights), "free_bytes_for_kv": int(max(free, 0)), "fits": free > 0}
        entry["kv_tokens"] = int(free // kv_tok) if free > 0 and kv_tok else 0
        if max_model_len:
            per_seq = max_model_len * kv_tok + state_seq
            entry["max_sequences_at_max_model_len"] = int(free // per_seq) if free > 0 else 0
        fit[label] = entry
    if not fit["w8"]["fits"]:
        errors.append(f"neuron-w8 weights need {w8_rank / GB:.2f} GB per rank, more than {usable / GB:.2f} GB usable: raise --tp or --hbm-gb")
    elif max_model_len and fit["w8"].get("max_sequences_at_max_model_len", 0) < 1:
        errors.append(f"not one sequence of {max_model_len} tokens fits in the KV cache left per rank; lower --max-model-len or raise --tp")

    assumptions = [
        "GB = 1e9 bytes; routed experts = MoE layers x E x 3·H·I (gate, up, down); FP8 codes 1 B, BF16 2 B",
        (f"EP={ep_size} groups of {tp * dp // ep_size} ranks: ceil(E/EP) experts per rank, each expert's I split over its group" if ep_size
         else "EP (= TP x DP ranks): whole experts per rank (the fullest rank's ceil(E/EP)); attention split by TP" if ep
         else "TP without EP: every expert's intermediate dim split over the ranks"),
        f"neuron-w8 scales float32 on the {mode} grid" + (", refined to gcd(I/tp, 128)-row tiles" if i_rank % BLOCK else ""),
        f"Trn2 LNC={lnc}: {CORES_PER_CHIP // lnc} ranks per chip, {math.ceil(tp * dp * lnc / CORES_PER_CHIP)} chips for {tp * dp} ranks (trn2.48xlarge: 16)",
        "other weights (embeddings, lm_head, attention, dense MLPs, shared experts, routers) estimated from config shapes in BF16; "
        "TP-sharded except routers and MLA down-projections; norms/biases/conv kernels ignored; neuron-w8's fit counts "
        "the dense FP8 layers it serves at 1 byte (decode-bytes table, batch 1) at 1 B plus scales",
        f"usable HBM per rank = {hbm / GB:.2f} GB x utilisation {utilization}",
        f"KV cache dtype {kv_dtype_bytes} B per element",
        *kv_notes,
        *state_notes,
        "MTP layers, vision towers and activation workspace are not counted",
        decode_bytes.ASSUMPTIONS,
    ]
    return {
        "source": source,
        "architecture": s.architecture,
        "tp": tp,
        "dp": dp,
        "ep": ep,
        "ep_size": ep_size or (tp * dp if ep else 1),
        "ranks": tp * dp,
        "lnc": lnc,
        "chips": math.ceil(tp * dp * lnc / CORES_PER_CHIP),
        "mode": mode,
        "shape": {
            "hidden_size": h, "moe_intermediate_size": i, "num_experts": e, "top_k": s.top_k,
            "num_hidden_layers": s.layers, "moe_layers": L, "dense_layers": len(s.dense_layers),
            "dense_layer_spelling": s.dense_spelling, "attention": s.attention,
        },
        "experts_per_rank": experts_rank,
        "moe_intermediate_per_rank": i_rank,
        "expert_bytes_total_w8_codes": total_codes,
        "expert_bytes_total_w8": total_codes + scales_total,
        "expert_bytes_total_bf16": 2 * total_codes,
        "expert_bytes_per_rank_w8_codes": codes_rank,
        "expert_scale_bytes_per_rank": scales_rank,
        "expert_bytes_per_rank_w8": codes_rank + scales_rank,
        "expert_bytes_per_rank_bf16": 2 * codes_rank,
        "other_weight_bytes_per_rank": other_rank,
        "other_weight_bytes_per_rank_w8": other_w8,  # less where neuron-w8 serves the dense FP8 layers at 1 byte
        "kv_bytes_per_token_per_rank": kv_tok,
        "linear_state_bytes_per_sequence_per_rank": state_seq,
        "hbm_bytes_per_rank": int(hbm),
        "max_model_len": max_model_len,
        "fit": fit,
        "decode_bytes": decode,
        "warnings": warnings,
        "errors": errors,
        "assumptions": assumptions,
    }


def format_plan(p: dict[str, Any]) -> str:
    g = lambda b: f"{b / GB:.2f} GB"  # noqa: E731
    sh = p["shape"]
    dp = f" x DP={p['dp']}" if p["dp"] > 1 else ""
    split = (f"TP={p['tp']}{dp}, EP={p['ep_size']} ({p['experts_per_rank']} experts x I {p['moe_intermediate_per_rank']} per rank)" if p["ep"]
             else f"TP={p['tp']}{dp} (I per rank {p['moe_intermediate_per_rank']})")
    lines = [
        f"{p['source'] or p['architecture']}: {p['architecture']}",
        f"  H {sh['hidden_size']}, I {sh['moe_intermediate_size']}, E {sh['num_experts']}, top-{sh['top_k']}, "
        f"{sh['moe_layers']} MoE layers of {sh['num_hidden_layers']} (dense spelling: {sh['dense_layer_spelling']})",
        f"  split: {split}, mode {p['mode']}, LNC={p['lnc']} ({p['chips']} Trn2 chips)",
        "",
        "routed experts              total        per rank",
        f"  neuron-w8 codes       {g(p['expert_bytes_total_w8_codes']):>12} {g(p['expert_bytes_per_rank_w8_codes']):>14}   (the CHECKPOINTS.md figure)",
        f"  neuron-w8 with scales {g(p['expert_bytes_total_w8']):>12} {g(p['expert_bytes_per_rank_w8']):>14}",
        f"  BF16                  {g(p['expert_bytes_total_bf16']):>12} {g(p['expert_bytes_per_rank_bf16']):>14}",
        f"other weights per rank (BF16, estimate): {g(p['other_weight_bytes_per_rank'])}" + (f"; neuron-w8 (its FP8 layers at 1 B): "
        f"{g(p['other_weight_bytes_per_rank_w8'])}" if p["other_weight_bytes_per_rank_w8"] != p["other_weight_bytes_per_rank"] else ""),
        f"KV cache per token per rank: {p['kv_bytes_per_token_per_rank']} B"
        + (f"; linear-attention state per sequence: {p['linear_state_bytes_per_sequence_per_rank'] / 2**20:.1f} MiB" if p["linear_state_bytes_per_sequence_per_rank"] else ""),
        f"HBM per rank: {g(p['hbm_bytes_per_rank'])}",
    ]
    for label in ("w8", "bf16"):
        f = p["fit"][label]
        name = "neuron-w8" if label == "w8" else "BF16 experts"
        if not f["fits"]:
            lines.append(f"  {name:13s}: weights {g(f['weights_bytes'])} per rank -- does NOT fit")
            continue
        extra = f", {f['max_sequences_at_max_model_len']} sequences of {p['max_model_len']} tokens" if p["max_model_len"] else ""
        lines.append(f"  {name:13s}: weights {g(f['weights_bytes'])}, KV room {g(f['free_bytes_for_kv'])} = {f['kv_tokens']:,} tokens (batch x context){extra}")
    lines += decode_bytes.format_tables(p["decode_bytes"])
    for w in p["warnings"]:
        lines.append(f"WARNING: {w}")
    for e in p["errors"]:
        lines.append(f"ERROR: {e}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in p["assumptions"]]
    return "\n".join(lines)


# -- configs/ ----------------------------------------------------------------------------------
def packaged_configs() -> dict[str, Path]:
    """Every ``configs/*.json`` shipped in the package, by file stem."""
    entries = resources.files("vllm_moe_w8.configs").iterdir()
    return dict(sorted((e.name[:-5], Path(str(e))) for e in entries if e.name.endswith(".json")))


def load_model_entry(name: str) -> dict[str, Any]:
    """A packaged model file by stem or by its "name" (case-insensitive)."""
    configs = packaged_configs()
    key = name.lower()
    for stem, path in configs.items():
        entry = json.loads(path.read_text())
        if key in (stem.lower(), str(entry.get("name", "")).lower()):
            entry.setdefault("file", str(path))
            return entry
    raise PlanError(f"no packaged config named {name!r}; choose one of: {', '.join(configs)}")


def resolve_config(target: str | None, config_path: str | None) -> tuple[dict, str]:
    """(config.json dict, description) from a checkpoint folder, a config file, or a packaged name."""
    if config_path:
        p = Path(config_path)
        if not p.is_file():
            raise PlanError(f"{p}: no such config file")
        data = json.loads(p.read_text())
        return (data["config"] if "config" in data and "hidden_size" not in data else data), str(p)
    if target is None:
        raise PlanError("give a checkpoint folder, --config config.json, or a packaged model name")
    p = Path(target)
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise PlanError(f"{cfg}: missing")
        return json.loads(cfg.read_text()), str(p)
    if p.is_file():
        return resolve_config(None, str(p))
    entry = load_model_entry(target)
    return entry["config"], entry.get("name", target)
