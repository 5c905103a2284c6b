"""Fuzz the checkpoint reader (vllm_moe_w8/codec/checkpoint.py) with hypothesis: random bytes, random header JSON,
random index JSON, random truncation of real shards.

Contract under test: reading a checkpoint folder either succeeds (possibly recording file-level
``problems``, each a message) or raises ``CheckpointError`` with a message; ``validate_experts`` returns a
list of messages. Nothing else escapes (KeyError / TypeError / struct.error / UnicodeDecodeError /
OverflowError / MemoryError would mean a corrupt file crashes ``vllm-moe-w8 inspect`` instead of being
reported). Example counts are bounded so the module runs in well under a minute.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from vllm_moe_w8.codec.checkpoint import INDEX_NAME, Checkpoint, CheckpointError, read_header
from vllm_moe_w8.codec.checkpoint_checks import validate_experts

# No shrinking phase: every example writes files, and shrinking a failure took minutes; the raw failing
# example is printed instead.
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256, "num_experts": 8,
          "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
DTYPES = ["F8_E4M3", "BF16", "F32", "F16", "U8", "I64", "XX", ""]


@st.composite
def tensor_meta(draw):
    """A header entry: mostly well-formed, sometimes with any field wrong or missing."""
    meta = {}
    if draw(st.integers(0, 9)):
        meta["dtype"] = draw(st.one_of(st.sampled_from(DTYPES), json_value))
    if draw(st.integers(0, 9)):
        meta["shape"] = draw(st.one_of(st.lists(st.integers(0, 300), max_size=3), json_value))
    if draw(st.integers(0, 9)):
        meta["data_offsets"] = draw(st.one_of(st.lists(st.integers(-5, 10**6), min_size=2, max_size=2), json_value))
    return meta if draw(st.integers(0, 12)) else draw(json_value)


NAMES = st.one_of(
    st.sampled_from(["model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv",
                     "model.layers.1.mlp.experts.7.down_proj.weight", "__metadata__", "lm_head.weight"]),
    st.text(max_size=20),
)
headers = st.one_of(st.dictionaries(NAMES, tensor_meta(), max_size=5), json_value)


def _folder(tmp: Path, files: dict[str, bytes], index=None, config=CONFIG) -> Path:
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config))
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    if index is not None:
        (tmp / INDEX_NAME).write_text(index if isinstance(index, str) else json.dumps(index))
    return tmp


def _read(path: Path) -> None:
    """Everything `inspect` does with the headers; only CheckpointError may escape."""
    try:
        ckpt = Checkpoint(path)
    except CheckpointError as e:
        assert str(e)
        return
    assert all(isinstance(p, str) and p for p in ckpt.problems)
    problems = validate_experts(ckpt)
    assert all(isinstance(p, str) and p for p in problems)
    ckpt.total_bytes()
    ckpt.fingerprint()
    try:
        ckpt.raise_on_file_problems()
    except CheckpointError as e:
        assert ckpt.problems and str(e)


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_as_a_shard(tmp_path, data):
    _read(_folder(tmp_path / "c", {"model.safetensors": data}))


@FUZZ
@given(header=headers, tail=st.binary(max_size=64), length_delta=st.sampled_from([0, 0, 0, -1, 1, 2**40]))
def test_random_header_json(tmp_path, header, tail, length_delta):
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", max(len(raw) + length_delta, 0)) + raw + tail
    path = _folder(tmp_path / "c", {"model-00001-of-00001.safetensors": blob})
    try:
        read_header(path / "model-00001-of-00001.safetensors")
    except CheckpointError as e:
        assert str(e)
    _read(path)


@FUZZ
@given(index=st.one_of(json_value, st.fixed_dictionaries({"weight_map": st.dictionaries(NAMES, st.one_of(st.text(max_size=30), json_value), max_size=4)}),
                       st.text(max_size=40)))
def test_random_index_json(tmp_path, index):
    _read(_folder(tmp_path / "c", {}, index=index))


@FUZZ
@given(config=json_value)
def test_random_config_json(tmp_path, config):
    from safetensors.torch import save

    import torch

    blob = save({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)})
    _read(_folder(tmp_path / "c", {"model.safetensors": blob}, config=config))


@pytest.fixture(scope="module")
def real_shard(tmp_path_factory) -> bytes:
    import torch
    from safetensors.torch import save

    from vllm_moe_w8.tiny_models import quantize_block

    w = torch.randn(384, 256) * 0.05
    codes, scale = quantize_block(w, torch.bfloat16)
    return save({"model.layers.0.mlp.experts.0.gate_proj.weight": codes,
                 "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv": scale})


@FUZZ
@given(cut=st.floats(0.0, 1.0), flip=st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(1, 255))))
def test_truncated_or_bit_flipped_real_shard(tmp_path, real_shard, cut, flip):
    blob = bytearray(real_shard[: int(len(real_shard) * cut)])
    if flip is not None and blob:
        pos, mask = flip
        blob[pos % len(blob)] ^= mask
    path = _folder(tmp_path / "c", {"model.safetensors": bytes(blob)})
    _read(path)
    if cut < 1.0 and flip is None:  # a cut file never reads as a healthy checkpoint
        try:
            ckpt = Checkpoint(path)
        except CheckpointError:
            return
        assert ckpt.problems or validate_experts(ckpt)
