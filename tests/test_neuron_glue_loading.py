"""Non-expert FP8 weights through vllm-neuron's threaded, lazily indexed loader (stand-in of
``SafetensorsCheckpoint.load_sharded_pipelined``, tests/neuron_standin: NOT vllm-neuron), and the size check
between the built model and the checkpoint.

The gate (``_neuron_standin.non_expert_mismatches``): every non-expert FP8 weight vllm-neuron's loader stores
equals the checkpoint's bytes decoded by ml_dtypes times their block scale, rounded once to bf16 (exact: no
tolerance). Its fault twins are the two ways the hook used to fail: state kept per thread (the loader's worker
threads do not see it: the weights come back raw), and the scale looked up through the loader's partial index
(a scale in a shard not indexed yet is "missing").
"""

from __future__ import annotations

import threading

import pytest
import torch

import _neuron_standin as st

SIZES = dict(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2)
O_PROJ = [(f"model.layers.{i}.self_attn.o_proj_weight", f"model.layers.{i}.self_attn.o_proj.weight", True) for i in range(2)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from vllm_moe_w8 import tiny_models

    return tiny_models.write_checkpoint(tmp_path_factory.mktemp("ld") / "qwen3moe", "Qwen3MoeForCausalLM", **SIZES)


@pytest.fixture(scope="module")
def late_scales(ckpt, tmp_path_factory):
    return st.scales_in_later_shard(ckpt, tmp_path_factory.mktemp("ld") / "late_scales")


@pytest.fixture(scope="module")
def tensors(ckpt):
    return st.checkpoint_tensors(ckpt)


@pytest.fixture()
def glue(monkeypatch):
    yield from st.glue_fixture(monkeypatch)


def load(path, holder, **kw):
    """One rank built and loaded in the runner's order, not compiled (these tests look at weights only)."""
    from vllm_neuron.model.qwen3_moe import Qwen3MoeForCausalLM
    from vllm_neuron.utils import checkpoints
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    holder["config"] = st.vllm_config(path)
    checkpoints.worker_threads.clear()
    model = load_model(Qwen3MoeForCausalLM, holder["config"].model_config.hf_config, None, str(path), compile=False, **kw)
    return model, set(checkpoints.worker_threads)


def test_scales_really_sit_in_a_later_shard(late_scales):
    import json

    wm = json.loads((late_scales / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.o_proj.weight"
    assert wm[name] < wm[name + "_scale_inv"], "the weight's shard is indexed first"


@pytest.mark.parametrize("which", ["as_written", "scales_in_later_shard"])
def test_non_expert_fp8_is_dequantised_on_the_loader_threads(glue, ckpt, late_scales, tensors, which):
    model, threads = load(ckpt if which == "as_written" else late_scales, glue)
    assert threads and threading.current_thread().name not in threads, "vllm-neuron's loader ran _get_slice on its pool"
    assert st.non_expert_mismatches(model, tensors, O_PROJ) == []
    raw = tensors[O_PROJ[0][1]].float().T.to(torch.bfloat16)
    assert not torch.equal(raw, model.model.layers[0].self_attn.o_proj_weight), "a plain cast of the bytes differs"


class ThreadLocalLoads:
    """FAULT: the old hook's state, kept per thread (set by the calling thread only)."""

    def __init__(self):
        self._local = threading.local()

    def enter(self, load):
        self._local.load = load
        return 1

    def exit(self, token):
        self._local.load = None

    def find(self, checkpoint, key):
        return getattr(self._local, "load", None)


def test_fault_twin_thread_local_hook_serves_raw_weights(glue, ckpt, tensors, monkeypatch):
    from vllm_moe_w8.neuron_glue import slice_hook

    monkeypatch.setattr(slice_hook, "ACTIVE", ThreadLocalLoads())
    model, _ = load(ckpt, glue)
    assert st.non_expert_mismatches(model, tensors, O_PROJ) == [p for p, _, _ in O_PROJ], "the gate refuses raw weights"


def test_fault_twin_scale_through_the_loaders_partial_index(glue, ckpt, late_scales, tensors, monkeypatch):
    """FAULT: the scale read with the loader's own _get_slice (its index is built shard by shard)."""
    from vllm_moe_w8.codec.checkpoint import CheckpointError
    from vllm_moe_w8.neuron_glue import slice_hook

    monkeypatch.setattr(slice_hook, "read_scale", lambda load, checkpoint, key, get_slice: get_slice(checkpoint, key)[:])
    model, _ = load(ckpt, glue)  # scales in the weights' shard: the fault hides ...
    assert st.non_expert_mismatches(model, tensors, O_PROJ) == []
    with pytest.raises(CheckpointError, match=r"o_proj.weight' has no weight_scale_inv"):
        load(late_scales, glue)  # ... and shows once a scale sits in a later shard


def test_hook_is_inert_outside_neuron_w8s_load(glue, ckpt):
    """After load_weights returns, the wrapped _get_slice hands out the raw FP8 slice again (other models)."""
    from vllm_neuron.utils.checkpoints import SafetensorsCheckpoint

    load(ckpt, glue)
    c = SafetensorsCheckpoint(str(ckpt))
    c._ensure_indexed()
    assert c._get_slice("model.layers.0.self_attn.o_proj.weight").get_dtype() == "F8_E4M3"


def test_built_expert_count_differing_from_the_checkpoint_is_refused(glue, ckpt):
    """vllm-neuron's config lost num_experts (transformers 5 renames it) and built its default: refused, naming both."""
    from vllm_neuron.model.qwen3_moe import Qwen3MoeForCausalLM
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError

    glue["config"] = st.vllm_config(ckpt)
    cfg = glue["config"].model_config.hf_config
    cfg.num_experts = 128
    with pytest.raises(NeuronGlueError, match=r"experts = 128, but the checkpoint .* has experts = 8.*num_local_experts"):
        load_model(Qwen3MoeForCausalLM, cfg, None, str(ckpt), compile=False)
    cfg.num_experts, cfg.moe_intermediate_size = 8, 384
    with pytest.raises(NeuronGlueError, match=r"intermediate = 384, but the checkpoint .* has intermediate = 256"):
        load_model(Qwen3MoeForCausalLM, cfg, None, str(ckpt), compile=False)


def test_sizes_read_from_every_spelling_of_the_expert_count():
    from vllm_moe_w8.neuron_glue.model_load import checkpoint_sizes

    assert checkpoint_sizes({"num_local_experts": 8, "hidden_size": 256, "moe_intermediate_size": 128})["experts"] == 8
    assert checkpoint_sizes({"text_config": {"num_experts": 16, "hidden_size": 1}})["experts"] == 16
