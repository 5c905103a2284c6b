"""The device-scheduled kernels (kernels/moe_w8_blocks.py: selective decode and block prefill) in the interpreter
against the fp32 reference on the same repacked experts, with neuron-check's gate (kernel_check.within_bound /
error_bound: the bf16 activation's rounding bound) and its fault-injection twins; and the decode property the
kernels exist for: a T=1 call reads only its routed experts' bytes."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_w8.kernels import host, launch, schedule
from vllm_moe_w8.kernels.nki_api import BACKEND
from vllm_moe_w8.neuron_glue import kernel_check as kc

QWEN = dict(H=2048, I=512)
GLM = dict(H=4096, I=2048)
GLM_TEST_SWIGLU_LIMIT = 0.5  # random weights give |gate|, |up| ~ 1: a limit of 0.5 makes the clamp bite
interpreter_only = pytest.mark.skipif(BACKEND != "interpreter", reason="counts the interpreter's Stats")


@pytest.fixture(scope="module")
def qwen_ckpt():
    return kc.checkpoint_experts(6, QWEN["H"], QWEN["I"], seed=1)


@pytest.fixture(scope="module")
def qwen_layers(qwen_ckpt):
    return {mode: kc.repacked(qwen_ckpt, mode) for mode in ("pow2", "output-block")}


def gate(layer, tokens, top_k, lnc, seed, fault=None, swiglu_limit=0.0, empty_expert=None, vector_blocks=None,
         stationary_max_tokens=None):
    """(passed, err/bound, stats) of one simulate_routed call vs the reference; ``fault(kw)`` corrupts the kernel's
    copy of the weights only; ``stationary_max_tokens`` the weights-stationary threshold (None: the loaded one)."""
    w13, s13, w2, s2, block = layer
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    if fault is not None:
        kw = host.KernelWeights(kw.w13.clone(), kw.w13_scales.clone(), kw.w2.clone(), kw.w2_scales.clone(), kw.mode)
        fault(kw)
    x = torch.randn(tokens, w2.shape[1], generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    tw, ti = kc.routing(tokens, w13.shape[0], top_k, seed, empty_expert)
    stats = []
    out = launch.simulate_routed(x, tw, ti, kw, lnc=lnc, stats=stats, swiglu_limit=swiglu_limit,
                                 vector_blocks=vector_blocks, stationary_max_tokens=stationary_max_tokens)
    ref = kc.reference_moe(x, tw, ti, w13, s13, w2, s2, *block, "e4m3", swiglu_limit=swiglu_limit)
    ok, _err, ratio = kc.within_bound(out, ref, kc.error_bound(x, tw, ti, w13, s13, w2, s2, block, swiglu_limit))
    unrouted = ((ti < 0) | (tw == 0)).all(dim=1)
    assert bool((out[unrouted] == 0).all()), "a token routed to no local expert must get exactly 0"
    return ok, ratio, stats


@pytest.mark.parametrize("mode,tokens,lnc", [("pow2", 1, 1), ("pow2", 16, 2), ("output-block", 5, 2),
                                             ("pow2", 300, 2), ("output-block", 200, 1)])
def test_block_kernels_match_the_reference(qwen_layers, mode, tokens, lnc):
    ok, ratio, _ = gate(qwen_layers[mode], tokens, top_k=4, lnc=lnc, seed=tokens, empty_expert=3)
    assert ok, f"err/bound {ratio:.3f}"


WS_ON = 128  # stationary_max_tokens: weights-stationary wherever host_routed.stationary_weights' shape rule allows


@pytest.mark.parametrize("tokens,lnc,vector_blocks", [(1, 1, 0), (1, 2, 5), (5, 2, 0), (16, 1, 5)])
def test_weights_stationary_selective_decode_matches_the_reference(qwen_layers, tokens, lnc, vector_blocks):
    """Selective decode weights-stationary (kernels/weights_stationary.py; T = 1 at LNC 2 splits I = 512 into 256-row
    shares) passes the same gate as token-stationary, the scale-adds batched per PSUM bank on VectorE."""
    from vllm_moe_w8.kernels import host_routed

    bucket = host_routed.selective_bucket(tokens)
    assert host_routed.stationary_weights(bucket, bucket, lnc, QWEN["H"], QWEN["I"], "pow2", WS_ON)
    ok, ratio, stats = gate(qwen_layers["pow2"], tokens, top_k=4, lnc=lnc, seed=tokens, empty_expert=3,
                            vector_blocks=vector_blocks, stationary_max_tokens=WS_ON)
    assert ok, f"err/bound {ratio:.3f}"
    if BACKEND == "interpreter":
        ops = {(eng, op) for st in stats[0] for (eng, op, _p, _f) in st.engine_ops}
        assert ("vector", "tensor_reduce") in ops and ("vector", "scalar_tensor_tensor") not in ops


@pytest.mark.parametrize("tokens", [3, 260])
def test_the_gate_refuses_one_doubled_scale_tile(qwen_layers, tokens):
    """Fault twin: one 128x128 tile of expert 0's down-projection scales doubled (expert 0 is routed by
    kc.routing) must fail the gate the kernels pass."""
    def double_tile(kw):
        kw.w2_scales[0, 5, 1] *= 2

    ok, ratio, _ = gate(qwen_layers["pow2"], tokens, top_k=4, lnc=2, seed=tokens, fault=double_tile)
    assert not ok and ratio > 1


SCHEDULES = sorted(schedule.SCHEDULES.items())


@pytest.mark.parametrize("scenario,vector_blocks", SCHEDULES + [("all-vector", schedule.BLOCK_PERIOD)])
@pytest.mark.parametrize("tokens", [2, 140])
def test_block_kernels_follow_the_pow2_schedule(qwen_layers, scenario, vector_blocks, tokens):
    """Every engine split of kernels/schedule.py (block_scale.contract_pow2 in the block kernels) passes the gate,
    puts the block scale-adds where the schedule says (VectorE scalar_tensor_tensor iff vector_blocks > 0, GpSimd
    [rows, 128] adds in SBUF iff some block is off VectorE; I = 512 so the activation products are 512 wide), and the interpreter's GpSimd/PSUM rule held for every op."""
    ok, ratio, stats = gate(qwen_layers["pow2"], tokens, top_k=4, lnc=1, seed=tokens, vector_blocks=vector_blocks)
    assert ok, f"{scenario}: err/bound {ratio:.3f}"
    if BACKEND == "interpreter":
        ops = {(eng, op) for st in stats[0] for (eng, op, _p, _f) in st.engine_ops}
        assert (("vector", "scalar_tensor_tensor") in ops) == (vector_blocks > 0), scenario
        gpsimd_block_adds = {(eng, op) for st in stats[0] for (eng, op, _p, free) in st.engine_ops if free == 128}
        assert (("gpsimd", "tensor_tensor") in gpsimd_block_adds) == (vector_blocks < schedule.BLOCK_PERIOD), scenario


