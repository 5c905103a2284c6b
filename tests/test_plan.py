"""`vllm-moe-w8 plan`: the published routed-expert figures, dense-layer spellings, KV models, TP advice.

The published routed-expert table (configs/README.md, copied from the project's checkpoint notes) is the
independent truth for the packaged configs' numbers; a converted tiny checkpoint's real tensor bytes are the truth for the scale model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_moe_w8.tools import cli
from vllm_moe_w8.tools.model_shape import PlanError, model_shape, moe_layer_indices
from vllm_moe_w8.tools.plan import load_model_entry, make_plan, packaged_configs

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "configs" / "README.md"
# The table prints GB with two decimals: a figure is right when it rounds to the printed value.
TABLE_ROUNDING_GB = 0.005 + 1e-9


def _table_rows() -> list[dict]:
    path = TABLE
    lines = path.read_text().splitlines()
    start = lines.index("<!-- routed-expert-table -->")
    header_i = next(i for i, l in enumerate(lines) if i > start and l.startswith("| model |"))
    head = [c.strip() for c in lines[header_i].strip("|").split("|")]
    rows = []
    for line in lines[header_i + 2:]:
        if not line.startswith("|"):
            break
        cells = [re.sub(r"\*", "", c).strip() for c in line.strip("|").split("|")]
        rows.append(dict(zip(head, cells)))
    assert rows, f"{path}: no rows under the routed-expert table header"
    return rows


def _entry_for(model: str) -> dict:
    for stem in packaged_configs():
        entry = load_model_entry(stem)
        if entry["name"] == model:
            return entry
    raise AssertionError(f"no packaged config has name {model!r}; configs: {list(packaged_configs())}")


def test_plan_reproduces_every_row_of_the_checkpoints_table():
    rows = _table_rows()
    for row in rows:
        entry = _entry_for(row["model"])
        shape = model_shape(entry["config"])
        assert shape.architecture == (row["arch"] if row["arch"] != "same" else shape.architecture), row["model"]
        assert (shape.hidden, len(shape.moe_layers), shape.experts, shape.top_k, shape.moe_intermediate) == (
            int(row["H"]), int(row["MoE layers"]), int(row["E"]), int(row["top-k"]), int(row["I"])), row["model"]
        one = make_plan(entry["config"], tp=1)
        assert abs(one["expert_bytes_total_w8_codes"] / 1e9 - float(row["FP8 GB"])) <= TABLE_ROUNDING_GB, row["model"]
        assert abs(one["expert_bytes_total_bf16"] / 1e9 - float(row["BF16 GB"])) <= TABLE_ROUNDING_GB, row["model"]
        for col, ranks in (("FP8/rank @8", 8), ("@16", 16), ("@32", 32)):
            for ep in (True, False):  # E and I of every table model divide 8/16/32: both splits give total / ranks
                p = make_plan(entry["config"], tp=ranks, ep=ep)
                got = p["expert_bytes_per_rank_w8_codes"] / 1e9
                assert abs(got - float(row[col])) <= TABLE_ROUNDING_GB, (row["model"], ranks, ep, got, row[col])
                assert p["expert_bytes_per_rank_bf16"] == 2 * p["expert_bytes_per_rank_w8_codes"]
                assert p["expert_bytes_per_rank_w8"] > p["expert_bytes_per_rank_w8_codes"]  # scales on top
    assert {r["model"] for r in rows} == {load_model_entry(s)["name"] for s in packaged_configs()}, "a model without a config or a config without a row"


def test_glm53_flash_quoted_figure_through_the_cli(capsys):
    assert cli.main(["plan", "glm-5.3-flash", "--tp", "32", "--ep", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert round(p["expert_bytes_per_rank_w8_codes"] / 1e9, 2) == 9.51
    assert round(p["expert_bytes_per_rank_bf16"] / 1e9, 2) == 19.03
    assert p["experts_per_rank"] == 9
    assert p["shape"]["dense_layer_spelling"] == "mlp_layer_types"
    assert cli.main(["plan", "glm-5.3-flash", "--tp", "32", "--ep"]) == 0
    text = capsys.readouterr().out
    assert "9.51 GB" in text and "19.03 GB" in text and "assumptions:" in text


def test_dense_layer_spellings():
    assert moe_layer_indices({"num_hidden_layers": 6, "first_k_dense_replace": 2})[0] == [2, 3, 4, 5]
    assert moe_layer_indices({"num_hidden_layers": 6, "mlp_only_layers": [1], "decoder_sparse_step": 2})[0] == [3, 5]
    assert moe_layer_indices({"num_hidden_layers": 4, "mlp_only_layers": [], "decoder_sparse_step": 1})[0] == [0, 1, 2, 3]
    types = ["dense", "sparse", "dense", "sparse"]
    assert moe_layer_indices({"num_hidden_layers": 4, "mlp_layer_types": types})[0] == [1, 3]
    with pytest.raises(PlanError, match="mlp_layer_types has 4 entries"):
        moe_layer_indices({"num_hidden_layers": 5, "mlp_layer_types": types})


def test_kv_cache_models():
    # Standard GQA, Qwen3-30B-A3B: 2 (K,V) x 4 KV heads x 128 x 2 B x 48 layers; at TP 8 one (replicated) head per rank
    q3 = load_model_entry("qwen3-30b-a3b")["config"]
    assert make_plan(q3, tp=1)["kv_bytes_per_token_per_rank"] == 2 * 4 * 128 * 2 * 48
    assert make_plan(q3, tp=2)["kv_bytes_per_token_per_rank"] == 2 * 2 * 128 * 2 * 48
    assert make_plan(q3, tp=8)["kv_bytes_per_token_per_rank"] == 2 * 1 * 128 * 2 * 48
    assert make_plan(q3, tp=1, kv_dtype_bytes=1)["kv_bytes_per_token_per_rank"] == 2 * 4 * 128 * 1 * 48
    # Qwen3.5 hybrid: only the 10 full-attention layers of 40 keep per-token K/V; the rest a fixed state
    q35 = make_plan(load_model_entry("qwen3.5-35b-a3b")["config"], tp=1)
    assert q35["kv_bytes_per_token_per_rank"] == 2 * 2 * 256 * 2 * 10
    assert q35["linear_state_bytes_per_sequence_per_rank"] > 0
    # MLA (GLM-5): latent 512 + rope 64 per layer in bf16, replicated over TP, plus the FP8 indexer key
    glm5 = load_model_entry("glm-5")["config"]
    for tp in (1, 8):
        assert make_plan(glm5, tp=tp)["kv_bytes_per_token_per_rank"] == 78 * ((512 + 64) * 2 + 128 + 4)
    # KV tokens that fit = free bytes // bytes per token
    p = make_plan(q3, tp=4, ep=True, hbm_gb=24, max_model_len=4096)
    f = p["fit"]["w8"]
    assert f["kv_tokens"] == f["free_bytes_for_kv"] // p["kv_bytes_per_token_per_rank"]
    assert f["max_sequences_at_max_model_len"] == f["free_bytes_for_kv"] // (4096 * p["kv_bytes_per_token_per_rank"])
    assert p["fit"]["bf16"]["kv_tokens"] < f["kv_tokens"]


def test_tp_advice():
    q235 = load_model_entry("qwen3-235b-a22b")["config"]
    p = make_plan(q235, tp=8)
    assert len(p["warnings"]) == 1 and "1536/8 = 192" in p["warnings"][0] and "[1, 2, 4]" in p["warnings"][0]
    assert "refining the scale grid to 64-row tiles" in p["warnings"][0] and "--ep" in p["warnings"][0]
    assert make_plan(q235, tp=8, ep=True)["warnings"] == []
    flash = load_model_entry("glm-5.3-flash")["config"]
    assert make_plan(flash, tp=16, hbm_gb=1000)["warnings"] == []  # 2048 / 16 = 128
    bad = make_plan(q235, tp=5, hbm_gb=1000)
    assert bad["errors"] and "not divisible by TP=5" in bad["errors"][0]
    # CHECKPOINTS.md: I/tp is 128-aligned only for Qwen3.5-122B/397B at TP8 and GLM-5 / 5.3-Flash at TP8/16
    aligned = {(s, tp) for s in packaged_configs() for tp in (8, 16, 32)
               if not make_plan(load_model_entry(s)["config"], tp=tp, hbm_gb=1e4)["warnings"]}
    assert aligned == {("qwen3.5-122b-a10b", 8), ("qwen3.5-397b-a17b", 8), ("glm-5", 8), ("glm-5", 16),
                       ("glm-5.3-flash", 8), ("glm-5.3-flash", 16)}


def test_plan_exit_codes_and_inputs(tmp_path, capsys):
    assert cli.main(["plan", "no-such-model"]) == 1
    assert "no packaged config named" in capsys.readouterr().err
    # Does not fit: exit 1 with the reason
    assert cli.main(["plan", "glm-5", "--tp", "8", "--ep", "--json"]) == 1
    assert "raise --tp" in json.loads(capsys.readouterr().out)["errors"][0]
    # --config with a plain config.json, and a folder holding it, give the same plan
    cfg = load_model_entry("qwen3-30b-a3b")["config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["plan", "--config", str(tmp_path / "config.json"), "--tp", "4", "--ep", "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", str(tmp_path), "--tp", "4", "--ep", "--json"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}
    assert a["expert_bytes_per_rank_w8"] and a["expert_bytes_per_rank_bf16"]


def test_scale_model_matches_a_converted_checkpoint(tmp_path):
    """The plan's with-scales bytes equal the bytes `convert` actually writes (pow2 and output-block)."""
    pytest.importorskip("tokenizers")
    from vllm_moe_w8 import tiny_models
    from vllm_moe_w8.codec.checkpoint import Checkpoint
    from vllm_moe_w8.tools.convert import convert_checkpoint

    src = tiny_models.write_checkpoint(tmp_path / "src", "qwen3-moe")
    for mode in ("pow2", "output-block"):
        out = tmp_path / f"out-{mode}"
        assert convert_checkpoint(src, out, mode=mode, progress=False)["ok"]
        ck = Checkpoint(out)
        codes = sum(i.nbytes for en, i in ck.experts() if en.suffix == "weight")
        scales = sum(i.nbytes for en, i in ck.experts() if en.suffix == "weight_scale_inv")
        p = make_plan(ck.config, tp=1)  # the converted config says its mode
        assert p["mode"] == mode
        assert p["expert_bytes_total_w8_codes"] == codes
        assert p["expert_bytes_total_w8"] == codes + scales


