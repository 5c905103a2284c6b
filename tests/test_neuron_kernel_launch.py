"""The kernel launch wrapper (``neuron_glue.kernel_launch``): what runs where, the NKI version floor, the
LNC, the torch op's schema, and the dense (decode) path against the fp32 reference.

Tests marked "stand-in" replace the host probes (device node, AWS nki, wrap_nki) with monkeypatched
fakes: they check the decision logic only; the hardware run (``vllm-moe-w8 neuron-check`` on trn2) is
the real check of the Neuron branch."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_moe_w8.kernels import host
from vllm_moe_w8.neuron_glue import kernel_check, kernel_launch
from vllm_moe_w8.neuron_glue.kernel_launch import NeuronLaunchError


@pytest.fixture
def fresh_backend():
    kernel_launch.backend.cache_clear()
    yield
    kernel_launch.backend.cache_clear()


@pytest.fixture(scope="module")
def small_layer():
    ckpt = kernel_check.checkpoint_experts(4, 256, 256, seed=7)
    w13, s13, w2, s2, block = kernel_check.repacked(ckpt, "pow2")
    return (w13, s13, w2, s2, block), host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")


def test_without_a_device_the_interpreter_runs_and_the_log_says_so(fresh_backend, caplog):
    if kernel_launch.neuron_device_present()[0]:
        pytest.skip("a Neuron device is present")
    with caplog.at_level("INFO", logger="vllm.neuron_w8"):
        b = kernel_launch.backend()
    assert b.name == "interpreter" and "no Neuron device" in b.detail
    assert "NKI interpreter" in caplog.text


@pytest.mark.parametrize("tokens,lnc,kernel", [(1, 1, "selective"), (77, 2, "dense"), (128, 2, "dense"), (200, 2, "blocks")])
def test_served_path_matches_the_reference(small_layer, tokens, lnc, kernel):
    layer, _ = small_layer
    r = kernel_check.run_case("served", None, "pow2", tokens, top_k=3, lnc=lnc, seed=tokens, layer=layer)
    assert r.kernel == kernel and r.passed, f"{r.kernel}: {r.err_over_bound:.3f} x bound"
    assert r.modelled_s is not None and r.modelled_s > 0


def test_kernel_choice_follows_the_token_count():
    from vllm_moe_w8.kernels import host_routed

    limit = host_routed.SELECTIVE_MAX_TOKENS
    assert kernel_launch.kernel_for(1, "pow2") == ("selective", host_routed.BLOCKS["pow2"])
    assert kernel_launch.kernel_for(limit, "output-block") == ("selective", host_routed.BLOCKS["output-block"])
    assert kernel_launch.kernel_for(limit + 1, "pow2") == ("dense", kernel_launch.DENSE["pow2"])
    assert kernel_launch.kernel_for(kernel_launch.DENSE_MAX_TOKENS, "pow2")[0] == "dense"
    assert kernel_launch.kernel_for(kernel_launch.DENSE_MAX_TOKENS + 1, "output-block") == (
        "blocks", host_routed.BLOCKS["output-block"])


def test_prefill_runs_the_block_kernel_in_one_launch(small_layer, monkeypatch):
    """300 tokens: one launch of the block prefill kernel on the tokens plus 128 zero rows, out [lnc, T, H] (padding
    rows are skipped by the kernel's scatter-add: they have no output row)."""
    layer, kw = small_layer
    shapes = []
    real = kernel_launch.launch

    def recording(kernel, lnc, tensors, constants, stats=None, where=None):
        out = real(kernel, lnc, tensors, constants, stats, where)
        shapes.append((kernel.__name__, tuple(tensors[0].shape), tuple(out.shape)))
        return out

    monkeypatch.setattr(kernel_launch, "launch", recording)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tw, ti = kernel_check.routing(300, 4, 2, seed=3)
    out = kernel_launch.run_routed_experts(x, tw, ti, kw, lnc=2)
    assert shapes == [("moe_w8_blocks_pow2", (300 + 128, 256), (2, 300, 256))]
    ref = kernel_check.reference_moe(x, tw, ti, *layer[:4], *layer[4], "e4m3")
    assert kernel_check.within_bound(out, ref, kernel_check.error_bound(x, tw, ti, *layer))[0]


def test_bad_calls_name_what_is_wrong(small_layer):
    _, kw = small_layer
    x, tw, ti = torch.zeros(3, 256), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="lnc=4"):
        kernel_launch.run_routed_experts(x, tw, ti, kw, lnc=4)
    with pytest.raises(ValueError, match="swiglu_limit"):
        kernel_launch.run_routed_experts(x, tw, ti, kw, lnc=1, swiglu_limit=-1.0)
    with pytest.raises(ValueError, match=r"x \(3, 128\) must be \[T, 256\]"):
        kernel_launch.run_routed_experts(torch.zeros(3, 128), tw, ti, kw, lnc=1)


