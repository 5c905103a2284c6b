"""`vllm-moe-w8 convert`: bit-identical to converting at load time, atomic, resumable, careful with OUT.

The truth for expert tensors is :func:`vllm_moe_w8.codec.fp8.repack` applied to the original checkpoint's
tensors (what the plugin does at load time); everything else must be byte-identical to the source.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_moe_w8.tools import cli
from vllm_moe_w8.codec import fp8
from vllm_moe_w8.codec.checkpoint import INDEX_NAME, Checkpoint, parse_expert_name
from vllm_moe_w8.tools.convert import MANIFEST, convert_checkpoint

pytest.importorskip("tokenizers")
from vllm_moe_w8 import tiny_models  # noqa: E402


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert-src")
    return {
        "qwen3.5-block": tiny_models.write_checkpoint(root / "q35", "qwen3.5-moe", num_shards=3, num_experts=8),
        "glm4-channel": tiny_models.write_checkpoint(root / "glm4c", "glm4-moe", fmt="channel", num_experts=8, num_hidden_layers=2),
        "qwen3-fp32": tiny_models.write_checkpoint(root / "q3", "qwen3-moe", scale_dtype=torch.float32),
    }


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_converted_matches_load_time(src: Path, out: Path, mode: str) -> int:
    """Every expert tensor == fp8.repack of the originals (bit for bit); all else byte-identical."""
    original = _all_tensors(src)
    converted = _all_tensors(out)
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    block = tuple(qc["weight_block_size"]) if qc.get("weight_block_size") else "channel"
    experts = 0
    for name, t in original.items():
        en = parse_expert_name(name)
        if en is not None and en.suffix == "weight" and t.dtype == torch.float8_e4m3fn:
            scale_name = next(f"{en.stem}.{s}" for s in ("weight_scale_inv", "weight_scale") if f"{en.stem}.{s}" in original)
            rep = fp8.repack(t, original[scale_name], mode=mode, block=block, name=name)
            got = converted[name]
            assert got.dtype == torch.uint8 and torch.equal(got, rep.codes), name
            got_s = converted[f"{en.stem}.weight_scale_inv"]
            assert got_s.dtype == torch.float32
            assert torch.equal(got_s, rep.scale_grid.float()), name  # bit-exact (no NaNs in scales)
            experts += 1
        elif en is not None and en.suffix in ("weight_scale_inv", "weight_scale"):
            continue
        else:
            assert torch.equal(converted[name].view(torch.uint8), t.view(torch.uint8)) and converted[name].dtype == t.dtype, name
    expected_names = {n if not n.endswith(".weight_scale") or parse_expert_name(n) is None else n + "_inv" for n in original}
    assert set(converted) == expected_names
    index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    assert set(index) == set(converted)
    for name, fname in index.items():
        with safe_open(str(out / fname), framework="pt") as f:
            assert name in f.keys()
    return experts


@pytest.mark.parametrize("mode", ["pow2", "output-block", "lut"])
def test_block_checkpoint_all_modes_bit_identical(sources, tmp_path, mode):
    src = sources["qwen3.5-block"]
    out = tmp_path / "out"
    report = convert_checkpoint(src, out, mode=mode, progress=False)
    assert report["ok"], report
    n = _assert_converted_matches_load_time(src, out, mode)
    assert n == report["expert_weights_repacked"] == 2 * 8 * 3  # layers x experts x projections
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    src_cfg = json.loads((src / "config.json").read_text())
    assert qc["quant_method"] == "neuron-w8" and qc["mode"] == mode and qc["code_format"] == fp8.CODE_FORMAT[mode]
    assert qc["source"] == src_cfg["quantization_config"]
    assert qc["expert_block_size"] == ([128, 0] if mode == "output-block" else [128, 128])
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == {k: v for k, v in src_cfg.items() if k != "quantization_config"}
    for f in src.iterdir():  # tokenizer, generation config, processor files copied unchanged
        if f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_NAME):
            assert filecmp.cmp(f, out / f.name, shallow=False), f.name
    assert not list(tmp_path.glob("out.partial-*"))


@pytest.mark.parametrize("name", ["glm4-channel", "qwen3-fp32"])
def test_other_formats_pow2(sources, tmp_path, name):
    out = tmp_path / "out"
    report = convert_checkpoint(sources[name], out, mode="pow2", progress=False)
    assert report["ok"], report
    _assert_converted_matches_load_time(sources[name], out, "pow2")
    expected_block = [1, 0] if name == "glm4-channel" else [128, 128]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["expert_block_size"] == expected_block
    # the converted checkpoint passes inspect's validation (scale grids on the recorded tile)
    from vllm_moe_w8.tools.inspect_ckpt import inspect_checkpoint

    r = inspect_checkpoint(out, progress=False)
    assert r["errors"] == [] and r["format"] == "neuron-w8"


def test_interrupted_run_leaves_no_out_and_resumes(sources, tmp_path, monkeypatch):
    import safetensors.torch as st

    src = sources["qwen3.5-block"]
    clean = tmp_path / "clean"
    assert convert_checkpoint(src, clean, progress=False)["ok"]

    out = tmp_path / "out"
    real_save = st.save_file
    calls = {"n": 0}

    def dying_save(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            Path(filename).write_bytes(b"half a shard")  # a torn write, then the interrupt
            raise KeyboardInterrupt
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(st, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, out, progress=False)
    monkeypatch.setattr(st, "save_file", real_save)
    assert not out.exists()
    partials = list(tmp_path.glob("out.partial-*"))
    assert len(partials) == 1

    report = convert_checkpoint(src, out, progress=False)
    assert report["ok"] and report["shards_resumed"] == 1 and report["shards"] == 3
    assert not list(tmp_path.glob("out.partial-*"))
    for f in clean.iterdir():
        if f.name != MANIFEST:
            assert filecmp.cmp(f, out / f.name, shallow=False), f.name
    _assert_converted_matches_load_time(src, out, "pow2")


def test_out_protection_and_force(sources, tmp_path, capsys):
    src = sources["qwen3-fp32"]
    out = tmp_path / "out"
    assert cli.main(["convert", str(src), str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["convert", str(src), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["up_to_date"] is True
    # different settings: refused, OUT untouched
    before = (out / "model-00001-of-00002.safetensors").read_bytes()
    assert cli.main(["convert", str(src), str(out), "--mode", "lut", "--quiet"]) == 1
    assert "--force" in capsys.readouterr().err
    assert (out / "model-00001-of-00002.safetensors").read_bytes() == before
    # a folder that is not a conversion: refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert cli.main(["convert", str(src), str(other), "--quiet"]) == 1
    assert (other / "notes.txt").read_text() == "mine"
    # --force replaces it
    assert cli.main(["convert", str(src), str(out), "--mode", "lut", "--force", "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["mode"] == "lut"
    assert not list(tmp_path.glob("out.old-*")) and not list(tmp_path.glob("out.partial-*"))
    # a converted checkpoint cannot be converted again
    assert cli.main(["convert", str(out), str(tmp_path / "again"), "--quiet"]) == 1
    assert "already a neuron-w8" in capsys.readouterr().err


def test_tp_ep_validation_is_recorded(sources, tmp_path, capsys):
    src = sources["qwen3-fp32"]  # I = 384
    assert cli.main(["convert", str(src), str(tmp_path / "bad"), "--tp", "5", "--quiet"]) == 1
    assert "not divisible by TP=5" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert cli.main(["convert", str(src), str(tmp_path / "tp2"), "--tp", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert any("384/2 = 192" in w for w in r["warnings"])
    qc = json.loads((tmp_path / "tp2" / "config.json").read_text())["quantization_config"]
    assert qc["converted_for"] == {"tp": 2, "ep": False}


def test_scale_in_another_shard(sources, tmp_path):
    """A weight and its scale in different shards (the index decides, not shard numbers)."""
    src = tmp_path / "split"
    ref = sources["qwen3-fp32"]
    import shutil

    shutil.copytree(ref, src)
    index = json.loads((src / INDEX_NAME).read_text())
    wm = index["weight_map"]
    moved = next(n for n in wm if n.endswith("experts.0.gate_proj.weight_scale_inv"))
    src_file = wm[moved]
    dst_file = next(f for f in set(wm.values()) if f != src_file)
    a, b = load_file(str(src / src_file)), load_file(str(src / dst_file))
    b[moved] = a.pop(moved)
    save_file(a, str(src / src_file), metadata={"format": "pt"})
    save_file(b, str(src / dst_file), metadata={"format": "pt"})
    wm[moved] = dst_file
    (src / INDEX_NAME).write_text(json.dumps(index))
    out = tmp_path / "out"
    assert convert_checkpoint(src, out, progress=False)["ok"]
    _assert_converted_matches_load_time(src, out, "pow2")
    assert json.loads((out / INDEX_NAME).read_text())["weight_map"][moved] == dst_file
    assert Checkpoint(out).problems == []
