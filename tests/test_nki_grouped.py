"""The token-grouped (prefill) kernels through their launch path (``kernel_launch.run_grouped_experts``,
executed by the interpreter here) against the fp32 reference on the same repacked experts: pow2 and
output-block, ragged token counts, an expert with no token, LNC 1 and 2; the host-side grouping on its own;
and work that grows with the routed rows, not with T x E_local."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_w8.kernels import grouping, host
from vllm_moe_w8.kernels.launch import simulate_moe
from vllm_moe_w8.kernels.nki_api import BACKEND
from vllm_moe_w8.neuron_glue import kernel_check, kernel_launch

QWEN = dict(H=2048, I=512)
GLM = dict(H=4096, I=2048)
GLM_TEST_SWIGLU_LIMIT = 0.5  # random weights give |gate|, |up| ~ 1: a limit of 0.5 makes the clamp bite


@pytest.fixture(scope="module")
def qwen_ckpt():
    return kernel_check.checkpoint_experts(6, QWEN["H"], QWEN["I"], seed=1)


@pytest.fixture(scope="module")
def qwen_layers(qwen_ckpt):
    return {mode: kernel_check.repacked(qwen_ckpt, mode) for mode in ("pow2", "output-block")}


@pytest.mark.parametrize("mode,tokens,lnc", [
    ("pow2", 129, 2),
    ("output-block", 300, 2),
    pytest.param("pow2", 200, 1, marks=pytest.mark.slow),
    pytest.param("output-block", 150, 1, marks=pytest.mark.slow),
])
def test_grouped_kernel_matches_the_reference(qwen_ckpt, qwen_layers, mode, tokens, lnc):
    r = kernel_check.run_case("grouped", qwen_ckpt, mode, tokens, top_k=4, lnc=lnc, seed=tokens, empty_expert=3, kernel="grouped",
                              layer=qwen_layers[mode])
    assert r.kernel == "grouped" and r.tokens == tokens
    assert r.passed, f"max err {r.max_abs_err:.3g} = {r.err_over_bound:.3f} x bound"


@pytest.mark.slow
def test_grouped_kernel_glm_width_with_swiglu_clamp():
    ckpt = kernel_check.checkpoint_experts(2, GLM["H"], GLM["I"], seed=2)
    r = kernel_check.run_case("glm", ckpt, "pow2", 130, top_k=2, lnc=2, seed=3, swiglu_limit=GLM_TEST_SWIGLU_LIMIT,
                              kernel="grouped")
    assert r.kernel == "grouped" and r.passed, f"{r.err_over_bound:.3f} x bound"


def test_the_gate_catches_one_doubled_scale_tile(qwen_ckpt, qwen_layers):
    """Fault injection: one 128x128 scale tile of one expert's down projection doubled (a realistic repack
    bug) must fail the same gate the kernel passes."""
    w13, s13, w2, s2, block = qwen_layers["pow2"]
    bad = s2.clone()
    bad[2, 5, 1] *= 2
    kw = host.to_kernel_layout(w13, s13, w2, bad, *block, "e4m3")
    x = torch.randn(160, QWEN["H"], generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    tw, ti = kernel_check.routing(160, 6, 4, seed=9)
    out = kernel_launch.run_grouped_experts(x, tw, ti, kw, lnc=1)
    ref = kernel_check.reference_moe(x, tw, ti, w13, s13, w2, s2, *block, "e4m3")
    ok, _, ratio = kernel_check.within_bound(out, ref, kernel_check.error_bound(x, tw, ti, w13, s13, w2, s2, block))
    assert not ok and ratio > 1


def test_grouping_pads_each_expert_to_whole_tiles_and_scatters_back():
    ids = torch.tensor([[0, 2], [2, -1], [2, 0], [-1, -1]])
    weights = torch.tensor([[0.625, 0.375], [1.0, 0.5], [0.25, 0.75], [1.0, 1.0]])
    g = grouping.group_by_expert(weights, ids, num_experts=4, programs=2)
    assert g.expert_tiles == (1, 0, 1, 0) and g.rows == 256 and g.routed == 5
    assert g.token_index[:2].tolist() == [0, 2] and g.token_index[128:131].tolist() == [0, 1, 2]
    assert g.row_weight[:2, 0].tolist() == [0.625, 0.75] and float(g.row_weight[2:128].abs().sum()) == 0
    assert (g.expert_program[0], g.expert_program[2]) == (0, 1)  # one tile for each core
    rows_out = torch.arange(256, dtype=torch.float32)[:, None].expand(256, 3)
    out = grouping.scatter_rows(rows_out, g, tokens=4)
    assert out[:, 0].tolist() == [0 + 128, 129, 1 + 130, 0]  # padding rows never reach a token
    with pytest.raises(ValueError, match="expert id 4 >= the 4 local experts"):
        grouping.group_by_expert(weights, ids + 2, num_experts=4)


def test_no_routed_token_gives_exact_zeros_without_a_launch(qwen_layers):
    w13, s13, w2, s2, block = qwen_layers["pow2"]
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    stats = []
    out = kernel_launch.run_grouped_experts(torch.ones(200, QWEN["H"]), torch.ones(200, 2), torch.full((200, 2), -1), kw,
                                           lnc=2, stats=stats)
    assert torch.equal(out, torch.zeros(200, QWEN["H"])) and stats == []


@pytest.mark.skipif(BACKEND != "interpreter", reason="counts the interpreter's Stats")
def test_grouped_work_grows_with_routed_rows_not_with_experts():
    """Same tokens, 8 local experts vs 2 routed-to: the grouped kernel reads only the routed experts'
    weights and multiplies only their tiles; the dense kernel's matmuls scale with every local expert."""
    ckpt = kernel_check.checkpoint_experts(8, 256, 128, seed=4)
    w13, s13, w2, s2, block = kernel_check.repacked(ckpt, "pow2")
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    x = torch.randn(256, 256).to(torch.bfloat16)
    ids = torch.stack([torch.arange(256) % 2, torch.full((256,), -1)], dim=1)  # experts 0 and 1 only
    tw = torch.ones(256, 2)
    grouped = []
    kernel_launch.run_grouped_experts(x, tw, ids, kw, lnc=1, stats=grouped)
    dense = []
    simulate_moe(x, tw, ids, kw, dense)  # one 256-token call of the dense kernel
    weight_bytes_per_expert = kw.w13[0].numel() + kw.w2[0].numel()
    g = grouped[0][0]
    assert g.hbm_read_bytes < 2 * weight_bytes_per_expert + 256 * 256 * 2 + 4096  # two experts' weights + rows
    assert sum(g.matmuls.values()) * 4 <= sum(dense[0].matmuls.values())


