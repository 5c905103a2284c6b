"""Registration on a Neuron platform, the Qwen3.5-MoE block, and every refusal of the Neuron glue.

Runs against the stand-in of vllm-neuron (tests/neuron_standin, NOT vllm-neuron: it reproduces only the
signatures neuron-w8 uses; the hardware run is the real check).
"""

from __future__ import annotations

import sys

import pytest
import torch

import _neuron_standin as st
from test_neuron_glue_experts import REL_TOL, hidden_states

QWEN35 = dict(hidden_size=256, moe_intermediate_size=256, shared_intermediate_size=256, num_experts=8,
              num_experts_per_tok=2, num_hidden_layers=2)


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    from vllm_moe_w8 import tiny_models

    return tiny_models.write_checkpoint(tmp_path_factory.mktemp("ng35") / "q35", "Qwen3_5MoeForConditionalGeneration", **QWEN35)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from test_neuron_glue_experts import SIZES
    from vllm_moe_w8 import tiny_models

    return tiny_models.write_checkpoint(tmp_path_factory.mktemp("ng3") / "q3", "Qwen3MoeForCausalLM", **SIZES)


@pytest.fixture()
def standin(monkeypatch):
    yield from st.glue_fixture(monkeypatch, install=False)


def platform():
    from vllm_neuron.vllm.platform import NeuronPlatform

    return NeuronPlatform


def test_platform_accepts_neuron_w8_only_after_install(standin):
    from vllm_moe_w8.neuron_glue import registration

    cls = platform()
    with pytest.raises(ValueError, match="neuron-w8 quantization is currently not supported"):
        cls.verify_quantization("neuron-w8")
    registration.install(cls)
    registration.install(cls)  # idempotent
    assert cls.supported_quantization.count("neuron-w8") == 1
    assert {"fp8", "compressed-tensors"} <= set(cls.supported_quantization), "the platform's own names stay"
    cls.verify_quantization("neuron-w8")
    cls.verify_quantization("fp8")


def test_factories_wrapped_and_inert_without_neuron_w8(standin, qwen3):
    from vllm_moe_w8.neuron_glue import experts, registration

    registration.install(platform())
    from vllm_neuron.model.registry import get_models

    models = dict(get_models())
    assert getattr(models["Qwen3MoeForCausalLM"].from_configs, registration.WRAPPED, False)
    assert getattr(models["Qwen3_5MoeForConditionalGeneration"].from_configs, registration.WRAPPED, False)
    standin["config"] = st.vllm_config(qwen3, quantization=None)  # vLLM serving BF16: nothing of ours
    with torch.device("meta"):
        model = models["Qwen3MoeForCausalLM"].from_configs(standin["config"].model_config.hf_config, None)
    assert not experts.adopted_blocks(model)
    assert hasattr(model.model.layers[0].mlp.experts, "gate_up_proj_weight")
    standin["config"] = st.vllm_config(qwen3, quantization=None, additional_config={"neuron_config": {"quantization": "neuron-w8"}})
    with torch.device("meta"):
        model = models["Qwen3MoeForCausalLM"].from_configs(standin["config"].model_config.hf_config, None)
    assert len(experts.adopted_blocks(model)) == 2, "neuron_config.quantization selects neuron-w8 too"


def test_qwen3_5_moe_block_tp2_matches_reference(standin, q35):
    """Qwen3.5-MoE: vllm-neuron's block (zero-centred norm, shared expert, combine) with our routed experts."""
    from vllm_moe_w8.neuron_glue import registration

    registration.install(platform())
    from vllm_neuron.model.qwen3_5 import Qwen3_5MoeForConditionalGeneration
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    world = 2
    standin["config"] = st.vllm_config(q35)
    cfg = standin["config"].model_config.hf_config
    state = st.make_groups(world, ep=False)

    def build(rank):
        state(rank)
        return load_model(Qwen3_5MoeForConditionalGeneration, cfg, None, str(q35))

    models = st.run_ranks(world, build)
    t = st.checkpoint_tensors(q35)
    dec, pre = hidden_states(4, 5), hidden_states(8, 6)
    for layer in range(QWEN35["num_hidden_layers"]):
        prefix = f"model.language_model.layers.{layer}"

        def want(h):
            x = st.rms_norm(h, t[f"{prefix}.post_attention_layernorm.weight"], 1e-6, zero_centred=True)
            routed = st.reference_routed(x, t, prefix, QWEN35["num_experts"], QWEN35["num_experts_per_tok"])
            xd = x.double()
            g, u, d = (st.dequant(t, f"{prefix}.mlp.shared_expert.{p}_proj.weight").double() for p in ("gate", "up", "down"))
            gate = torch.sigmoid(xd @ t[f"{prefix}.mlp.shared_expert_gate.weight"].double().T)
            return routed + (torch.nn.functional.silu(xd @ g.T) * (xd @ u.T)) @ d.T * gate

        def step(rank, layer=layer):
            state(rank)
            lyr = models[rank].language_model.layers[layer]
            with torch.no_grad():
                a = lyr.mlp(dec, is_prefill=False, norm=lyr.post_attention_layernorm)
                b = lyr.mlp(pre.chunk(world)[rank], is_prefill=True, norm=lyr.post_attention_layernorm)
            return a, b

        for rank, (a, b) in enumerate(st.run_ranks(world, step)):
            assert st.rel_err(a, want(dec)) <= REL_TOL, f"decode layer {layer} rank {rank}"
            assert st.rel_err(b, want(pre).chunk(world)[rank]) <= REL_TOL, f"prefill layer {layer} rank {rank}"


