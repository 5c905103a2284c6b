"""AWS's MoE kernels: nki-library @d2ad3a57 ``core/moe/moe_tkg`` (decode: selective and all-expert, BF16 and FP8
per-row scales) and ``core/moe/moe_cte`` (prefill: block-scheduled, sharded on I, BF16 and FP8 per-channel scales),
launched as their tests launch them (LNC=2, grid [2]); and nki-samples' ``blockwise_mm`` (legacy API)."""

from __future__ import annotations

import importlib
import math

import ml_dtypes
import numpy as np

from . import references as R
from .case import LIBRARY, SAMPLES_LEGACY, Case

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3
ROOT = "src"
TKG = "src/nkilib_src/nkilib/core/moe/moe_tkg/moe_tkg.py"
CTE = "src/nkilib_src/nkilib/core/moe/moe_cte/moe_cte.py"


def _types():
    return importlib.import_module("nkilib_src.nkilib.core.utils.common_types")


def tkg_inputs(rng, *, T, H, I, E, K, all_expert, fp8, act="silu"):  # noqa: E741
    """moe_tkg's inputs the way its tests build them (test_moe_tkg_utils.build_moe_tkg: normal weights, affinities
    normalised over each token's K experts, placed at the token's expert ids), in bf16 / FP8 row quantisation."""
    ct = _types()
    idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int32)
    aff = np.zeros((T, E), np.float32)
    w = rng.random((T, K))
    for t in range(T):
        aff[t, idx[t]] = w[t] / w[t].sum()
    wdt = FP8 if fp8 else BF16
    gate_up = rng.standard_normal((E, H, 2, I)).astype(np.float32)
    down = rng.standard_normal((E, I, H)).astype(np.float32)
    if not fp8:
        gate_up, down = gate_up * H ** -0.5, down * I ** -0.5
    kw = dict(hidden_input=rng.standard_normal((T, H)).astype(BF16), expert_gate_up_weights=gate_up.astype(wdt),
              expert_down_weights=down.astype(wdt), expert_affinities=aff.astype(BF16 if all_expert else np.float32),
              expert_index=idx, is_all_expert=all_expert,
              expert_affinities_scaling_mode=ct.ExpertAffinityScaleMode.POST_SCALE,
              activation_fn=ct.ActFnType.SiLU if act == "silu" else ct.ActFnType.Swish,
              gate_clamp_upper_limit=7.0, up_clamp_upper_limit=8.0, up_clamp_lower_limit=-6.0)
    if all_expert:
        kw["rank_id"] = np.zeros((1, 1), np.uint32)
    if fp8:
        kw["expert_gate_up_weights_scale"] = (rng.random((E, 2, I)) * H ** -0.5).astype(np.float32)
        kw["expert_down_weights_scale"] = (rng.random((E, H)) * I ** -0.5).astype(np.float32)
    return kw


def moe_reference(x, experts_of_token, weights, clamps=(None, None, None)):
    """sum_k aff[t, k] * mlp_{e_k}(x_t) with (gate, up, down) float64 weight getters and (gate upper, up lower, up
    upper) clamps; returns (out, the bound's two magnitude terms)."""
    T, H = x.shape
    out, mag, absout = np.zeros((T, H)), np.zeros((T, H)), np.zeros((T, H))
    for t in range(T):
        for e, a in experts_of_token(t):
            wg, wu, wd = weights(e)
            y, m = R.expert_mlp(R.f64(x[t:t + 1]), wg, wu, wd, "silu", *clamps)
            out[t] += a * y[0]
            mag[t] += abs(a) * m[0]
            absout[t] += abs(a * y[0])
    return out, mag, absout


def _tkg_weights(kw):
    gu, dn = R.f64(kw["expert_gate_up_weights"]), R.f64(kw["expert_down_weights"])
    if "expert_gate_up_weights_scale" in kw:
        s_gu, s_dn = R.f64(kw["expert_gate_up_weights_scale"]), R.f64(kw["expert_down_weights_scale"])
        return lambda e: (gu[e, :, 0, :] * s_gu[e, 0], gu[e, :, 1, :] * s_gu[e, 1], dn[e] * s_dn[e][None, :])
    return lambda e: (gu[e, :, 0, :], gu[e, :, 1, :], dn[e])


def _tkg_case(cid, *, all_expert, fp8, T=4, H=512, I=128, E=4, K=2):  # noqa: E741
    def make(_m, rng):
        return (), tkg_inputs(rng, T=T, H=H, I=I, E=E, K=K, all_expert=all_expert, fp8=fp8)

    def check(outs, _args, kw):
        aff, idx = R.f64(kw["expert_affinities"]), kw["expert_index"]
        experts = (lambda t: [(e, aff[t, e]) for e in range(E)]) if all_expert else \
            (lambda t: [(int(e), aff[t, int(e)]) for e in idx[t]])
        ref, mag, absout = moe_reference(kw["hidden_input"], experts, _tkg_weights(kw), (7.0, -6.0, 8.0))
        return R.within(outs[0], ref, R.moe_bound(mag, absout, E if all_expert else K, BF16))

    mode = "all-expert" if all_expert else "selective"
    return Case(cid, LIBRARY, TKG, "moe_tkg", make, check, load="package:nkilib_src.nkilib.core.moe.moe_tkg.moe_tkg",
                source_root=ROOT, grid=2, tags=("moe", "decode", mode, "fp8" if fp8 else "bf16"),
                bound="bf16 intermediates: 2^-8 (4 sum|wd||h terms| + (k+1) sum|a y|)")