def test_every_packaged_config_documents_itself_and_its_recommendation_fits():
    for stem in packaged_configs():
        entry = load_model_entry(stem)
        assert entry["notes"]["source"] and isinstance(entry["notes"]["assumed"], list), stem
        rec = entry["recommended"]
        for key in ("instance", "tp", "dp", "ep", "lnc", "mode", "batch_buckets", "reasoning", "hbm_gb_per_rank", "plan"):
            assert key in rec, (stem, key)
        p = make_plan(entry["config"], tp=rec["tp"], dp=rec["dp"], ep=rec["ep"], hbm_gb=rec["hbm_gb_per_rank"],
                      mode=rec["mode"], max_model_len=8192)
        assert p["errors"] == [] and p["fit"]["w8"]["max_sequences_at_max_model_len"] >= max(rec["batch_buckets"]) // 8, stem
        assert p["fit"]["w8"]["kv_tokens"] > p["fit"]["bf16"]["kv_tokens"], stem  # the point of 1-byte experts
        argv = rec["plan"].split()[1:] + ["--json"]
        assert argv[:2] == ["plan", stem]
        assert cli.main(argv) == 0, stem


def test_dp_spreads_experts_only_with_ep():
    cfg = load_model_entry("qwen3.5-397b-a17b")["config"]
    a = make_plan(cfg, tp=16, dp=2, ep=True, hbm_gb=1e4)
    b = make_plan(cfg, tp=32, ep=True, hbm_gb=1e4)
    assert a["expert_bytes_per_rank_w8_codes"] == b["expert_bytes_per_rank_w8_codes"] and a["experts_per_rank"] == 16
    assert a["kv_bytes_per_token_per_rank"] == make_plan(cfg, tp=16, hbm_gb=1e4)["kv_bytes_per_token_per_rank"]
    assert make_plan(cfg, tp=16, dp=2, hbm_gb=1e4)["expert_bytes_per_rank_w8_codes"] == make_plan(cfg, tp=16, hbm_gb=1e4)["expert_bytes_per_rank_w8_codes"]
    assert b["errors"] and "linear-attention heads" in b["errors"][0]


