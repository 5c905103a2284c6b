"""The custom op ``torch.ops.moe_w8.fused_moe``: fake (meta) implementation, torch.compile with varying
token counts, local ids of -1, dispatch report. Compared with the fp32 reference MoE."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.op import custom_op as moe_op
from vllm_moe_w8.op import reference as moe_reference

# Same stored weights, fp32 in both; only the summation order differs.
SUMMATION_RTOL = 1e-5


def _experts(num_experts=4, hidden=256, inter=192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, s13, w2, s2 = [], [], [], []
    for _ in range(num_experts):
        parts = []
        for shape in ((inter, hidden), (inter, hidden)):
            w = torch.randn(shape, generator=gen) * 0.05
            codes = (w * 448 / w.abs().max()).to(torch.float8_e4m3fn)
            rep = fp8.repack(codes, torch.rand(fp8.grid_shape(shape, (64, 64)), generator=gen) + 0.5, "pow2", (64, 64))
            parts.append(rep)
        w13.append(torch.cat([p.codes for p in parts]))
        s13.append(torch.cat([p.scales for p in parts]))
        codes = (torch.randn(hidden, inter, generator=gen) * 100).to(torch.float8_e4m3fn)
        rep = fp8.repack(codes, torch.rand(fp8.grid_shape((hidden, inter), (64, 64)), generator=gen) + 0.5, "pow2", (64, 64))
        w2.append(rep.codes)
        s2.append(rep.scales)
    return torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)


@pytest.fixture(scope="module")
def experts():
    return _experts()


def _inputs(t, k=2, e=4, hidden=256, seed=1):
    gen = torch.Generator().manual_seed(seed + t)
    x = torch.randn(t, hidden, generator=gen)
    w, ids = torch.rand(t, e, generator=gen).topk(k, dim=-1)
    return x, w.float(), ids.to(torch.int32)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_op_matches_reference_and_skips_non_local_ids(experts):
    x, w, ids = _inputs(11)
    ids[::3, 1] = -1  # expert not on this rank
    out = torch.ops.moe_w8.fused_moe(x, w, ids, *experts[:2], *experts[2:], 64, 64, "e4m3", "silu", 0.0)
    ref = moe_reference.reference_moe(x, w, ids, *experts[:2], *experts[2:], 64, 64, "e4m3")
    assert out.dtype == x.dtype and _rel(out, ref) < SUMMATION_RTOL
    out_bf16 = torch.ops.moe_w8.fused_moe(x.bfloat16(), w, ids, *experts[:2], *experts[2:], 64, 64, "e4m3")
    assert out_bf16.dtype == torch.bfloat16


def test_fake_impl_passes_opcheck(experts):
    x, w, ids = _inputs(5)
    torch.library.opcheck(torch.ops.moe_w8.fused_moe.default, (x, w, ids, *experts[:2], *experts[2:], 64, 64, "e4m3", "silu", 0.0),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_with_varying_token_counts(experts):
    torch._dynamo.reset()

    def routed(x, w, ids, w13, s13, w2, s2):
        y = torch.ops.moe_w8.fused_moe(x, w, ids, w13, s13, w2, s2, 64, 64, "e4m3", "silu", 0.0)
        return y * 2.0 + 1.0

    compiled = torch.compile(routed, fullgraph=True, dynamic=True)
    for t in (1, 5, 33, 2):
        x, w, ids = _inputs(t)
        eager = routed(x, w, ids, *experts)
        got = compiled(x, w, ids, *experts)
        assert got.shape == (t, 256)
        assert _rel(got, eager) < SUMMATION_RTOL


def test_compute_path_reports_the_cpu_path_and_why():
    name, why = moe_op.compute_path("cpu")
    assert name == "op.cpu.fused_moe_cpu"
    assert "CPU" in why and "Neuron" in why


def test_bad_arguments_are_refused(experts):
    x, w, ids = _inputs(3)
    with pytest.raises(ValueError, match="code_format 'e5m2' unknown"):
        torch.ops.moe_w8.fused_moe(x, w, ids, *experts[:2], *experts[2:], 64, 64, "e5m2")
    with pytest.raises(ValueError, match="activation 'gelu' unsupported"):
        torch.ops.moe_w8.fused_moe(x, w, ids, *experts[:2], *experts[2:], 64, 64, "e4m3", "gelu")


def test_a_cpu_implementation_that_cannot_import_is_an_error_naming_it():
    """No silent switch to the fp32 reference: the op refuses to exist without its CPU implementation."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm_moe_w8.op.cpu':\n"
        "            raise ImportError('planted: cpu implementation broken')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import vllm_moe_w8.op.custom_op\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "vllm_moe_w8.op.cpu failed to import" in r.stderr and "planted" in r.stderr, r.stderr[-2000:]