def test_the_interpreter_launch_op_schema_is_inferred_on_every_host():
    """The interpreter's wrap_nki launches through one custom op whose schema torch infers from the annotations,
    here on CPU; the same inference refuses a wrapper with an un-annotated parameter (the failure that once hid
    until a Neuron host and turned into a silent CPU fallback)."""
    from vllm_moe_w8.neuron_glue import interpreter_hop

    schema = torch.library.infer_schema(interpreter_hop.nki_interpreted._init_fn, mutates_args=())
    assert str(torch.ops.moe_w8.nki_interpreted.default._schema).endswith(schema)
    assert "(str kernel, SymInt grid, Tensor[] tensors, str constants) -> Tensor" in schema

    def unannotated(hidden: torch.Tensor, swiglu_limit: float, _kernel=None) -> torch.Tensor:
        return hidden

    with pytest.raises(ValueError, match="_kernel"):
        torch.library.infer_schema(unannotated, mutates_args=())


@pytest.mark.parametrize("tokens", [9, 140])
def test_compiled_launch_path_is_one_graph_with_opaque_launches_and_matches_eager(small_layer, tokens):
    """run_routed_experts under torch.compile(fullgraph=True, dynamic=False): one graph, one launch (a
    moe_w8::nki_interpreted node whose fake gives the kernel's output shape); the result equals the eager call exactly."""
    _, kw = small_layer
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    where = kernel_launch.backend()
    fn = torch.compile(lambda x, tw, ti: kernel_launch.run_routed_experts(x, tw, ti, kw, lnc=2, where=where),
                       backend=recorder, fullgraph=True, dynamic=False)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    tw, ti = kernel_check.routing(tokens, 4, 2, seed=tokens)
    got = fn(x, tw, ti)
    op = torch.ops.moe_w8.nki_interpreted
    launches = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in (op, op.default)]
    assert len(graphs) == 1 and len(launches) == 1
    assert launches[0].args[0] == kernel_launch.kernel_for(tokens, kw.mode)[1].__name__
    assert torch.equal(got, kernel_launch.run_routed_experts(x, tw, ti, kw, lnc=2))


def test_nki_version_floor():
    assert kernel_launch.check_nki_version("0.5.0+28631259367.ga768afa6") == "0.5.0+28631259367.ga768afa6"
    assert kernel_launch.parse_version("0.3") == (0, 3, 0)
    with pytest.raises(NeuronLaunchError, match=r"nki 0.2.9 is too old.*>= 0.3.0"):
        kernel_launch.check_nki_version("0.2.9")
    with pytest.raises(NeuronLaunchError, match="without __version__"):
        kernel_launch.check_nki_version(None)
    with pytest.raises(NeuronLaunchError, match="cannot read"):
        kernel_launch.check_nki_version("dev")


def test_runtime_lnc():
    assert kernel_launch.runtime_lnc({}) == 2  # trn2's default
    assert kernel_launch.runtime_lnc({"NEURON_LOGICAL_NC_CONFIG": "1"}) == 1
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG='4'"):
        kernel_launch.runtime_lnc({"NEURON_LOGICAL_NC_CONFIG": "4"})


# --- stand-in: the Neuron branch's decision logic with monkeypatched host probes -------------------------

