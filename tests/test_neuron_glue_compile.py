"""The adopted MoE blocks under vllm-neuron's runner order, compiled whole with ``torch.compile(fullgraph=True,
dynamic=False)`` (stand-in runner, tests/neuron_standin: NOT vllm-neuron; backend "eager" through a recorder, the
trace is what is checked - vllm-neuron's own backend lowers the same graph on Trainium).

For both families at TP=2 and EP=2: each rank (a thread) builds on meta, loads through the 4-thread loader, moves to
the device, compiles; decode and prefill (over the 128-token dense chunk) trace with no graph break (fullgraph),
each kernel launch is one opaque ``wrap_nki`` node, the output matches the float64 reference, and a second,
different routing of the same shape runs with ``error_on_recompile`` and adds no graph. Under
``VLLM_NEURON_CPU_COMPILE`` (weights-free load, model on meta) every decode bucket and prefill length traces.
"""

from __future__ import annotations

import pytest
import torch

import _neuron_standin as st
from test_neuron_glue_experts import REL_TOL

WORLD = 2
T_DECODE = 6  # selective bucket 8
T_PREFILL = 260  # all-gathered: two full 128-token chunks and a 4-token one
DECODE_BUCKETS = (1, 16, 64, 128)  # the kernel's decode buckets (host.T_BUCKETS <= 128)
PREFILL_LENGTHS = (256, 1024)  # multiples of 128, as vllm-neuron's prefill buckets
LAYERS = 1  # st.FAMILIES


@pytest.fixture(scope="module", params=sorted(st.FAMILIES))
def family(request, tmp_path_factory):
    path = st.write_family_checkpoint(request.param, tmp_path_factory.mktemp("cc") / request.param)
    return request.param, path, st.checkpoint_tensors(path)


@pytest.fixture()
def glue(monkeypatch):
    yield from st.compiled_glue_fixture(monkeypatch)


def build(glue, family, path, ep, recorder, cpu_compile=False):
    from vllm_neuron.vllm.worker.neuron_model_runner import load_model

    from vllm_moe_w8.neuron_glue import interfaces

    name, arch_path = family, st.FAMILIES[family]["factory"]
    glue["config"] = st.vllm_config(path)
    cls = interfaces.import_attr(*arch_path)
    state = st.make_groups(WORLD, ep)
    cfg = glue["config"].model_config.hf_config

    def one(rank):
        state(rank)
        return load_model(cls, cfg, None, str(path), backend=recorder, cpu_compile=cpu_compile)

    return state, one


def call(model, family, hidden, positions, decode):
    if family == "qwen3_moe":
        return model(hidden, positions, decode)
    return model(hidden, positions, not decode)