@pytest.mark.parametrize("scenario,vector_blocks", SCHEDULES)
def test_the_gate_refuses_a_doubled_scale_tile_in_every_schedule(qwen_layers, scenario, vector_blocks):
    def double_tile(kw):
        kw.w13_scales[0, 2, 3] *= 2

    ok, ratio, _ = gate(qwen_layers["pow2"], 3, top_k=4, lnc=1, seed=3, fault=double_tile, vector_blocks=vector_blocks)
    assert not ok and ratio > 1, scenario


@pytest.mark.parametrize("which", ["w13", "w2"])
def test_the_gate_refuses_a_doubled_scale_tile_weights_stationary(qwen_layers, which):
    """Fault twin of the weights-stationary scale views (block j's k-th scale at nb * G + k, broadcast along T): one
    tile of a routed expert doubled must fail the gate."""
    def double_tile(kw):
        if which == "w13":
            kw.w13_scales[0, 5, 9] *= 2  # an up-projection tile (I = 512: output blocks 4..7 are up's)
        else:
            kw.w2_scales[0, 11, 2] *= 2

    ok, ratio, _ = gate(qwen_layers["pow2"], 3, top_k=4, lnc=1, seed=3, fault=double_tile, stationary_max_tokens=WS_ON)
    assert not ok and ratio > 1


