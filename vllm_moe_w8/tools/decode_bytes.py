"""Weight bytes read per decoded token per rank: all BF16, neuron-w8's experts only, every FP8 layer at 1 byte.

A decode step reads every dense weight of a rank once and each routed expert it was routed to; at batch B a
token's share is the step's bytes / B. Decode is bandwidth-bound at small B, so the ratio of two columns is the
ceiling of the speed-up the smaller one can bring, however good its kernels. Computed from ``config.json``
alone (the same shapes as ``plan``, :mod:`vllm_moe_w8.tools.model_shape`); the model, stated in every report:

* the rows: routed experts; full attention (q/k/v/o; Qwen3.5's q carries its output gate, twice the width; KV
  heads fewer than TP are replicated, one per rank; MLA's latent projections replicated); linear attention (Gated
  DeltaNet in_proj_qkv / in_proj_z / out_proj); the shared expert; dense MLP layers; what the checkpoint keeps
  BF16 (the LM head - vocab split by TP -, the routers, in_proj_a/b, conv1d, shared_expert_gate - replicated).
  A projection the checkpoint's skip list (``modules_to_not_convert``) names is BF16 in every column;
* FP8 at 1 byte per weight plus one float32 scale per 128x128 block of the rank's shard (the routed experts:
  the mode's grid, as ``plan``); BF16 2 bytes; norms, biases and the token's embedding row are not counted;
* routed experts: each token picks ``top_k`` distinct experts uniformly (no routing skew); a rank reads each of
  its local experts at least one token of the step picked, so ``local x (1 - (1 - k/E)^B)`` expert shards per MoE
  layer in expectation (at B = 1 exactly ``k`` shards of I/TP, or ``k/EP`` whole experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_moe_w8.codec.model_config import quant_format, text_config
from vllm_moe_w8.tools.model_shape import ModelShape

BLOCK = 128
SCALE_BYTES = 4
COLUMNS = ("bf16", "experts_only", "all_fp8_1byte")
COLUMN_TITLES = {"bf16": "all BF16", "experts_only": "experts 1 B", "all_fp8_1byte": "all FP8 1 B"}
# What neuron-w8 reads on vllm-neuron per family (and why), after issue #34.
SERVED = {
    "Qwen3_5MoeForConditionalGeneration": ("all_fp8_1byte", "neuron-w8 runs the routed experts, the shared expert and "
                                           "the attention / Gated-DeltaNet projections at 1 byte (opt-out: "
                                           "non_expert_layers bf16 reads the experts-only column)"),
    "Qwen3MoeForCausalLM": ("experts_only", "its attention runs inside nkilib's fused kernels (qkv, attention_block_tkg), "
                            "which take BF16 weights: only the experts are 1 byte"),
}


@dataclass(frozen=True)
class Weights:
    """``count`` matrices of ``rows`` x ``cols`` per rank; ``fp8``: stored FP8 in the checkpoint."""

    rows: int
    cols: int
    count: int
    fp8: bool

    def nbytes(self, one_byte: bool) -> int:
        if not one_byte or not self.fp8:
            return 2 * self.rows * self.cols * self.count
        scales = math.ceil(self.rows / BLOCK) * math.ceil(self.cols / BLOCK) * SCALE_BYTES
        return (self.rows * self.cols + scales) * self.count


def _skipped(skip: list[str], module: str) -> bool:
    """The checkpoint keeps ``module`` (a path like ``self_attn.q_proj``) in BF16: a skip entry names it at
    component boundaries (``mlp.gate`` names the router, not ``mlp.gate_proj``)."""
    path = f".{module}."
    return any(f".{entry.strip('.')}." in path for entry in skip)


def _rows(s: ModelShape, cfg: dict, skip: list[str], tp: int) -> list[tuple[str, list[Weights]]]:
    """(row label, matrices per rank) of every dense row, in the table's order (routed experts excluded)."""
    h, a = s.hidden, s.attention
    fp8 = lambda module: not _skipped(skip, module)  # noqa: E731
    out: list[tuple[str, list[Weights]]] = []
    full = a["full_layers"]
    if full and a["kind"] == "mla":
        qk, heads = a["qk_nope_head_dim"] + a["qk_rope_head_dim"], a["heads"] // tp
        m = [Weights(a["kv_lora_rank"] + a["qk_rope_head_dim"], h, full, fp8("self_attn.kv_a_proj_with_mqa")),
             Weights(heads * (a["qk_nope_head_dim"] + a["v_head_dim"]), a["kv_lora_rank"], full, fp8("self_attn.kv_b_proj")),
             Weights(h, heads * a["v_head_dim"], full, fp8("self_attn.o_proj"))]
        if a["q_lora_rank"]:
            m += [Weights(a["q_lora_rank"], h, full, fp8("self_attn.q_a_proj")),
                  Weights(heads * qk, a["q_lora_rank"], full, fp8("self_attn.q_b_proj"))]
        else:
            m.append(Weights(heads * qk, h, full, fp8("self_attn.q_proj")))
        out.append((f"MLA attention projections ({full} layers)", m))
    elif full:
        d, heads = a["head_dim"], a["heads"] // tp
        kv = max(1, a["kv_heads"] // tp)
        gate = 2 if a.get("gated_q") else 1
        out.append((f"full attention q/k/v/o ({full} layers)",
                    [Weights(gate * heads * d, h, full, fp8("self_attn.q_proj")),
                     Weights(kv * d, h, full, fp8("self_attn.k_proj")), Weights(kv * d, h, full, fp8("self_attn.v_proj")),
                     Weights(h, heads * d, full, fp8("self_attn.o_proj"))]))
    lin, n_lin = a.get("linear"), a["linear_layers"]
    if lin and n_lin:
        kdim, vdim = lin["key_heads"] * lin["key_dim"] // tp, lin["value_heads"] * lin["value_dim"] // tp
        name = "Gated-DeltaNet" if lin["kind"] == "gated-deltanet" else "KDA (counted with Gated-DeltaNet's shapes)"
        out.append((f"{name} in_proj_qkv / in_proj_z / out_proj ({n_lin} layers)",
                    [Weights(2 * kdim + vdim, h, n_lin, fp8("linear_attn.in_proj_qkv")),
                     Weights(vdim, h, n_lin, fp8("linear_attn.in_proj_z")),
                     Weights(h, vdim, n_lin, fp8("linear_attn.out_proj"))]))
    moe = len(s.moe_layers)
    if s.shared_intermediate and moe:
        si = math.ceil(s.shared_intermediate / tp)
        stem = "mlp.shared_expert" if cfg.get("shared_expert_intermediate_size") else "mlp.shared_experts"
        out.append((f"shared expert gate/up/down ({moe} layers)",
                    [Weights(si, h, moe, fp8(f"{stem}.gate_proj")), Weights(si, h, moe, fp8(f"{stem}.up_proj")),
                     Weights(h, si, moe, fp8(f"{stem}.down_proj"))]))
    dense = len(s.dense_layers)
    if dense and s.dense_intermediate:
        di = math.ceil(s.dense_intermediate / tp)
        out.append((f"dense MLP gate/up/down ({dense} layers)",
                    [Weights(di, h, dense, fp8("mlp.gate_proj")), Weights(di, h, dense, fp8("mlp.up_proj")),
                     Weights(h, di, dense, fp8("mlp.down_proj"))]))
    kept, names = [Weights(math.ceil(s.vocab / tp), h, 1, False), Weights(s.experts, h, moe, False)], ["LM head", "routers"]
    if lin and n_lin and lin["kind"] == "gated-deltanet":
        conv = (2 * lin["key_heads"] * lin["key_dim"] + lin["value_heads"] * lin["value_dim"]) // tp
        kept += [Weights(2 * lin["value_heads"] // tp, h, n_lin, False), Weights(conv, lin["conv_kernel"], n_lin, False)]
        names += ["in_proj_ba", "conv1d"]
    if cfg.get("shared_expert_intermediate_size") and moe:
        kept.append(Weights(1, h, moe, False))
        names.append("shared_expert_gate")
    out.append((f"BF16 in the checkpoint ({', '.join(names)})", kept))
    return out


def expected_local_experts(local: int, experts: int, top_k: int, batch: int) -> float:
    """Expected local experts a step of ``batch`` tokens routes to (each token: ``top_k`` distinct of ``experts``,
    uniform, independent)."""
    return local * (1.0 - (1.0 - top_k / experts) ** batch)


def table(config: dict, s: ModelShape, *, tp: int, batch: int, experts_rank: int, i_rank: int, expert_scale: int) -> dict:
    """Bytes per decoded token per rank at ``batch``: one row per weight group, one value per column (COLUMNS).
    ``experts_rank`` / ``i_rank`` / ``expert_scale``: the rank's local experts, their I and one expert's w8 scale
    bytes (``plan``'s EP/TP split and scale grid)."""
    if batch < 1:
        raise ValueError(f"decode batch must be >= 1, got {batch}")
    cfg, skip = text_config(config), quant_format(config).skip
    moe = len(s.moe_layers)
    touched = expected_local_experts(experts_rank, s.experts, s.top_k, batch) * moe
    codes = 3 * s.hidden * i_rank
    routed = {"bf16": 2 * codes * touched, "experts_only": (codes + expert_scale) * touched,
              "all_fp8_1byte": (codes + expert_scale) * touched}
    rows = [{"what": f"routed experts (top-{s.top_k} of {s.experts}, {moe} layers)",
             **{c: routed[c] / batch for c in COLUMNS}}]
    for label, weights in _rows(s, cfg, skip, tp):
        bf16 = sum(w.nbytes(False) for w in weights)
        rows.append({"what": label, "bf16": bf16 / batch, "experts_only": bf16 / batch,
                     "all_fp8_1byte": sum(w.nbytes(True) for w in weights) / batch})
    total = {c: sum(r[c] for r in rows) for c in COLUMNS}
    served = SERVED.get(s.architecture)
    return {"batch": batch, "rows": rows, "total": total,
            "ratio_to_bf16": {c: total[c] / total["bf16"] for c in COLUMNS},
            "expected_experts_per_layer": touched / moe if moe else 0.0,
            "served_on_vllm_neuron": served[0] if served else None,
            "served_note": served[1] if served else "not adopted on vllm-neuron by neuron-w8"}


def resident_saving(t: dict) -> int:
    """HBM bytes per rank neuron-w8's 1-byte dense layers save where it serves them (``SERVED``: every FP8 layer at 1
    byte), from the batch-1 table ``t``: a batch-1 step reads each dense weight once, so the dense rows' bytes are
    their resident bytes; the routed rows are equal in the two columns."""
    if t["batch"] != 1 or t["served_on_vllm_neuron"] != "all_fp8_1byte":
        return 0
    return round(t["total"]["experts_only"] - t["total"]["all_fp8_1byte"])


ASSUMPTIONS = (
    "decode bytes: weight bytes read per decoded token per rank (MB = 1e6 B) = what one step reads / batch; every "
    "dense weight once per step, each routed local expert at least one token picked (uniform top-k routing, no "
    "skew); FP8 1 B + a float32 scale per 128x128 block, BF16 2 B; norms, biases, the token's embedding row, KV cache "
    "and recurrent state not counted; bandwidth-bound decode: a column's ratio to BF16 bounds its speed-up"
)


def format_tables(tables: list[dict]) -> list[str]:
    mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
    lines = []
    for t in tables:
        lines.append(f"weight bytes read per decoded token per rank, batch {t['batch']} (MB; expected "
                     f"{t['expected_experts_per_layer']:.2f} routed expert shards per MoE layer and step):")
        width = max(len(r["what"]) for r in t["rows"]) + 2
        lines.append(f"  {'':{width}}" + "".join(f"{COLUMN_TITLES[c]:>17}" for c in COLUMNS))
        for r in t["rows"]:
            lines.append(f"  {r['what']:{width}}" + "".join(f"{mb(r[c]):>17}" for c in COLUMNS))
        totals = [f"{mb(t['total'][c])} ({t['ratio_to_bf16'][c]:.2f}x)" for c in COLUMNS]
        lines.append(f"  {'total':{width}}" + "".join(f"{v:>17}" for v in totals))
    if tables:
        t = tables[0]
        served = t["served_on_vllm_neuron"]
        lines.append(f"neuron-w8 on vllm-neuron reads the column {COLUMN_TITLES[served]!r}: {t['served_note']}" if served
                     else f"neuron-w8 on vllm-neuron: {t['served_note']}")
    return lines
