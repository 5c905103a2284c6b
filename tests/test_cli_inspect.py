"""`vllm-moe-w8 inspect`: the report of a good checkpoint, and a clear non-zero exit on each breakage.

The scan's figures are checked against numpy/ml_dtypes reading the same safetensors files.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from vllm_moe_w8.tools import cli
from vllm_moe_w8.codec.checkpoint import INDEX_NAME

pytest.importorskip("tokenizers")
from vllm_moe_w8 import tiny_models  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return tiny_models.write_checkpoint(tmp_path_factory.mktemp("inspect") / "q3", "qwen3-moe", num_shards=3)


@pytest.fixture
def broken(good, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def _run(capsys, *argv) -> tuple[int, dict]:
    rc = cli.main(["inspect", *map(str, argv), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _expert_weight_names(path: Path) -> list[str]:
    wm = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    return sorted(n for n in wm if ".mlp.experts." in n and n.endswith("_proj.weight"))


def _rewrite(path: Path, name: str, fn) -> str:
    """Apply ``fn(tensors_of_its_shard)`` to the shard holding ``name``; return the shard file name."""
    wm = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    fname = wm[name]
    tensors = load_file(str(path / fname))
    fn(tensors)
    save_file(tensors, str(path / fname), metadata={"format": "pt"})
    return fname


def _raw_u8_tensors(path: Path) -> dict[str, np.ndarray]:
    """1-byte tensors of a safetensors file read straight from its bytes (the format's spec, no library)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name != "__metadata__" and meta["dtype"] in ("F8_E4M3", "U8"):
            a, b = meta["data_offsets"]
            out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], np.uint8).reshape(meta["shape"])
    return out