# ---- refusals ------------------------------------------------------------------------------------------


def test_older_generation_is_refused_naming_the_version(standin, qwen3, monkeypatch):
    from vllm_moe_w8.neuron_glue import interfaces, registration

    monkeypatch.setattr(interfaces, "generation", lambda: "nxdi")
    cls = platform()
    registration.install(cls)
    with pytest.raises(interfaces.NeuronGlueError, match=r"0\.24\.0\.standin is the older generation .*Install vllm-neuron 0\.24"):
        cls.verify_quantization("neuron-w8")
    cls.verify_quantization("fp8")  # other names are the platform's business
    with pytest.raises(interfaces.NeuronGlueError, match="NxD Inference"):
        cls.check_and_update_config(st.vllm_config(qwen3))
    cls.check_and_update_config(st.vllm_config(qwen3, quantization=None))  # not asked for: no refusal


@pytest.mark.parametrize("arch, message", [
    ("LlamaForCausalLM", r"architecture LlamaForCausalLM with vllm-neuron 0\.24\.0\.standin: not supported\. neuron-w8 "
                         r"replaces the experts of: Qwen3MoeForCausalLM, Qwen3_5MoeForConditionalGeneration"),
    ("Qwen3_5MoeForCausalLM", r"no model for the text-only Qwen3\.5-MoE layout"),
])
def test_unsupported_architecture_stops_start_up(standin, qwen3, arch, message):
    from vllm_moe_w8.neuron_glue import interfaces, registration

    cls = platform()
    registration.install(cls)
    config = st.vllm_config(qwen3)
    config.model_config.hf_config.architectures = [arch]
    with pytest.raises(interfaces.NeuronGlueError, match=message):
        cls.check_and_update_config(config)
    assert config not in cls.checked_configs, "stopped before the platform went on"


def test_dense_only_qwen3_5_names_the_missing_interface(standin, q35, monkeypatch):
    from vllm_moe_w8.neuron_glue import interfaces, registration

    monkeypatch.setitem(sys.modules, "vllm_neuron.model.qwen3_5.moe", None)  # a vllm-neuron without the MoE variant
    monkeypatch.setitem(sys.modules, "vllm_neuron.model.qwen3_5", None)
    monkeypatch.setattr(interfaces, "has_module", lambda name: True)
    cls = platform()
    registration.install(cls)
    with pytest.raises(interfaces.NeuronGlueError, match=r"dense Qwen3\.5 model but no MoE variant; missing: .*Qwen3_5SparseMoeBlock"):
        cls.check_and_update_config(st.vllm_config(q35))


def test_changed_block_interface_is_named(standin, qwen3):
    from vllm_moe_w8.neuron_glue import interfaces, registration

    registration.install(platform())
    from vllm_neuron.model.qwen3_moe import Qwen3MoeForCausalLM, model_bf16

    original = model_bf16.Qwen3MoeExperts.__init__

    def without_router(self, config):
        original(self, config)
        del self.router_weight

    model_bf16.Qwen3MoeExperts.__init__ = without_router
    standin["config"] = st.vllm_config(qwen3)
    with pytest.raises(interfaces.NeuronGlueError, match=r"Qwen3MoeForCausalLM model\.layers\.0\.mlp\.experts .*vllm-neuron 0\.24\.0\.standin\) lacks \['router_weight'\]"):
        with torch.device("meta"):
            Qwen3MoeForCausalLM.from_configs(standin["config"].model_config.hf_config, None)


