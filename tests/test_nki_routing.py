"""The block kernels' routing metadata (kernels/routing.py) against a plain-Python construction, its capacity
bound, that it traces whole under torch.compile(fullgraph=True), and that the launch's compile key (kernel,
tensor shapes/dtypes, constants) is the same for every routing of a bucket: exactly one specialisation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from vllm_moe_w8.kernels import host, host_routed, routing
from vllm_moe_w8.neuron_glue import kernel_check


def python_blocks(topk_weights, topk_ids, num_experts, block_rows):
    """Per used block: (expert, {token: weight}) from plain Python loops (duplicates summed, weight-0 dropped)."""
    per_expert = [dict() for _ in range(num_experts)]
    for t, (ws, es) in enumerate(zip(topk_weights.tolist(), topk_ids.tolist())):
        for w, e in zip(ws, es):
            if 0 <= e < num_experts:
                per_expert[e][t] = per_expert[e].get(t, 0.0) + w
    blocks = []
    for e, rows in enumerate(per_expert):
        items = [(t, w) for t, w in sorted(rows.items()) if w != 0]
        for b0 in range(0, len(items), block_rows):
            blocks.append((e, dict(items[b0:b0 + block_rows])))
    return blocks


@pytest.mark.parametrize("tokens,top_k,experts,block,programs,aligned",
                         [(1, 8, 9, 16, 1, False), (7, 4, 6, 16, 2, False), (300, 4, 6, 128, 2, False),
                          (513, 8, 9, 128, 2, False), (300, 4, 6, 128, 2, True), (2000, 8, 9, 128, 2, True),
                          (700, 3, 5, 128, 3, True)])
def test_the_schedule_matches_a_python_construction(tokens, top_k, experts, block, programs, aligned):
    """... and with ``aligned`` (host_routed.aligned_shares) every expert's blocks lie in one program's share, the
    share boundaries being the expert starts nearest the equal split."""
    tw, ti = kernel_check.routing(tokens, experts, top_k, seed=tokens)
    s = routing.block_schedule(tw, ti, experts, block, programs, aligned=aligned)
    n = routing.capacity_blocks(tokens, top_k, experts, block)
    assert s.token_position_to_id.shape == (n, block) and s.token_position_to_id.dtype == torch.int32
    assert s.block_to_expert.shape == (n, 1) and s.block_range.shape == (programs, 2)
    want = python_blocks(tw, ti, experts, block)
    first, count = s.block_range[:, 0].tolist(), s.block_range[:, 1].tolist()
    assert sum(count) == len(want) and first[0] == 0
    assert all(first[p] + count[p] == first[p + 1] for p in range(programs - 1))  # contiguous shares
    assert max(count) - min(count) <= math.ceil(len(want) / programs)
    if aligned:
        owner = {}  # expert -> the programs whose shares hold its blocks
        for p in range(programs):
            for i in range(first[p], first[p] + count[p]):
                owner.setdefault(want[i][0], set()).add(p)
        assert all(len(ps) == 1 for ps in owner.values())
        starts = sorted({i for i, (e, _r) in enumerate(want) if i == 0 or want[i - 1][0] != e} | {len(want)})
        for p in range(1, programs):  # the expert start nearest p x used / programs
            target = p * len(want) / programs
            assert first[p] in starts and all(abs(first[p] - target) <= abs(c - target) for c in starts)
    for i, (expert, rows) in enumerate(want):
        ids = s.token_position_to_id[i].tolist()
        weights = s.position_weight[i].tolist()
        assert int(s.block_to_expert[i, 0]) == expert
        got = {t: w for t, w in zip(ids, weights) if t < tokens}
        assert got.keys() == rows.keys() and all(got[t] == pytest.approx(rows[t], rel=1e-6) for t in rows)
        if tokens <= block:  # selective decode: row r is token r (or padding T + r where r is not routed here)
            assert all(t in (r, tokens + r) for r, t in enumerate(ids))
        pads = [t for t in ids if t >= tokens]
        assert len(set(pads)) == len(pads) and all(tokens <= t < tokens + block for t in pads)  # distinct zero rows
        assert all(w == 0 for t, w in zip(ids, weights) if t >= tokens)
    # where each row is stored: a token's first row in its program's blocks (block order, then row order) is a
    # plain write, its later rows read-modify-write adds, everything else (padding) neither - checked by a walk
    stored = [set() for _ in range(programs)]
    for p in range(programs):
        for i in range(first[p], first[p] + count[p]):
            row_ids = s.token_position_to_id[i].tolist()
            writes, adds = s.position_store[i, :, 0].tolist(), s.position_store[i, :, 1].tolist()
            assert len({t for t in row_ids if t < tokens}) == len([t for t in row_ids if t < tokens])  # one row a token
            for r, t in enumerate(row_ids):
                if t >= tokens:  # padding: past the slab in both columns
                    assert writes[r] >= tokens and adds[r] >= tokens
                elif t in stored[p]:
                    assert (writes[r] >= tokens, adds[r]) == (True, t)
                else:
                    assert (writes[r], adds[r] >= tokens) == (t, True)
                    stored[p].add(t)
            want_load = experts if i > first[p] and int(s.block_to_expert[i - 1, 0]) == int(s.block_to_expert[i, 0]) \
                else int(s.block_to_expert[i, 0])
            assert int(s.block_load_expert[i, 0]) == want_load
    assert s.program_tokens.shape == (programs, tokens)
    assert [set(torch.nonzero(s.program_tokens[p]).flatten().tolist()) for p in range(programs)] == stored


def test_the_capacity_holds_every_routing():
    """Exhaustively for a small case (every top-2 choice of 3 tokens over 4 experts or off-rank, B = 2), then
    seeded routings at a prefill size: the used blocks never exceed the static capacity N."""
    tokens, top_k, experts, block = 3, 2, 4, 2
    n = routing.capacity_blocks(tokens, top_k, experts, block)
    choices = [c for c in itertools.product(range(-1, experts), repeat=top_k) if c[0] != c[1] or c[0] == -1]
    most = 0
    for combo in itertools.product(choices, repeat=tokens):
        ids = torch.tensor(combo)
        most = max(most, int(routing.block_schedule(torch.ones(tokens, top_k), ids, experts, block).block_range[:, 1].sum()))
    assert most <= n
    tokens, top_k, experts, block = 200, 4, 9, 128
    n = routing.capacity_blocks(tokens, top_k, experts, block)
    for seed in range(20):
        tw, ti = kernel_check.routing(tokens, experts, top_k, seed)
        assert int(routing.block_schedule(tw, ti, experts, block).block_range[:, 1].sum()) <= n


@pytest.mark.parametrize("aligned", [False, True])
def test_the_schedule_traces_whole_under_torch_compile(aligned):
    torch._dynamo.reset()
    tw, ti = kernel_check.routing(300, 6, 4, seed=3)
    eager = routing.block_schedule(tw, ti, 6, 128, 2, aligned=aligned)
    compiled = torch.compile(lambda w, i: routing.block_schedule(w, i, 6, 128, 2, aligned=aligned).tensors(),
                             fullgraph=True, backend="eager")
    for a, b in zip(eager.tensors(), compiled(tw, ti)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("aligned", [False, True])
def test_the_schedule_runs_on_the_routing_device_without_reading_values(aligned):
    """On the meta device no value can be read: building the schedule there proves it never does."""
    tw, ti = kernel_check.routing(300, 6, 4, seed=1)
    s = routing.block_schedule(tw.to("meta"), ti.to("meta"), 6, 128, 2, aligned=aligned)
    assert all(t.device.type == "meta" for t in s.tensors())


@pytest.mark.parametrize("tokens,inter", [(1, 128), (16, 128), (384, 128), (1, 256), (1, 1024), (16, 1024)])
def test_one_specialisation_per_bucket_over_many_routings(tokens, inter):
    """I = 1024 at LNC 2: selective decode splits the intermediate (split_inter=1: 512 rows a program), still one
    compile per bucket; I = 256 (128-row shares) splits it at bucket 1 only (host_routed.split_inter's static
    rule); I = 128 cannot split."""
    ckpt = kernel_check.checkpoint_experts(4, 256, inter, seed=0)
    w13, s13, w2, s2, block = kernel_check.repacked(ckpt, "pow2")
    kw = host.to_kernel_layout(w13, s13, w2, s2, *block, "e4m3")
    bucket = host_routed.selective_bucket(tokens) if tokens <= host_routed.SELECTIVE_MAX_TOKENS else tokens
    keys = set()
    for seed in range(40):
        tw, ti = kernel_check.routing(tokens, kw.num_experts, 2, seed)
        x = torch.randn(tokens, 256)
        pad = bucket - tokens  # the caller pads to the bucket; padded tokens carry no route
        x, tw, ti = host.pad_rows(x, bucket), host.pad_rows(tw, bucket), torch.cat([ti, ti.new_full((pad, 2), -1)])
        kernel, tensors, consts, _stored = host_routed.block_call(x, tw, ti, kw, programs=2)
        host_routed.check_block_args(tensors, consts, kw.mode, 2, bucket, 2)
        keys.add(host_routed.specialisation(kernel, tensors, consts))
        split = tokens <= host_routed.SELECTIVE_MAX_TOKENS and (inter == 1024 or (tokens == 1 and inter == 256))
        assert consts["split_inter"] == int(split)
        first, count = tensors[-1][:, 0].tolist(), tensors[-1][:, 1].tolist()
        if split:  # every program walks every used block
            assert first == [0, 0] and count[0] == count[1] > 0
        else:
            assert first[0] == 0 and first[1] == count[0]
    assert len(keys) == 1


def test_the_block_launch_contract_is_checked_on_the_host():
    ckpt = kernel_check.checkpoint_experts(4, 256, 128, seed=0)
    kw = host.to_kernel_layout(*kernel_check.repacked(ckpt, "pow2")[:4], 128, 128, "e4m3")
    tw, ti = kernel_check.routing(32, 4, 2, seed=0)
    kernel, tensors, consts, _stored = host_routed.block_call(torch.randn(32, 256), tw, ti, kw, programs=2)
    host_routed.check_block_args(tensors, consts, "pow2", 2, 32, 2)
    bad = list(tensors)
    bad[5] = tensors[5][:-1]
    with pytest.raises(ValueError, match="token_position_to_id has shape"):
        host_routed.check_block_args(tuple(bad), consts, "pow2", 2, 32, 2)
    bad = list(tensors)
    bad[6] = tensors[6].double()
    with pytest.raises(ValueError, match="position_weight has dtype"):
        host_routed.check_block_args(tuple(bad), consts, "pow2", 2, 32, 2)
    with pytest.raises(ValueError, match="block_range has shape"):
        host_routed.check_block_args(tensors, consts, "pow2", 1, 32, 2)
    assert consts["split_inter"] == 0  # I = 128 at LNC 2: no 128-row share, the static fallback splits the blocks
    with pytest.raises(ValueError, match="split_inter=1 needs .* I=128 a multiple of 2 x 128"):
        host_routed.check_block_args(tensors, {**consts, "split_inter": 1}, "pow2", 2, 32, 2)
    with pytest.raises(ValueError, match="expert id 7 >= the 4 local experts"):
        routing.check_routing(ti + 4, 4)


@pytest.mark.parametrize("inter", [128, 1024])
def test_the_launch_arguments_trace_whole_under_torch_compile(inter):
    """host_routed.block_call (padding, schedule, argument tuple) inside a fullgraph-compiled forward, with the
    block split (I = 128) and the intermediate split (I = 1024: split_inter=1)."""
    torch._dynamo.reset()
    ckpt = kernel_check.checkpoint_experts(4, 256, inter, seed=0)
    kw = host.to_kernel_layout(*kernel_check.repacked(ckpt, "pow2")[:4], 128, 128, "e4m3")
    tw, ti = kernel_check.routing(16, 4, 2, seed=5)
    x = torch.randn(16, 256)
    assert host_routed.block_call(x, tw, ti, kw, programs=2)[2]["split_inter"] == int(inter == 1024)

    def args(x, w, i):
        return host_routed.block_call(x, w, i, kw, programs=2)[1]

    for a, b in zip(args(x, tw, ti), torch.compile(args, fullgraph=True, backend="eager")(x, tw, ti)):
        assert torch.equal(a, b)


def test_the_selective_threshold_is_the_recorded_decode_study():
    """SELECTIVE_MAX_TOKENS per scenario is where bench_nki_kernels.py --routed found selective decode cheaper than
    the all-expert kernel at both decode shapes; schedule_for follows the loaded scenario's threshold."""
    import json
    from pathlib import Path

    from vllm_moe_w8.kernels import moe_w8

    rec = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "results" /
                      "bench_nki_routed_decode.json").read_text())
    assert host_routed.SELECTIVE_MAX_TOKENS_BY_SCENARIO == rec["selective_cheaper_up_to_by_scenario"]
    for name, t in rec["selective_cheaper_up_to_by_scenario"].items():
        rows = [r for r in rec["rows"] if r["T"] > 1]
        assert all(r[f"selective_{name}_ms"] < r[f"dense_{name}_ms"] for r in rows if r["T"] <= t), name
        assert any(r[f"selective_{name}_ms"] >= r[f"dense_{name}_ms"] for r in rows if r["T"] > t) or t == 128, name
    limit = host_routed.SELECTIVE_MAX_TOKENS
    assert limit == host_routed.SELECTIVE_MAX_TOKENS_BY_SCENARIO[moe_w8.POW2_SCHEDULE.scenario]
    assert host_routed.schedule_for(limit) == "selective" and host_routed.schedule_for(limit + 1) == "dense"
    assert host_routed.schedule_for(129) == "blocks" and host_routed.block_rows(limit + 1) == 128
