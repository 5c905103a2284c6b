"""A converted checkpoint loads into vLLM exactly as the original converts at load time, with no repack work.

1. In-process, real vLLM ``RoutedExperts`` layers (tests/_plugin_fixtures.py) for every TP/EP rank: the
   parameters after ``process_weights_after_loading`` are bit-identical whether the layer loaded the
   original FP8 experts (repacked at load) or the output of ``vllm-moe-w8 convert`` (no repack).
2. End to end through ``vllm.LLM`` (in a subprocess: vLLM's engine spawns workers): same prompt logprobs
   from the original and the converted checkpoint, and the plugin's load summary says the converted one
   was not repacked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_log import excerpt

LAYER = "model.layers.0.mlp.experts"


def _layer_checkpoint(path: Path, fmt_name: str):
    """The experts of layer 0 of a tiny checkpoint as an ExpertCheckpoint (weights as stored)."""
    import torch
    from safetensors.torch import load_file

    from _plugin_fixtures import ExpertCheckpoint

    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(f)).items() if k.startswith(LAYER + ".")})
    cfg = json.loads((path / "config.json").read_text())
    weights, scales = {}, {}
    n = cfg["num_experts"]
    for e in range(n):
        for shard, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            weights[e, shard] = tensors[f"{LAYER}.{e}.{proj}.weight"]
            scales[e, shard] = tensors[f"{LAYER}.{e}.{proj}.weight_scale_inv"]
    assert all(w.dtype in (torch.float8_e4m3fn, torch.uint8) for w in weights.values())
    return ExpertCheckpoint(fmt_name, weights, scales, {}, n, cfg["hidden_size"], cfg["moe_intermediate_size"]), cfg


def _params(layer) -> dict:
    return {n: p.detach().clone() for n, p in layer.named_parameters()}


def _calm_half_tile(path: Path, name: str) -> None:
    """Rows 64..127 of the first 128x128 tile lose their e4m3fn-only codes (0x78.. -> 0x77), so pow2 on a whole
    tile halves them but pow2 on TP=2's refined 64-row tiles does not: the tile rule becomes observable."""
    import torch
    from safetensors.torch import load_file, save_file

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / index[name]
    tensors = load_file(str(shard))
    codes = tensors[name].view(torch.uint8).clone()
    part = codes[64:128, :128]
    mag = part & 0x7F
    part[mag >= 0x78] = (part[mag >= 0x78] & 0x80) | 0x77
    codes[64:128, :128] = part
    tensors[name] = codes.view(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_layers_bit_identical_for_every_rank(tmp_path):  # in-process vLLM layers, no engine: quick
    pytest.importorskip("vllm")
    import torch

    from _plugin_fixtures import load_layer, make_layer
    from vllm_moe_w8 import tiny_models
    from vllm_moe_w8.tools.convert import convert_checkpoint
    from vllm_moe_w8.vllm_glue.quant_config import NeuronW8Config

    mode = "pow2"
    src = tiny_models.write_checkpoint(tmp_path / "src", "qwen3-moe", num_experts=4, num_hidden_layers=1)
    _calm_half_tile(src, f"{LAYER}.0.gate_proj.weight")
    source_ckpt, src_cfg = _layer_checkpoint(src, "block")
    source_qc = dict(src_cfg["quantization_config"], mode=mode)
    cases = [("tp1", (1, 0), (1, 0))] + [("ep2", (1, 0), (2, r)) for r in range(2)] + [("tp2", (2, r), (1, 0)) for r in range(2)]
    converted = {}
    for key, tp, ep in (("tp1", 1, False), ("ep2", 2, True), ("tp2", 2, False)):
        out = tmp_path / key
        assert convert_checkpoint(src, out, mode=mode, tp=tp, ep=ep, progress=False)["ok"]
        converted[key] = _layer_checkpoint(out, "block")
    loaded = {}
    for key, tp, ep in cases:
        a = make_layer(NeuronW8Config.from_config(source_qc), source_ckpt, tp=tp, ep=ep)
        load_layer(a, source_ckpt)
        conv_ckpt, conv_cfg = converted[key]
        b = make_layer(NeuronW8Config.from_config(conv_cfg["quantization_config"]), conv_ckpt, tp=tp, ep=ep)
        load_layer(b, conv_ckpt)
        pa, pb = _params(a), _params(b)
        assert set(pa) == set(pb), (key, tp, ep)
        for name in pa:
            assert pa[name].dtype == pb[name].dtype and torch.equal(pa[name], pb[name]), (key, tp, ep, name)
        assert a.quant_method.block == b.quant_method.block and a.quant_method.code_format == b.quant_method.code_format
        assert b.quant_method.fmt.converted and not a.quant_method.fmt.converted
        loaded[key, tp, ep] = pa
    # Sensitivity: a whole-tile conversion loaded at TP=2 differs from TP=2's load-time repack (rank 0 holds the tile)
    conv_ckpt, conv_cfg = converted["tp1"]
    c = make_layer(NeuronW8Config.from_config(conv_cfg["quantization_config"]), conv_ckpt, tp=(2, 0))
    load_layer(c, conv_ckpt)
    assert not torch.equal(_params(c)["w13_weight"], loaded["tp2", (2, 0), (1, 0)]["w13_weight"])


WORKER_TIMEOUT_S = 900  # two vLLM start-ups on a shared 2-core machine


@pytest.mark.vllm
@pytest.mark.slow
def test_llm_same_logprobs_and_no_repack(tmp_path):
    pytest.importorskip("vllm")
    from vllm_moe_w8 import tiny_models
    from vllm_moe_w8.tools.convert import convert_checkpoint

    src = tiny_models.write_checkpoint(tmp_path / "src", "qwen3.5-moe", num_experts=8)
    out = tmp_path / "converted"
    assert convert_checkpoint(src, out, progress=False)["ok"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.run([sys.executable, __file__, str(src), str(out)], capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT_S, env=env)
    log = proc.stdout + proc.stderr
    results = [json.loads(l[len("RESULT "):]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(results) == 2, excerpt(log)
    original, converted = results
    assert original["prompt_logprobs"] == converted["prompt_logprobs"]  # same weights -> same floats
    assert original["text"] == converted["text"]
    summaries = [l for l in log.splitlines() if "neuron-w8: processed" in l and "MoE layers" in l]
    assert len(summaries) == 2, excerpt(log)
    assert "converted checkpoint: no repack" not in summaries[0]
    assert "converted checkpoint: no repack" in summaries[1] and "blocks shifted 0 of 0" in summaries[1]


def _worker(paths: list[str]) -> None:
    """Run each checkpoint with vLLM (neuron-w8) and print its prompt logprobs as one JSON line."""
    from vllm import LLM, SamplingParams

    prompt = {"prompt_token_ids": [1, 17, 42, 99, 7, 250, 3, 64, 128, 5]}
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0)
    for path in paths:
        llm = LLM(model=path, quantization="neuron-w8", enforce_eager=True, max_model_len=64, max_num_seqs=2,
                  dtype="bfloat16", seed=0)
        res = llm.generate([prompt], params, use_tqdm=False)[0]
        lps = [None if d is None else {str(k): v.logprob for k, v in d.items()} for d in res.prompt_logprobs]
        print("RESULT " + json.dumps({"prompt_logprobs": lps, "text": res.outputs[0].text}), flush=True)
        del llm


if __name__ == "__main__":
    _worker(sys.argv[1:])