def test_the_gate_refuses_swapped_gate_and_up(qwen_layers):
    def swap(kw):
        inter = kw.w13.shape[3] // 2
        kw.w13[0] = torch.cat([kw.w13[0, ..., inter:], kw.w13[0, ..., :inter]], dim=-1)

    ok, ratio, _ = gate(qwen_layers["output-block"], 2, top_k=4, lnc=1, seed=2, fault=swap)
    assert not ok and ratio > 1


@pytest.mark.slow
def test_glm_width_selective_decode_with_swiglu_clamp():
    layer = kc.repacked(kc.checkpoint_experts(3, GLM["H"], GLM["I"], seed=2), "pow2")
    ok, ratio, _ = gate(layer, 2, top_k=2, lnc=2, seed=4, swiglu_limit=GLM_TEST_SWIGLU_LIMIT)
    assert ok, f"err/bound {ratio:.3f}"


@interpreter_only
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_decode_reads_only_the_routed_experts(max_tokens):
    """T=1 routed to experts 3 and 11 of 16 local: the selective kernel reads those two experts' weights and
    scales, the token once and each block's metadata, and writes the token's output row once (accumulated in SBUF:
    no zero fill, no read-modify-write) - token- and weights-stationary alike; the dense kernel reads all 16."""
    from vllm_moe_w8.kernels import host_routed

    layer = kc.repacked(kc.checkpoint_experts(16, 256, 256, seed=7), "pow2")
    kw = host.to_kernel_layout(*layer[:4], *layer[4], "e4m3")
    x = torch.randn(1, 256).to(torch.bfloat16)
    ids, tw = torch.tensor([[3, 11, -1, -1]]), torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    expert_bytes = (kw.w13[0].numel() + kw.w2[0].numel() + 4 * (kw.w13_scales[0].numel() + kw.w2_scales[0].numel()))
    assert host_routed.selective_bucket(1) == 1 and host_routed.stationary_weights(1, 1, 1, 256, 256, "pow2", max_tokens) \
        == bool(max_tokens)
    selective = []
    launch.simulate_routed(x, tw, ids, kw, lnc=1, stats=selective, stationary_max_tokens=max_tokens)
    dense = []
    launch.simulate_moe(x, tw, ids, kw, dense)
    sel, den = selective[0][0], dense[0]
    per_call = 256 * 2 + 8  # the token row (bf16) and the program's block range
    per_block = 4 + 4  # the block's expert id and its token weight
    assert sel.hbm_read_bytes == 2 * (expert_bytes + per_block) + per_call
    assert sel.hbm_write_bytes == 256 * 4  # the token's output row, once
    assert den.hbm_read_bytes >= 16 * kw.w13[0].numel()
    # one dynamic trip per routed expert's block and no 0/1 reload loop (T <= B: every block is a new expert)
    assert (sel.dynamic_iterations, sel.register_loads) == (2, 1)