def _fake_host(monkeypatch, nki_version="0.5.0", wrap=True, nki=True):
    monkeypatch.setattr(kernel_launch, "neuron_device_present", lambda: (True, "1 Neuron device(s) (stand-in)"))
    fake_nki = types.SimpleNamespace(__version__=nki_version) if nki else None
    monkeypatch.setattr(kernel_launch, "real_nki", lambda: (fake_nki, "stand-in" if nki else "not importable (stand-in)"))
    calls = []

    def wrap_nki(kernel):  # stand-in launcher: records the grid, runs the interpreter's (traceable) launcher
        from vllm_moe_w8.neuron_glue import interpreter_hop

        inner = interpreter_hop.wrap_nki(kernel, kernel_launch.KERNELS[kernel.__name__][1])

        class Caller:
            def __getitem__(self, grid):
                calls.append((kernel.__name__, grid))
                return inner[grid]
        return Caller()

    if wrap:
        monkeypatch.setattr(kernel_launch, "import_wrap_nki", lambda: (wrap_nki, "stand_in.nki_hop"))
    else:
        def missing():
            raise NeuronLaunchError("no NKI launcher (wrap_nki) importable: stand-in")
        monkeypatch.setattr(kernel_launch, "import_wrap_nki", missing)
    return calls


def test_stand_in_neuron_host_launches_through_wrap_nki_with_the_lnc(fresh_backend, monkeypatch, small_layer):
    layer, kw = small_layer
    calls = _fake_host(monkeypatch)
    b = kernel_launch.backend()
    assert b.name == "neuron" and "stand_in.nki_hop.wrap_nki" in b.detail and "nki 0.5.0" in b.detail
    x = torch.randn(140, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    tw, ti = kernel_check.routing(140, 4, 2, seed=2)
    out = kernel_launch.run_routed_experts(x, tw, ti, kw, lnc=2)
    assert calls == [("moe_w8_blocks_pow2", 2)]  # 140 tokens: one launch of the block prefill kernel
    ref = kernel_check.reference_moe(x, tw, ti, *layer[:4], *layer[4], "e4m3")
    assert kernel_check.within_bound(out, ref, kernel_check.error_bound(x, tw, ti, *layer))[0]


@pytest.mark.parametrize("probe,match", [
    (dict(nki=False), "AWS nki is unusable"),
    (dict(nki_version="0.2.0"), "too old"),
    (dict(wrap=False), "wrap_nki"),
])
def test_stand_in_neuron_host_that_cannot_launch_is_an_error_not_a_fallback(fresh_backend, monkeypatch, probe, match):
    _fake_host(monkeypatch, **probe)
    with pytest.raises(NeuronLaunchError, match=match):
        kernel_launch.backend()


def test_served_selective_decode_with_the_intermediate_split():
    """I = 1024 at LNC 2: selective decode splits each block's intermediate (host_routed.split_inter); the served path
    passes the reference gate, and under torch.compile(fullgraph=True) it is one launch equal to the eager call."""
    from vllm_moe_w8.kernels import host_routed

    ckpt = kernel_check.checkpoint_experts(4, 256, 1024, seed=8)
    layer = kernel_check.repacked(ckpt, "pow2")
    kw = host.to_kernel_layout(*layer[:4], *layer[4], "e4m3")
    assert host_routed.split_inter(16, 16, 2, 1024)
    r = kernel_check.run_case("served", None, "pow2", 5, top_k=3, lnc=2, seed=5, layer=layer)
    assert r.kernel == "selective" and r.passed, f"{r.kernel}: {r.err_over_bound:.3f} x bound"
    where = kernel_launch.backend()
    fn = torch.compile(lambda x, tw, ti: kernel_launch.run_routed_experts(x, tw, ti, kw, lnc=2, where=where),
                       backend="eager", fullgraph=True, dynamic=False)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    tw, ti = kernel_check.routing(5, 4, 2, seed=5)
    assert torch.equal(fn(x, tw, ti), kernel_launch.run_routed_experts(x, tw, ti, kw, lnc=2))


# --- the 1-byte linear kernel's launch (run_linear_w8) --------------------------------------------------

@pytest.fixture(scope="module")
def small_linear():
    from vllm_moe_w8.kernels import host_linear

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(512, 256, generator=gen) * 0.02
    tiles = w.reshape(4, 128, 2, 128)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    codes = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(512, 256)
    return host_linear.linear_weights(codes, scale, name="layers.0.self_attn.qkv")


def test_linear_buckets_paths_and_splits_are_functions_of_the_shape():
    from vllm_moe_w8.kernels import host_linear as hl

    assert [hl.bucket_for(t) for t in (1, 16, 17, 100, 128)] == [16, 16, 32, 128, 128]
    assert [hl.bucket_for(t, lnc) for t, lnc in ((129, 1), (129, 2), (300, 1), (2048, 2), (2049, 2))] == [
        256, 256, 384, 2048, 2304]
    assert [hl.path_for(t) for t in (1, 128, 129, 8192)] == ["pow2", "pow2", "dequant", "dequant"]
    assert [hl.split_tokens(b, lnc) for b, lnc in ((16, 2), (128, 2), (256, 2), (256, 1))] == [0, 0, 1, 0]


@pytest.mark.parametrize("tokens", [3, 200])
def test_linear_launch_is_one_opaque_node_under_fullgraph_and_matches_eager(small_linear, tokens):
    """run_linear_w8 under torch.compile(fullgraph=True, dynamic=False): one graph, one moe_w8::nki_interpreted node
    (pow2 for decode, dequant for prefill) whose fake output is the contract's [bucket, N]; equal to the eager call."""
    from vllm_moe_w8.kernels import host_linear as hl

    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    where = kernel_launch.backend()
    fn = torch.compile(lambda x: kernel_launch.run_linear_w8(x, small_linear, lnc=2, where=where), backend=recorder,
                       fullgraph=True, dynamic=False)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    got = fn(x)
    op = torch.ops.moe_w8.nki_interpreted
    launches = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in (op, op.default)]
    assert len(graphs) == 1 and len(launches) == 1
    assert launches[0].args[0] == kernel_launch.LINEAR[hl.path_for(tokens)].__name__
    assert tuple(launches[0].meta["example_value"].shape) == (hl.bucket_for(tokens, 2), 512)
    assert torch.equal(got, kernel_launch.run_linear_w8(x, small_linear, lnc=2))