@pytest.mark.parametrize("extra, fmt, message", [
    ({"neuron_w8": {"mode": "lut"}}, "block", r"mode 'lut' .* has no NKI kernel"),
    ({"neuron_w8": {"bogus": 1}}, "block", r"unknown additional_config\['neuron_w8'\] key"),
    ({}, "channel", r"tiled \(1, 0\) \(channel\); the pow2 kernel needs 128x128 block scales. Use .*output-block"),
])
def test_settings_refused_at_start_up(standin, tmp_path, extra, fmt, message):
    from vllm_moe_w8 import tiny_models
    from vllm_moe_w8.neuron_glue import registration

    path = tiny_models.write_checkpoint(tmp_path / "c", "Qwen3MoeForCausalLM", fmt=fmt, num_hidden_layers=1,
                                        moe_intermediate_size=256)
    cls = platform()
    registration.install(cls)
    with pytest.raises(ValueError, match=message):
        cls.check_and_update_config(st.vllm_config(path, additional_config=extra))


def test_tp_split_the_kernel_cannot_take_names_the_remedy(standin, qwen3):
    from vllm_moe_w8.neuron_glue import registration

    registration.install(platform())
    from vllm_neuron.model.qwen3_moe import Qwen3MoeForCausalLM

    standin["config"] = st.vllm_config(qwen3)
    state = st.make_groups(4, ep=False)  # I 256 / TP 4 = 64: not a multiple of 128

    def build(rank):
        state(rank)
        with torch.device("meta"):
            Qwen3MoeForCausalLM.from_configs(standin["config"].model_config.hf_config, None)

    with pytest.raises(ValueError, match=r"256 / tp_degree 4 = 64\) to be multiples of 128\. .*--enable-expert-parallel"):
        st.run_ranks(4, build)


def test_adopting_experts_on_a_neuron_host_without_a_launcher_is_an_error(standin, qwen3, monkeypatch):
    """Stand-in Neuron host (a device node, no AWS nki): the kernels' backend is resolved when the blocks are adopted
    (never inside the compiled forward), so building the model stops with NeuronLaunchError instead of falling back to
    the interpreter."""
    from vllm_moe_w8.neuron_glue import experts, kernel_launch, registration

    assert experts._W8Routed.w8_runner is experts.run_kernels
    registration.install(platform())
    from vllm_neuron.model.qwen3_moe import Qwen3MoeForCausalLM

    standin["config"] = st.vllm_config(qwen3)
    kernel_launch.backend.cache_clear()
    monkeypatch.setattr(kernel_launch, "neuron_device_present", lambda: (True, "1 Neuron device(s) (stand-in)"))
    monkeypatch.setattr(kernel_launch, "real_nki", lambda: (None, "stand-in: no AWS nki"))
    try:
        with pytest.raises(kernel_launch.NeuronLaunchError, match="AWS nki is unusable"):
            with torch.device("meta"):
                Qwen3MoeForCausalLM.from_configs(standin["config"].model_config.hf_config, None)
    finally:
        kernel_launch.backend.cache_clear()


@pytest.mark.parametrize("arch_ckpt, names", [
    ("qwen3", r"none of the trees read registers it"),
    ("q35", r"whn09/vllm-neuron model/registry.py @3de9ea3"),
])
def test_architecture_missing_from_the_registry_is_refused_naming_the_trees(standin, qwen3, q35, monkeypatch, arch_ckpt, names):
    """A stock vllm-neuron whose get_models() does not list the architecture: refused at start-up (vLLM would resolve
    its own class, which vllm-neuron's runner cannot build), naming the trees that register it."""
    from vllm_moe_w8.neuron_glue import interfaces, registration

    cls = platform()
    registration.install(cls)
    from vllm_neuron.model import registry

    path = qwen3 if arch_ckpt == "qwen3" else q35
    config = st.vllm_config(path)
    cls.check_and_update_config(config)  # the stand-in's registry lists both
    arch = config.model_config.hf_config.architectures[0]
    listed = registry.get_models
    monkeypatch.setattr(registry, "get_models", lambda: [(a, c) for a, c in listed() if a != arch])
    with pytest.raises(interfaces.NeuronGlueError, match=rf"{arch}: vllm-neuron 0\.24\.0\.standin's registry .* does not list it.*{names}"):
        cls.check_and_update_config(config)