def test_an_expert_larger_than_one_pass_is_processed_in_passes(monkeypatch):
    """5 tiles per expert with room for 2 per pass: 3 passes, weights streamed once per pass, same result."""
    from vllm_moe_w8.kernels import moe_w8_grouped

    ckpt = kernel_check.checkpoint_experts(2, 256, 128, seed=5)
    w13, s13, w2, s2, block = kernel_check.repacked(ckpt, "pow2")
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    x = torch.randn(600, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ids = torch.stack([torch.zeros(600, dtype=torch.long), torch.ones(600, dtype=torch.long)], dim=1)
    tw = torch.rand(600, 2, generator=torch.Generator().manual_seed(6))
    ref = kernel_check.reference_moe(x, tw, ids, w13, s13, w2, s2, *block, "e4m3")
    bound = kernel_check.error_bound(x, tw, ids, w13, s13, w2, s2, block)
    one_pass, passes = [], []
    out_one = kernel_launch.run_grouped_experts(x, tw, ids, kw, lnc=1, stats=one_pass)
    monkeypatch.setattr(moe_w8_grouped, "HT_BUDGET_BYTES", 2 * 2 * 128 * 2)  # two 128-row tiles of hidden^T
    assert moe_w8_grouped.max_tiles(256) == 2
    out_passes = kernel_launch.run_grouped_experts(x, tw, ids, kw, lnc=1, stats=passes)
    assert kernel_check.within_bound(out_one, ref, bound)[0] and kernel_check.within_bound(out_passes, ref, bound)[0]
    weights = kw.w13.numel() + kw.w2.numel()
    if BACKEND == "interpreter":
        assert passes[0][0].hbm_read_bytes - one_pass[0][0].hbm_read_bytes == 2 * weights  # 3 passes instead of 1
        assert passes[0][0].peak_sbuf_bytes < one_pass[0][0].peak_sbuf_bytes


def test_the_grouped_launch_contract_is_checked_on_the_host(qwen_layers):
    """The traced grouped kernel cannot raise: host.check_grouped_args refuses each broken argument, naming it,
    and accepts the arguments run_routed_experts builds."""
    w13, s13, w2, s2, block = qwen_layers["pow2"]
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    ob = host.to_kernel_layout(*qwen_layers["output-block"][:4], *qwen_layers["output-block"][4], "e4m3")
    ids = torch.tensor([[0, 3], [3, 5]])
    g = grouping.group_by_expert(torch.ones(2, 2), ids, kw.num_experts, programs=2)
    rows = grouping.gather_rows(torch.randn(2, QWEN["H"]), g)
    weights = (kw.w13, kw.w13_scales, kw.w2, kw.w2_scales)
    host.check_grouped_args(rows, g.row_weight, *weights, g.expert_tiles, g.expert_program, mode="pow2", programs=2)
    cases = [
        ((rows[:128], g.row_weight) + weights + (g.expert_tiles, g.expert_program), "pow2", 2, "rows has 128 rows"),
        ((rows, g.row_weight[:, 0]) + weights + (g.expert_tiles, g.expert_program), "pow2", 2, "row_weight has shape"),
        ((rows.float(), g.row_weight) + weights + (g.expert_tiles, g.expert_program), "pow2", 2, "rows has dtype"),
        ((rows, g.row_weight) + weights + (g.expert_tiles, g.expert_program), "pow2", 1, "outside the launch grid"),
        ((rows, g.row_weight) + weights + (g.expert_tiles[:-1], g.expert_program), "pow2", 2, "one entry per local expert"),
        ((rows, g.row_weight) + weights + (g.expert_tiles, g.expert_program), "output-block", 2, "block-scale grid"),
        ((rows, g.row_weight, ob.w13, ob.w13_scales, ob.w2, ob.w2_scales, g.expert_tiles, g.expert_program), "pow2", 2,
         "w13_scales has shape"),
    ]
    for args, mode, programs, match in cases:
        with pytest.raises(ValueError, match=match):
            host.check_grouped_args(*args, mode=mode, programs=programs)
    with pytest.raises(ValueError, match="swiglu_limit"):
        host.check_grouped_args(rows, g.row_weight, *weights, g.expert_tiles, g.expert_program, mode="pow2", programs=2,
                                swiglu_limit=-1.0)
