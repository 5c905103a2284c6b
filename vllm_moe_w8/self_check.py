"""The load-time numerics self-check of repacked experts (pure torch; no vLLM, no NKI).

After a repack, a few sampled experts are dequantised from what is actually stored and compared with
the checkpoint's own values (:func:`vllm_moe_w8.fp8.dequantize_checkpoint`). Each mode has a stated
error: ``lut`` none, ``pow2`` at most 2**-9 x the checkpoint tile's scale (an odd subnormal rounded to
even) and exactly as many changed values as the repack counted, ``output-block`` half an e4m3 step of
the value's binade at the new row scale. A value outside its bound stops the load with
:class:`NumericsSelfCheckError` naming the layer, expert, projection and element.

Used by the vLLM-generic MoE method (``moe_method``) and by the Neuron experts module
(``neuron_glue.loaders``), so both hosts check the same thing.
"""

from __future__ import annotations

import torch

from vllm_moe_w8 import fp8

POW2_RNE_ERROR = 2.0**-9  # pow2: a rounded odd subnormal moves by 2**-9 x the checkpoint block scale
# Both sides of the comparison are fp32 products code x scale, each rounded once (fp32 scales are
# arbitrary, e.g. GLM's): a rounded value may exceed the exact bound by a few fp32 ulps of a value
# below 2**-6 x scale, i.e. far less than 2**-10 of the bound.
POW2_BOUND_SLACK = 1.0 + 2.0**-10
# output-block: half an e4m3 step (2**-4 of the binade) at the new row scale; 1e-6 absorbs the fp32
# rounding of exact / new_scale.
OUTPUT_BLOCK_SLACK = 1.0 + 1e-6
DISABLE_HINT = "--additional-config '{\"neuron_w8\": {\"self_check\": false}}'"


class NumericsSelfCheckError(RuntimeError):
    """The repacked experts do not dequantise to the checkpoint's values within the mode's error."""


def allowed_error(mode: str, exact: torch.Tensor, scale_el: torch.Tensor, new_scale_el: torch.Tensor | None) -> torch.Tensor:
    """Per-element bound of |stored - checkpoint| for ``mode`` (see the module docstring)."""
    if mode == "lut":
        return torch.zeros_like(exact)
    if mode == "pow2":
        return POW2_RNE_ERROR * POW2_BOUND_SLACK * scale_el
    if mode == "output-block":
        if new_scale_el is None:
            raise ValueError("output-block self-check needs the new row scales")
        q = (exact / new_scale_el).abs().clamp(min=2.0**-6)
        return new_scale_el * torch.exp2(torch.floor(torch.log2(q)) - 4) * OUTPUT_BLOCK_SLACK
    raise ValueError(f"unknown repack mode {mode!r}")


def check_finite(got: dict[str, torch.Tensor], where: str, code_format: str, mode: str) -> None:
    if not all(bool(torch.isfinite(t).all()) for t in got.values()):
        raise NumericsSelfCheckError(f"neuron-w8 self-check: {where} dequantises to non-finite values in {code_format} (mode {mode})")


def check_projection(got: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], mode: str,
                     where: str, proj: str, new_scale_el: torch.Tensor | None = None) -> int:
    """Compare one stored projection (dequantised, fp32 [N, K]) with the checkpoint's codes x scales.

    Returns how many values differ at all (pow2: must equal the repack's rounded count, see
    :func:`check_rounded_count`); raises :class:`NumericsSelfCheckError` on the first value out of bounds.
    """
    exact = fp8.dequantize_checkpoint(codes, scales, block)
    err = (got - exact).abs()
    scale_el = fp8.expand_scales(scales, tuple(codes.shape), block)
    bound = allowed_error(mode, exact, scale_el, new_scale_el)
    bad = err > bound
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise NumericsSelfCheckError(
            f"neuron-w8 self-check failed: {where}, {proj}[{i}, {j}] dequantises to {float(got[i, j])!r} "
            f"but the checkpoint value is {float(exact[i, j])!r} (allowed error {float(bound[i, j])!r} in mode {mode}); "
            f"{int(bad.sum())} value(s) out of bounds. The load is stopped: report this with the checkpoint name "
            f"(turn the check off with {DISABLE_HINT} only to debug)"
        )
    return int((err > 0).sum())


def check_rounded_count(mode: str, n_diff: int, counted: int, where: str) -> None:
    """pow2 only: the values that changed must be exactly the ones the repack says it rounded."""
    if mode == "pow2" and n_diff != counted:
        raise NumericsSelfCheckError(
            f"neuron-w8 self-check failed: {where}: {n_diff} value(s) differ from the checkpoint but the pow2 repack "
            f"counted {counted} rounded value(s)"
        )