# -- the GLM layouts on Trainium2 (issue #22) ---------------------------------------------------------------------
def _glm_expert_codes(cfg: dict, experts: int, i_rank: int) -> int:
    """Routed-expert code bytes of one rank, straight from config.json's fields (independent of model_shape)."""
    t = cfg.get("text_config", cfg)
    types = t.get("mlp_layer_types")
    moe_layers = types.count("sparse") if types else t["num_hidden_layers"] - t["first_k_dense_replace"]
    return moe_layers * experts * 3 * t["hidden_size"] * i_rank


def test_every_recorded_glm_layout_plans_as_its_source_states():
    """configs/*.json ``layouts``: the seed's TP=32/EP=32 and the fork's registered layouts (E_local, I per rank
    as the fork states them), through the CLI line recorded beside them."""
    seen = 0
    for stem in packaged_configs():
        entry = load_model_entry(stem)
        for lay in entry.get("layouts", []):
            seen += 1
            p = make_plan(entry["config"], tp=lay["tp"], ep_size=lay["ep_size"], lnc=lay["lnc"])
            assert (p["experts_per_rank"], p["moe_intermediate_per_rank"]) == (lay["experts_per_rank"], lay["moe_intermediate_per_rank"]), (stem, lay["name"])
            assert p["expert_bytes_per_rank_w8_codes"] == _glm_expert_codes(entry["config"], lay["experts_per_rank"], lay["moe_intermediate_per_rank"])
            assert p["chips"] <= 16 and p["errors"] == [], (stem, lay["name"], p["errors"])  # fits one trn2.48xlarge
            argv = lay["plan"].split()[1:] + ["--json"]
            assert cli.main(argv) == 0
    assert seen >= 3