def cte_inputs(module, rng, *, T, H, I, E, B, K, fp8):  # noqa: E741
    """moe_cte's inputs the way its tests build them (test_moe_cte_common: static capacity N blocks, padding
    positions pointing at the zero row T, block_to_expert ascending, affinities masked to the routed experts)."""
    N = math.ceil((T * K - (E - 1)) / B) + E - 1
    chosen = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)])
    routed = np.zeros((T, E), bool)
    routed[np.arange(T)[:, None], chosen] = True
    blocks = np.ceil(routed.sum(0) / B).astype(int)
    blocks[E - 1] += N - blocks.sum()
    block_to_expert = np.repeat(np.arange(E), blocks).astype(np.int32)
    pos = np.full(N * B, T, np.int32)
    start = np.concatenate([[0], np.cumsum(blocks)[:-1]]) * B
    for e in range(E):
        toks = np.flatnonzero(routed[:, e])
        pos[start[e]:start[e] + toks.size] = toks
    aff = np.zeros((T + 1, E), np.float32)
    aff[:T] = rng.random((T, E)) * routed
    hidden = rng.random((T + 1, H)).astype(np.float32)
    hidden[T] = 0
    wdt = FP8 if fp8 else BF16
    lo, hi = (-240, 240) if fp8 else (-0.1, 0.1)
    ct = _types()
    kw = dict(hidden_states=hidden.astype(BF16), expert_affinities_masked=aff.astype(BF16).reshape(-1, 1),
              gate_up_proj_weight=rng.uniform(lo, hi, (E, H, 2, I)).astype(wdt),
              down_proj_weight=rng.uniform(lo, hi, (E, I, H)).astype(wdt), token_position_to_id=pos,
              block_to_expert=block_to_expert, block_size=B,
              spec=module.MoECTESpec(implementation=module.MoECTEImplementation.shard_on_i),
              is_tensor_update_accumulating=K != 1, activation_function=ct.ActFnType.SiLU,
              expert_affinities_scaling_mode=ct.ExpertAffinityScaleMode.POST_SCALE)
    if fp8:
        kw["quantization_config"] = module.QuantizationConfig(
            gate_up_proj_scale=rng.uniform(-0.1, 0.1, (E, 1, 2 * I)).astype(np.float32) * 1e-2,
            down_proj_scale=rng.uniform(-0.1, 0.1, (E, 1, H)).astype(np.float32) * 1e-2)
    return kw


def _cte_case(cid, *, fp8, T=256, H=1024, I=512, E=4, B=512, K=2, legal=True, why=""):  # noqa: E741
    def make(module, rng):
        return (), cte_inputs(module, rng, T=T, H=H, I=I, E=E, B=B, K=K, fp8=fp8)

    def check(outs, _args, kw):
        aff = R.f64(kw["expert_affinities_masked"]).reshape(T + 1, E)
        gu, dn = R.f64(kw["gate_up_proj_weight"]), R.f64(kw["down_proj_weight"])
        if fp8:
            q = kw["quantization_config"]
            sg, sd = R.f64(q.gate_up_proj_scale), R.f64(q.down_proj_scale)
            weights = lambda e: (gu[e, :, 0, :] * sg[e, 0, :I], gu[e, :, 1, :] * sg[e, 0, I:], dn[e] * sd[e, 0][None])  # noqa: E731
        else:
            weights = lambda e: (gu[e, :, 0, :], gu[e, :, 1, :], dn[e])  # noqa: E731
        experts = lambda t: [(e, aff[t, e]) for e in range(E) if aff[t, e] != 0]  # noqa: E731
        ref, mag, absout = moe_reference(kw["hidden_states"][:T], experts, weights)
        out = np.asarray(outs[0])[:T]
        return R.within(out, ref, R.moe_bound(mag, absout, K, BF16))

    return Case(cid, LIBRARY, CTE, "moe_cte", make, check, load="package:nkilib_src.nkilib.core.moe.moe_cte.moe_cte",
                source_root=ROOT, grid=2, tags=("moe", "prefill", "shard_on_I", "fp8" if fp8 else "bf16"), legal=legal, why=why,
                bound="bf16 intermediates: 2^-8 (4 sum|wd||h terms| + (k+1) sum|a y|)")


def _blockwise_mm_legacy():
    return Case("samples-blockwise-mm", SAMPLES_LEGACY, "contributed/neuron-team-kernels/blockwise_mm.py", "blockwise_mm",
                lambda m, rng: ((), {}), lambda outs, args, kw: (False, 0.0, "not run"), bound="n/a",
                why="removed from nki-samples in 8370e11 ('Remove legacy kernels'); written for neuronxcc.nki, "
                    "'a compilation error' since NKI 0.4 (aws-neuron-sdk nki/migration/index.rst @81ce03ae)")


CASES = [
    _tkg_case("lib-moe-tkg-selective-bf16", all_expert=False, fp8=False),
    _tkg_case("lib-moe-tkg-all-expert-bf16", all_expert=True, fp8=False, E=2),
    _tkg_case("lib-moe-tkg-selective-fp8", all_expert=False, fp8=True, I=64),
    _tkg_case("lib-moe-tkg-all-expert-fp8", all_expert=True, fp8=True, I=64, E=2),
    _cte_case("lib-moe-cte-shard-on-i-bf16", fp8=False),
    _cte_case("lib-moe-cte-shard-on-i-fp8", fp8=True),
    _cte_case("lib-moe-cte-shard-on-i-top1", fp8=False, K=1, legal=False,
              why="with top-1 routing (is_tensor_update_accumulating=False) bwmm_shard_on_I scales the block by a bfloat16 "
                  "[P, 1] tile through tensor_scalar, whose operands 'must be float32' (nki/api/nki/isa/__init__.py "
                  "@81ce03ae); nki-library's own tests run this kernel with top-k 4 and 8 only"),
    _blockwise_mm_legacy(),
]
