"""The non-expert FP8 projections of Qwen3.5-35B-A3B per rank (configs/qwen3.5-35b-a3b.json), as the 1-byte linear
kernel launches them: q+k+v fused (q_proj with its attn_output_gate half) and in_proj_qkv+in_proj_z fused along N,
o_proj and out_proj alone (row-parallel: K sharded). Whole heads per rank; KV heads replicated when there are fewer
than ranks (one per rank). Shared with tests/test_nki_linear.py and benchmarks/bench_linear.py."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen3.5-35b-a3b.json"


def text_config(path: Path = CONFIG) -> dict:
    return json.loads(path.read_text())["config"]["text_config"]


def seed_linears(tp: int = 4, cfg: dict | None = None) -> dict[str, dict]:
    """name -> {"parts": ((part, N), ...), "k": K, "layers": how many layers launch it} for one rank at ``tp``."""
    cfg = cfg or text_config()
    h, heads, kv_heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    types = cfg["layer_types"]
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    kv = max(kv_heads // tp, 1) * hd
    full, linear = types.count("full_attention"), types.count("linear_attention")
    return {
        "attention q+k+v": {"parts": (("q_proj", heads // tp * hd * 2), ("k_proj", kv), ("v_proj", kv)), "k": h,
                            "layers": full},
        "attention o_proj": {"parts": (("o_proj", h),), "k": heads * hd // tp, "layers": full},
        "DeltaNet in_proj_qkv+z": {"parts": (("in_proj_qkv", (2 * key + value) // tp), ("in_proj_z", value // tp)),
                                   "k": h, "layers": linear},
        "DeltaNet out_proj": {"parts": (("out_proj", h),), "k": value // tp, "layers": linear},
    }


def n_of(spec: dict) -> int:
    return sum(n for _name, n in spec["parts"])
