"""The numerics self-check run after a MoE layer's repack (on by default; DEVELOPING.md, "Plugin settings").

For a few sampled experts, the stored weights (op layout, codes in ``code_format``, scales on the final
tile) are dequantised with the op's reference and compared with the checkpoint's exact values: every
value must be within the mode's stated error (lut: exact; pow2: a rounded odd subnormal moves by 2**-9 x
the checkpoint block scale, and pow2 must have rounded exactly as many values as it counted; output-block:
half an e4m3 step at the value's binade of the new row scale). A converted checkpoint brings no source
values, so only finiteness is checked. A failure stops the load with :class:`NumericsSelfCheckError`,
naming layer, expert, projection and element.
"""

from __future__ import annotations

import math

import torch

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.op import reference

POW2_RNE_ERROR = 2.0**-9  # pow2: a rounded odd subnormal moves by 2**-9 x the checkpoint block scale
# Both sides of the comparison are fp32 products code x scale, each rounded once (fp32 scales are
# arbitrary, e.g. GLM's): a rounded value may exceed the exact bound by a few fp32 ulps of a value
# below 2**-6 x scale, i.e. far less than 2**-10 of the bound.
POW2_BOUND_SLACK = 1.0 + 2.0**-10
# output-block: the bound is computed in fp32 from the same fp32 scale; 1e-6 relative covers its rounding.
OUTPUT_BLOCK_BOUND_SLACK = 1.0 + 1e-6


class NumericsSelfCheckError(RuntimeError):
    """The repacked experts do not dequantise to the checkpoint's values within the mode's error."""


def check_repacked_experts(
    stored: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    originals: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    sampled: list[int],
    global_ids: list[int],
    rounded_per_expert: dict[int, int],
    prefix: str,
    mode: str,
    code_format: str,
    inter: int,
    load_block: tuple[int, int],
    block: tuple[int, int],
) -> None:
    """Check experts ``sampled`` of one layer.

    ``stored``: the layer's (w13, w13 scales, w2, w2 scales) after the repack, tile ``block``.
    ``originals``: expert -> its checkpoint (w13, w13 scales, w2, w2 scales) on tile ``load_block``,
    empty for a converted checkpoint. ``rounded_per_expert``: values the pow2 repack counted as rounded.
    """
    w13, s13, w2, s2 = stored
    g_i = math.ceil(inter / load_block[0])
    for e in sampled:
        where = f"layer {prefix}, expert {global_ids[e]} (local {e})"
        gate, up = reference.dequantize_w13(w13, s13, e, block, code_format)
        down = reference.dequantize_expert(w2[e], s2[e], block, code_format)
        got = {"gate_proj": gate, "up_proj": up, "down_proj": down}
        if not all(bool(torch.isfinite(t).all()) for t in got.values()):
            raise NumericsSelfCheckError(f"neuron-w8 self-check: {where} dequantises to non-finite values in {code_format} (mode {mode})")
        if not originals:  # converted checkpoint: no source values here; finiteness is what we can check
            continue
        c13, o13, c2, o2 = originals[e]
        want = {
            "gate_proj": (c13[:inter], o13[:g_i]),
            "up_proj": (c13[inter:], o13[g_i:]),
            "down_proj": (c2, o2),
        }
        rows = math.ceil(inter / block[0])
        row_scales = {"gate_proj": s13[e, :rows], "up_proj": s13[e, rows:], "down_proj": s2[e]}
        n_diff = 0
        for proj, (codes, scales) in want.items():
            exact = fp8.dequantize_checkpoint(codes, scales, load_block)
            err = (got[proj] - exact).abs()
            scale_el = fp8.expand_scales(scales, tuple(codes.shape), load_block)
            if mode == "lut":
                bound = torch.zeros_like(err)
            elif mode == "pow2":
                bound = POW2_RNE_ERROR * POW2_BOUND_SLACK * scale_el
            else:  # output-block: half an e4m3 step at the value's binade, of the new row scale
                new_scale = fp8.expand_scales(row_scales[proj], tuple(codes.shape), block)
                q = (exact / new_scale).abs().clamp(min=2.0**-6)
                bound = new_scale * torch.exp2(torch.floor(torch.log2(q)) - 4) * OUTPUT_BLOCK_BOUND_SLACK
            bad = err > bound
            if bool(bad.any()):
                i, j = (int(v) for v in bad.nonzero()[0])
                raise NumericsSelfCheckError(
                    f"neuron-w8 self-check failed: {where}, {proj}[{i}, {j}] dequantises to {float(got[proj][i, j])!r} "
                    f"but the checkpoint value is {float(exact[i, j])!r} (allowed error {float(bound[i, j])!r} in mode {mode}); "
                    f"{int(bad.sum())} value(s) out of bounds. The load is stopped: report this with the checkpoint name "
                    "(turn the check off with --additional-config '{\"neuron_w8\": {\"self_check\": false}}' only to debug)"
                )
            n_diff += int((err > 0).sum())
        if mode == "pow2" and n_diff != rounded_per_expert.get(e, 0):
            raise NumericsSelfCheckError(
                f"neuron-w8 self-check failed: {where}: {n_diff} value(s) differ from the checkpoint but the pow2 repack "
                f"counted {rounded_per_expert.get(e, 0)} rounded value(s)"
            )