def test_report_of_a_good_checkpoint(good, capsys):
    rc, r = _run(capsys, good, "--scan")
    assert rc == 0 and r["errors"] == []
    cfg = json.loads((good / "config.json").read_text())
    assert r["architecture"] == "Qwen3MoeForCausalLM" and r["supported"]
    assert r["format"] == "block" and r["weight_block_size"] == [128, 128]
    assert (r["num_experts"], r["top_k"], r["hidden_size"]) == (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"])
    assert r["shards"] == 3
    h, i, e, layers = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], cfg["num_hidden_layers"]
    assert r["expert_weight_shapes"] == {f"gate_proj [{i}, {h}]": e * layers, f"up_proj [{i}, {h}]": e * layers,
                                         f"down_proj [{h}, {i}]": e * layers}
    assert r["expert_scales"] == {f"weight_scale_inv BF16 [{math.ceil(i / 128)}, {math.ceil(h / 128)}]": 2 * e * layers,
                                  f"weight_scale_inv BF16 [{math.ceil(h / 128)}, {math.ceil(i / 128)}]": e * layers}
    assert any(p.startswith("model.layers.{n}.mlp.gate.weight") for p in r["kept_2d_patterns"])
    assert "lm_head.weight (BF16)" in r["kept_2d_patterns"]

    # The scan against an independent reading: numpy bytes, ml_dtypes for which codes are e4m3fn-only
    fn_only = [c for c in range(0x78, 0x7F)
               if np.isfinite(np.array([c], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))[0]
               and not np.isfinite(np.array([c], np.uint8).view(ml_dtypes.float8_e4m3).astype(np.float32))[0]]
    assert fn_only == list(range(0x78, 0x7F))
    tiles = shifted = 0
    hist = {f"0x{c:02X}": 0 for c in fn_only}
    for f in sorted(good.glob("*.safetensors")):
        for name, arr in _raw_u8_tensors(f).items():
            if ".mlp.experts." not in name or not name.endswith("_proj.weight") or not name.startswith("model.layers.1."):
                continue
            mag = arr & 0x7F
            for c in fn_only:
                hist[f"0x{c:02X}"] += int((mag == c).sum())
            for a in range(0, mag.shape[0], 128):
                for b in range(0, mag.shape[1], 128):
                    tiles += 1
                    shifted += int(mag[a:a + 128, b:b + 128].max() >= 0x78)
    layer1 = r["scan"]["layers"]["model.layers.1"]
    assert (layer1["tiles"], layer1["tiles_shifted"]) == (tiles, shifted)
    assert layer1["fn_only_codes"] == {k: v for k, v in hist.items() if v}
    assert r["scan"]["nan_codes"] == 0

    # text report
    assert cli.main(["inspect", str(good), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM (supported)" in text and "block FP8 128x128" in text and text.rstrip().endswith("OK")


def test_truncated_shard(broken, capsys):
    victim = sorted(broken.glob("*.safetensors"))[-1]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 1000)
    rc, r = _run(capsys, broken)
    assert rc == 1
    assert any(victim.name in e and "truncated" in e and "1000 missing" in e for e in r["errors"]), r["errors"]


def test_missing_shard(broken, capsys):
    victim = sorted(broken.glob("*.safetensors"))[0]
    victim.unlink()
    rc, r = _run(capsys, broken)
    assert rc == 1 and any(victim.name in e and "missing" in e for e in r["errors"])


def test_missing_scale(broken, capsys):
    name = _expert_weight_names(broken)[0]
    scale = name + "_scale_inv"
    fname = _rewrite(broken, scale, lambda t: t.pop(scale))
    index = json.loads((broken / INDEX_NAME).read_text())
    del index["weight_map"][scale]
    (broken / INDEX_NAME).write_text(json.dumps(index))
    rc, r = _run(capsys, broken)
    assert rc == 1
    assert any(f"'{name}'" in e and "without its scale" in e and fname in e for e in r["errors"]), r["errors"]


def test_wrong_scale_grid(broken, capsys):
    name = _expert_weight_names(broken)[0]
    scale = name + "_scale_inv"
    fname = _rewrite(broken, scale, lambda t: t.__setitem__(scale, t[scale][:1].contiguous()))
    rc, r = _run(capsys, broken)
    assert rc == 1
    assert any(f"'{scale}'" in e and "does not fit weight" in e and fname in e for e in r["errors"]), r["errors"]


def test_nan_code_found_by_scan(broken, capsys):
    name = _expert_weight_names(broken)[3]

    def poison(t):
        codes = t[name].view(__import__("torch").uint8).clone()
        codes[5, 7] = 0xFF
        t[name] = codes.view(t[name].dtype)

    fname = _rewrite(broken, name, poison)
    assert cli.main(["inspect", str(broken), "--json"]) == 0  # headers alone cannot see it
    capsys.readouterr()
    rc, r = _run(capsys, broken, "--scan")
    assert rc == 1
    assert any(f"'{name}'" in e and "NaN" in e and "(5, 7)" in e and fname in e for e in r["errors"]), r["errors"]


def test_unknown_architecture(broken, capsys):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    rc, r = _run(capsys, broken)
    assert rc == 1 and any("MixtralForCausalLM" in e and "not supported" in e and "config.json" in e for e in r["errors"])


def test_not_a_checkpoint(tmp_path, capsys):
    rc, r = _run(capsys, tmp_path)
    assert rc == 1 and "config.json" in r["errors"][0]


def test_console_script_exit_codes(good, broken):
    """The installed `vllm-moe-w8` entry point: 0 on a good checkpoint, 1 on a broken one, 2 on bad usage."""
    exe = Path(sys.executable).with_name("vllm-moe-w8")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm_moe_w8.tools.cli"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    ok = subprocess.run(cmd + ["inspect", str(good), "--quiet"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    (broken / "config.json").write_text("{not json")
    bad = subprocess.run(cmd + ["inspect", str(broken)], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "config.json" in bad.stdout + bad.stderr
    usage = subprocess.run(cmd + ["inspect"], capture_output=True, text=True, env=env, timeout=120)
    assert usage.returncode == 2