def test_ep_size_layout_of_the_fork(capsys):
    flash = load_model_entry("glm-5.3-flash")["config"]
    p = make_plan(flash, tp=64, ep_size=16)
    assert (p["experts_per_rank"], p["moe_intermediate_per_rank"], p["ep_size"], p["chips"]) == (288 // 16, 2048 // 4, 16, 16)
    # 128x128 float32 scales: 3 projections x (512/128) x (4096/128) tiles per expert
    assert p["expert_scale_bytes_per_rank"] == 42 * 18 * 3 * (512 // 128) * (4096 // 128) * 4
    assert p["warnings"] == []  # 512 is 128-aligned: the fork's blocks split cleanly
    # ep_size = ranks is plain --ep; ep_size = 1 is plain TP (every rank holds a slice of every expert)
    drop = lambda p: {k: v for k, v in p.items() if k != "assumptions"}  # noqa: E731
    assert drop(make_plan(flash, tp=32, ep_size=32)) == drop(make_plan(flash, tp=32, ep=True))
    tp_only = make_plan(flash, tp=16, hbm_gb=1e4)
    assert make_plan(flash, tp=16, ep_size=1, hbm_gb=1e4)["expert_bytes_per_rank_w8_codes"] == tp_only["expert_bytes_per_rank_w8_codes"]
    # a group split that is not 128-aligned warns, as plain TP does (2048 / 32 = 64)
    assert "64 is not a multiple of 128" in make_plan(flash, tp=64, ep_size=2, hbm_gb=1e4)["warnings"][0]
    assert cli.main(["plan", "glm-5.3-flash", "--tp", "64", "--ep-size", "16"]) == 0
    assert "EP=16 (18 experts x I 512 per rank)" in capsys.readouterr().out


def test_lnc_and_bad_ep_size(capsys):
    flash = load_model_entry("glm-5.3-flash")["config"]
    two, one = make_plan(flash, tp=32, ep=True, lnc=2), make_plan(flash, tp=32, ep=True, lnc=1)
    assert one["hbm_bytes_per_rank"] * 2 == pytest.approx(two["hbm_bytes_per_rank"], rel=1e-12)
    assert (two["chips"], one["chips"]) == (8, 4)
    bad = make_plan(flash, tp=64, ep_size=24, hbm_gb=1e4)
    assert bad["errors"] and "--ep-size 24 does not divide the 64 ranks" in bad["errors"][0]
    with pytest.raises(PlanError, match="--ep-size must be between 1 and the 32 ranks"):
        make_plan(flash, tp=32, ep_size=64)
    with pytest.raises(PlanError, match="--lnc must be 1 or 2"):
        make_plan(flash, tp=32, lnc=4)
    assert cli.main(["plan", "glm-5.3-flash", "--tp", "32", "--ep-size", "64"]) == 1
    assert "--ep-size must be between" in capsys.readouterr().err