def test_linear_specialises_once_per_bucket(small_linear, monkeypatch):
    """Every T of a bucket launches the same kernel with the same shapes and constants (one compile per bucket)."""
    from vllm_moe_w8.kernels import host_routed

    keys = {}
    real = kernel_launch.launch

    def recording(kernel, lnc, tensors, constants, stats=None, where=None):
        keys.setdefault(tensors[0].shape[0], set()).add(host_routed.specialisation(kernel, tensors, constants))
        return real(kernel, lnc, tensors, constants, stats, where)

    monkeypatch.setattr(kernel_launch, "launch", recording)
    for t in (1, 7, 16, 17, 32):
        kernel_launch.run_linear_w8(torch.zeros(t, 256, dtype=torch.bfloat16), small_linear, lnc=2)
    assert {b: len(k) for b, k in keys.items()} == {16: 1, 32: 1}


def test_linear_launch_traces_on_meta(small_linear):
    """On the meta device (VLLM_NEURON_CPU_COMPILE) the launch is the interpreter op's fake: [T, N] fp32, no data."""
    meta = small_linear.to("meta")
    assert meta.codes.dtype == torch.uint8 and (meta.n, meta.k, meta.splits) == (512, 256, small_linear.splits)
    for t in (5, 300):
        y = kernel_launch.run_linear_w8(torch.zeros(t, 256, dtype=torch.bfloat16, device="meta"), meta, lnc=2,
                                        where=kernel_launch.backend())
        assert y.device.type == "meta" and tuple(y.shape) == (t, 512) and y.dtype == torch.float32


def test_stand_in_neuron_host_launches_the_linear_through_wrap_nki(fresh_backend, monkeypatch, small_linear):
    from vllm_moe_w8.kernels import host_linear as hl

    calls = _fake_host(monkeypatch)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    y = kernel_launch.run_linear_w8(x, small_linear, lnc=2)
    assert calls == [("linear_w8_pow2", 2)]
    assert hl.gate(y, x, small_linear)[0]
