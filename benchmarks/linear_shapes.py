"""The non-expert FP8 projections of Qwen3.5-35B-A3B per rank (configs/qwen3.5-35b-a3b.json), as the 1-byte linear
kernel launches them: q+k+v fused (q_proj with its attn_output_gate half) and in_proj_qkv+in_proj_z fused along N,
o_proj and out_proj alone (row-parallel: K sharded). Whole heads per rank; KV heads replicated when there are fewer
than ranks (one per rank). And checkpoint-like FP8 weights for them. Shared with tests/test_nki_linear.py and the
linear benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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


def checkpoint_linear(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3FN codes [N, K], fp32 scales [N/128, K/128]) like an FP8 checkpoint: each 128x128 block of a random
    weight quantised with amax / 448 - except every third block with amax / 240, which then uses no E4M3FN-only code
    (pow2 keeps it as is)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    tiles = w.reshape(n // 128, 128, k // 128, 128)
    amax = tiles.abs().amax(dim=(1, 3))
    top = torch.full_like(amax, 448.0)
    top.view(-1)[::3] = 240.0
    scale = amax / top
    return (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, k), scale