def hidden(tokens, seed, h=256):
    return (torch.randn(tokens, h, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_compiled_model_traces_whole_matches_reference_and_does_not_recompile(glue, family, ep):
    name, path, t = family
    rec = st.Recorder()
    state, one = build(glue, name, path, ep, rec)
    models = st.run_ranks(WORLD, one)
    cases = [("decode", T_DECODE, True), ("prefill", T_PREFILL, False)]

    def run(seed, error_on_recompile=False):
        def step(rank):
            state(rank)
            outs = {}
            # dynamo's config patches hold per thread: the rank's own thread must set it
            with torch._dynamo.config.patch(error_on_recompile=error_on_recompile):
                for case, tokens, decode in cases:
                    x = hidden(tokens, seed + tokens)
                    inp = x if decode else x.chunk(WORLD)[rank]  # prefill input is sequence-parallel
                    outs[case] = call(models[rank], name, inp, torch.arange(tokens), decode)
            return outs

        return st.run_ranks(WORLD, step)

    first = run(seed=1)
    graphs = len(rec.graphs)
    assert graphs == WORLD * len(cases), "one graph per rank and shape: no graph break (fullgraph), no extra compile"
    # one launch per graph (one layer): decode T=6 the selective block kernel, prefill 260 the block prefill kernel
    # (host_routed.schedule_for; metadata from kernels/routing.py inside the graph). Qwen3.5 under EP: a second one,
    # the shared expert's own one-expert bank (at TP its shard is one more slot of the routed bank: one launch)
    launches = 2 if name == "qwen3_5_moe" and ep else 1
    assert all(rec.kernels(g) == ["moe_w8_blocks_pow2"] * launches for g in rec.graphs), [rec.kernels(g) for g in rec.graphs]
    second = run(seed=100, error_on_recompile=True)  # same shapes, different hidden states: a different routing
    assert len(rec.graphs) == graphs, "a second routing of the same shape compiled again"
    for outs, seed in ((first, 1), (second, 100)):
        for rank, got in enumerate(outs):
            for case, tokens, decode in cases:
                x = hidden(tokens, seed + tokens)
                for layer in range(LAYERS):
                    want = st.reference_layer(name, t, layer, x)
                    want = want if decode else want.chunk(WORLD)[rank]
                    err = st.rel_err(got[case][layer], want)
                    assert err <= REL_TOL, f"{name} {'ep' if ep else 'tp'}2 {case} layer {layer} rank {rank}: {err:.2e}"


def test_routing_really_differs_between_the_two_calls(family):
    """The no-recompile check above is only meaningful if the second call routes differently."""
    name, _, t = family
    prefix = f"{st.FAMILIES[name]['prefix']}.0"
    ids = []
    for seed in (1, 100):
        x = hidden(T_DECODE, seed + T_DECODE).float()
        ids.append(torch.topk(x @ t[f"{prefix}.mlp.gate.weight"].float().T, 2, dim=-1).indices)
    assert not torch.equal(ids[0], ids[1])


def test_cpu_compile_traces_every_bucket_on_meta(glue, family):
    """VLLM_NEURON_CPU_COMPILE: load_weights_lite, model on meta, then every decode bucket and prefill length traces
    (fullgraph) with the experts' meta buffers; a tensor made on another device than the input's would fail here."""
    name, path, _ = family
    rec = st.Recorder()
    state, one = build(glue, name, path, False, rec, cpu_compile=True)
    state(0)
    model = one(0)
    blocks = [m for _, m in model.named_modules() if hasattr(m, "w8_w13")]
    assert blocks and all(b.w8_w13.device.type == "meta" and b.w8_w13.dtype == torch.uint8 for b in blocks)
    for tokens, decode in [(b, True) for b in DECODE_BUCKETS] + [(n, False) for n in PREFILL_LENGTHS]:
        x = torch.empty(tokens if decode else tokens // WORLD, 256, dtype=torch.bfloat16, device="meta")
        out = call(model, name, x, torch.empty(tokens, dtype=torch.long, device="meta"), decode)
        assert out.device.type == "meta" and out.shape == (LAYERS,) + tuple(x.shape)
    assert len(rec.graphs) == len(DECODE_BUCKETS) + len(PREFILL_LENGTHS)


def _old_dense_affinities(topk_weights, topk_ids, num_experts):
    """FAULT: the affinities as they were, reading a tensor value in Python to check the ids."""
    ids = topk_ids.long()
    if bool((ids >= num_experts).any()):
        raise ValueError("id out of range")
    keep = ids >= 0
    aff = torch.zeros(ids.shape[0], num_experts, dtype=torch.float32)
    return aff.scatter_add_(1, torch.where(keep, ids, 0), torch.where(keep, topk_weights.float(), 0.0))


def _host_scheduled(x, topk_weights, topk_ids, kw, *, lnc, swiglu_limit, where):
    """FAULT: prefill through the token-grouped kernel on a host-built schedule (nonzero, .tolist(), tile counts as
    kernel constants)."""
    from vllm_moe_w8.neuron_glue import kernel_launch

    return kernel_launch.run_grouped_experts(x, topk_weights, topk_ids, kw, lnc=lnc, swiglu_limit=swiglu_limit)


def _checked_block_schedule(real):
    """FAULT: the block metadata built after a host check of the routing values (routing.check_routing)."""
    from vllm_moe_w8.kernels import routing

    def schedule(topk_weights, topk_ids, num_experts, *args, **kwargs):
        routing.check_routing(topk_ids, num_experts)
        return real(topk_weights, topk_ids, num_experts, *args, **kwargs)

    return schedule


T_DENSE = 100  # above the selective threshold (64), one dense decode bucket


@pytest.mark.parametrize("fault", ["value_read_in_affinities", "host_built_schedule", "value_read_in_block_metadata"])
def test_fault_twins_a_forward_reading_routing_values_does_not_compile(glue, tmp_path, monkeypatch, fault):
    """The compile test's gate (fullgraph trace) refuses the ways a forward can read the routing on the host: the
    dense path's affinities (T = 100), a host-built grouped schedule, a value check in the block kernels' metadata
    (selective decode, T = 6)."""
    from vllm_moe_w8.kernels import host, host_routed, routing
    from vllm_moe_w8.neuron_glue import experts

    tokens = T_DECODE
    if fault == "value_read_in_affinities":
        assert host_routed.schedule_for(T_DENSE) == "dense"
        monkeypatch.setattr(host, "dense_affinities", _old_dense_affinities)
        tokens = T_DENSE
    elif fault == "value_read_in_block_metadata":
        assert host_routed.schedule_for(T_DECODE) == "selective"
        monkeypatch.setattr(routing, "block_schedule", _checked_block_schedule(routing.block_schedule))
    else:
        monkeypatch.setattr(experts._W8Routed, "w8_runner", staticmethod(_host_scheduled))
    path = st.write_family_checkpoint("qwen3_moe", tmp_path / "q3")
    state, one = build(glue, "qwen3_moe", path, False, st.Recorder())
    models = st.run_ranks(WORLD, one)

    def step(rank):
        state(rank)
        return call(models[rank], "qwen3_moe", hidden(tokens, 1), torch.arange(tokens), True)

    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)) as info:  # graph break / data-dependent guard
        st.run_ranks(WORLD, step)
    where = {"value_read_in_affinities": "dense_affinities", "host_built_schedule": "grouping.py",
             "value_read_in_block_metadata": "check_routing"}[fault]
    assert where in str(info.value), str(info.value)[:2000]