@interpreter_only
@pytest.mark.parametrize("mode", ["pow2", "output-block"])
def test_an_expert_with_several_blocks_loads_its_weights_once(qwen_layers, mode):
    """300 tokens all routed to experts 0 and 1: 3 blocks each; with resident codes (a Qwen-width expert fits SBUF)
    each expert's weights cross HBM once per program share, not once per block - and the result is the same. At one
    program output-block plain-writes each token's first row (moe_w8_blocks.plain_first_rows), pow2 adds every row
    into the zero-filled slab."""
    from vllm_moe_w8.kernels import moe_w8_blocks

    w13, s13, w2, s2, block = qwen_layers[mode]
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    assert moe_w8_blocks.resident_weights(QWEN["H"], QWEN["I"])
    x = torch.randn(300, QWEN["H"], generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    ids = torch.stack([torch.zeros(300, dtype=torch.long), torch.ones(300, dtype=torch.long)], dim=1)
    tw = torch.rand(300, 2, generator=torch.Generator().manual_seed(9))
    stats = []
    out = launch.simulate_routed(x, tw, ids, kw, lnc=1, stats=stats)
    ref = kc.reference_moe(x, tw, ids, w13, s13, w2, s2, *block, "e4m3")
    assert kc.within_bound(out, ref, kc.error_bound(x, tw, ids, w13, s13, w2, s2, block))[0]
    st = stats[0][0]
    codes = kw.w13[0].numel() + kw.w2[0].numel()
    assert st.dynamic_iterations == 6  # six blocks; the weight loads of the four that continue an expert are skipped
    # gathered rows (bf16, padding included) and the read-modify-writes: output-block adds only the 300 rows that are
    # a token's second (expert 1's; each token's expert-0 row is its first, a plain write), pow2 all 600 routed rows;
    # the 168 padding rows move nothing
    plain = moe_w8_blocks.plain_first_rows(1, 300, 128, mode)
    assert plain == (mode == "output-block")
    moved = 6 * 128 * QWEN["H"] * 2 + (300 if plain else 600) * QWEN["H"] * 4
    assert 2 * codes + moved <= st.hbm_read_bytes <= 2 * codes + moved + 64 * 1024  # not 6 x codes
    assert st.hbm_write_bytes == (300 + 600) * QWEN["H"] * 4  # zero fill of the 300 tokens, then the 600 routed rows


@interpreter_only
@pytest.mark.parametrize("mode", ["pow2", "output-block"])
def test_glm_width_prefill_at_lnc2_reads_each_experts_codes_once(mode, monkeypatch):
    """GLM-5.3-Flash width (192 KiB of codes per partition: resident, moe_w8_blocks.RESIDENT_BYTES, within SBUF under
    the interpreter's live-range rule): 300 tokens on expert 0 (3 blocks), the first 100 also on expert 1 (1 block).
    At LNC 2 the programs' shares start at an expert boundary (host_routed.aligned_shares: blocks 0-2 / 3), so each
    expert's codes cross HBM once in the call and the result passes the gate; the fault twin - equal shares of 2 / 2
    blocks - reads expert 0's codes in both programs."""
    from vllm_moe_w8.kernels import host_routed

    assert host_routed.aligned_shares(300, 128, 2, GLM["H"], GLM["I"], 2)  # the rule (Qwen3.5 EP=8: 32 experts, no)
    assert not host_routed.aligned_shares(8192, 128, 2, QWEN["H"], QWEN["I"], 32)
    w13, s13, w2, s2, block = kc.repacked(kc.checkpoint_experts(2, GLM["H"], GLM["I"], seed=6), mode)
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    x = torch.randn(300, GLM["H"], generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ids = torch.stack([torch.zeros(300, dtype=torch.long), torch.where(torch.arange(300) < 100, 1, -1)], dim=1)
    tw = torch.rand(300, 2, generator=torch.Generator().manual_seed(7))
    codes = kw.w13[0].numel() + kw.w2[0].numel()
    ref = kc.reference_moe(x, tw, ids, w13, s13, w2, s2, *block, "e4m3", swiglu_limit=GLM_TEST_SWIGLU_LIMIT)
    bound = kc.error_bound(x, tw, ids, w13, s13, w2, s2, block, GLM_TEST_SWIGLU_LIMIT)
    for aligned, reads in ((True, 2), (False, 3)):  # False: the FAULT twin
        monkeypatch.setattr(host_routed, "aligned_shares", lambda *a, _on=aligned: _on)
        stats = []
        out = launch.simulate_routed(x, tw, ids, kw, lnc=2, stats=stats, swiglu_limit=GLM_TEST_SWIGLU_LIMIT)
        assert kc.within_bound(out, ref, bound)[0]
        total = sum(st.hbm_read_bytes for st in stats[0])
        assert reads * codes <= total <= reads * codes + 4 * 128 * GLM["H"] * 2 + 400 * GLM["H"] * 4 + 2 ** 20, aligned


@interpreter_only
@pytest.mark.parametrize("mode", ["pow2", "output-block"])
def test_lnc2_prefill_slabs_hold_only_their_programs_rows(qwen_layers, mode):
    """Block prefill at LNC 2 writes no zero fill: each program's slab holds exactly the rows of the tokens its blocks
    store (routing's program_tokens; every other row never written - NaN from the interpreter), the masked sum passes
    the gate, and its fault twin - the slabs summed without the masks - is refused (NaN where a token's row is
    missing from a slab: here every token lacks one in some slab)."""
    from vllm_moe_w8.kernels import host_routed, routing
    from vllm_moe_w8.kernels.nki_cpu import launch as nki_launch

    w13, s13, w2, s2, block = qwen_layers[mode]
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    tokens = 260
    x = torch.randn(tokens, QWEN["H"], generator=torch.Generator().manual_seed(21)).to(torch.bfloat16)
    tw, ti = kc.routing(tokens, kw.num_experts, 4, 21)
    kernel, tensors, consts, stored = host_routed.block_call(x, tw, ti, kw, 2)
    assert host_routed.block_call(x[:8], tw[:8], ti[:8], kw, 2)[3] is None  # selective decode: zero-filled slabs
    out, _ = nki_launch(kernel, (2,), *[launch.numpy_arg(t) for t in tensors], lnc=2, **consts)
    partials = torch.from_numpy(out)
    for p in range(2):
        assert torch.equal(torch.isnan(partials[p]).all(dim=1), ~stored[p])
        assert not torch.isnan(partials[p][stored[p]]).any()
    ref = kc.reference_moe(x, tw, ti, w13, s13, w2, s2, *block, "e4m3")
    bound = kc.error_bound(x, tw, ti, w13, s13, w2, s2, block)
    assert kc.within_bound(routing.combine(partials, tokens, stored), ref, bound)[0]
    ok, _err, _ratio = kc.within_bound(routing.combine(partials, tokens), ref, bound)  # FAULT: no masks
    assert not ok


def _fp8_matmuls(st):
    """The weight-matmul work of one program: K x N moving elements summed over the matmuls with FP8 codes moving
    (the scale broadcasts and transposes excluded). A share of I makes as many gate/up matmuls, each half as wide."""
    return sum(k * n * count for (k, _m, n, _st, mv), count in st.matmuls.items() if "float8" in mv)


SPLIT = dict(H=2048, I=1024)  # I / 2 = 512: host_routed.split_inter splits the intermediate at LNC 2


@pytest.fixture(scope="module")
def split_layers():
    ckpt = kc.checkpoint_experts(4, SPLIT["H"], SPLIT["I"], seed=5)
    return {mode: kc.repacked(ckpt, mode) for mode in ("pow2", "output-block")}


@interpreter_only
@pytest.mark.parametrize("mode", ["pow2", "output-block"])
def test_lnc2_selective_decode_splits_a_lone_experts_intermediate(split_layers, mode):
    """T=1 routed to one local expert at LNC=2 (I = 1024: 512 intermediate rows a program, host_routed.split_inter):
    each program makes half the LNC=1 launch's weight-matmul work and reads half the expert's codes (plus the scale rows,
    the token and the metadata), and the two partial sums add up to the LNC=1 result within the gate's bound (both
    pass the reference gate)."""
    from vllm_moe_w8.kernels import host_routed

    w13, s13, w2, s2, block = split_layers[mode]
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    assert host_routed.split_inter(1, host_routed.selective_bucket(1), 2, SPLIT["I"])
    assert host_routed.split_inter(8, 8, 2, SPLIT["I"]) and not host_routed.split_inter(1, 1, 1, SPLIT["I"])
    # 256-row shares (Qwen3.5's I = 512 at LNC 2) only at bucket 1, where a lone block would leave a core idle
    assert host_routed.split_inter(1, 1, 2, QWEN["I"]) and not host_routed.split_inter(2, 2, 2, QWEN["I"])
    x = torch.randn(1, SPLIT["H"], generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    ids, tw = torch.tensor([[2, -1, -1, -1]]), torch.tensor([[0.75, 0.0, 0.0, 0.0]])
    one, two = [], []
    out1 = launch.simulate_routed(x, tw, ids, kw, lnc=1, stats=one)
    out2 = launch.simulate_routed(x, tw, ids, kw, lnc=2, stats=two)
    (st1,), (p0, p1) = one[0], two[0]
    assert _fp8_matmuls(st1) > 0 and _fp8_matmuls(p0) == _fp8_matmuls(p1) == _fp8_matmuls(st1) // 2
    codes = kw.w13[0].numel() + kw.w2[0].numel()
    scales = 4 * (kw.w13_scales[0].numel() + kw.w2_scales[0].numel())
    per_call = SPLIT["H"] * 2 + 8 + 4  # the token row, the block count (LNC 2: a register load) / range, expert id
    assert codes <= st1.hbm_read_bytes
    for st in (p0, p1):
        assert codes // 2 + scales <= st.hbm_read_bytes <= codes // 2 + scales + per_call + 4
        assert st.hbm_write_bytes == SPLIT["H"] * 4  # its partial of the token's row, once
        assert st.dynamic_iterations == 1  # every program walks the one used block
    bound = kc.error_bound(x, tw, ids, w13, s13, w2, s2, block)
    ref = kc.reference_moe(x, tw, ids, w13, s13, w2, s2, *block, "e4m3")
    assert kc.within_bound(out1, ref, bound)[0] and kc.within_bound(out2, ref, bound)[0]
    assert kc.within_bound(out2, out1, bound)[0]


def _same_half(pid, share):
    return 0  # the fault: every program computes the first share of I


@pytest.mark.parametrize("mode,limit,ws", [("pow2", 0.0, 0), ("pow2", GLM_TEST_SWIGLU_LIMIT, 0), ("output-block", 0.0, 0),
                                           ("pow2", 0.0, WS_ON), ("pow2", GLM_TEST_SWIGLU_LIMIT, WS_ON)])
def test_the_gate_refuses_both_programs_computing_the_same_half(split_layers, mode, limit, ws, monkeypatch):
    """The intermediate split (T = 3, LNC 2, with and without the GLM clamp, token- and weights-stationary) passes the
    gate; its fault twin - both programs on I rows [0, I/2), the second half never computed and the first counted
    twice - must fail it."""
    from vllm_moe_w8.kernels import selective_decode

    ok, ratio, _ = gate(split_layers[mode], 3, top_k=2, lnc=2, seed=12, swiglu_limit=limit, stationary_max_tokens=ws)
    assert ok, f"err/bound {ratio:.3f}"
    monkeypatch.setattr(selective_decode, "inter_start", _same_half)
    ok, ratio, _ = gate(split_layers[mode], 3, top_k=2, lnc=2, seed=12, swiglu_limit=limit, stationary_max_tokens=ws)
    assert not ok and ratio > 1


@pytest.mark.parametrize("mode", ["pow2", "output-block"])
def test_the_gate_refuses_a_doubled_scale_tile_in_the_second_half(split_layers, mode):
    """Fault twin of the split's scale offsets: one scale tile of program 1's half of I doubled (pow2: a down-projection
    tile at k = 6 of 8; output-block: up's block 13 - 8 = 5 of 8) must fail the gate at LNC 2."""
    def double_tile(kw):
        if mode == "pow2":
            kw.w2_scales[0, 5, 6] *= 2
        else:
            kw.w13_scales[0, 13, 0] *= 2

    ok, ratio, _ = gate(split_layers[mode], 3, top_k=2, lnc=2, seed=12, fault=double_tile)
    assert not ok and ratio > 1


def test_the_one_program_store_is_the_recorded_cheaper_one():
    """moe_w8_blocks.PLAIN_FIRST_AT_ONE_PROGRAM per mode is the store benchmarks/bench_grouped_prefill.py found no
    slower in either cost scenario at 2k and 8k tokens (LNC 1, the zero-filled slab), and cheaper in at least one."""
    import json
    from pathlib import Path

    from vllm_moe_w8.kernels import moe_w8_blocks

    rec = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "grouped_prefill.json").read_text())
    rows = [r for r in rec["rows"] if r["kernel"] == "blocks" and r["LNC"] == 1]
    assert {r["mode"] for r in rows} == set(moe_w8_blocks.PLAIN_FIRST_AT_ONE_PROGRAM)
    for mode, plain in moe_w8_blocks.PLAIN_FIRST_AT_ONE_PROGRAM.items():
        mine = [r for r in rows if r["mode"] == mode]
        assert all(r["plain_first_rows"] == plain for r in mine), mode
        pairs = [(r[f"{n}_kernel_ms"], r[f"{n}_kernel_ms_other_store"]) for r in mine for n in rec["scenarios"]]
        assert all(a <= b * (1 + 1e-9) for a, b in pairs) and any(a < b * (1 - 1e-3) for a, b in pairs), mode
