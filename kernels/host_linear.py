"""Host side of the block-scaled 1-byte linear kernels (kernels/linear_w8.py): the resident layout of one linear's
weights, its exact pow2 repack from the checkpoint, fusion along N, token buckets, the launch contract's static
checks, the float64 references with their error bounds, and the HBM bytes a launch reads.

A linear ``y[T, N] = x[T, K] @ W.T`` takes ``W [N, K]`` as a rank's shard of an FP8 checkpoint tensor (E4M3FN bytes,
one scale per 128x128 block). :func:`linear_weights` repacks it exactly (``codec.fp8.repack(mode="pow2")``, the
routed experts' rule) and keeps only the kernel layout (:class:`LinearWeights`: codes ``[128, K/128, N]`` uint8,
scales ``[N/128, K/128]`` fp32). :func:`fuse` concatenates linears that share x along N (q+k+v; in_proj_qkv+z) so
one launch computes them; ``splits`` cuts the output back.

Which kernel a call runs (:func:`path_for`, a function of the bucket only): T <= ``EXACT_MAX_TOKENS`` the exact pow2
kernel (gate: fp32 accumulation, :func:`error_bound` with ``weights="exact"``); beyond it the on-chip bf16 dequant
kernel, whose numbers are the BF16 model's (``weights="bf16"``: bf16(w * s) per weight, then fp32 accumulation; vs
the exact weights add ``BF16_ROUNDOFF`` x sum |x| |W|). :func:`gate` judges a launch's output by its path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vllm_moe_w8.codec import fp8

from . import host
from .linear_w8 import P, chunk_columns

DECODE_BUCKETS = tuple(b for b in host.T_BUCKETS if b <= P)  # 16, 32, 64, 128
EXACT_MAX_TOKENS = P  # decode buckets run exact; prefill (one compile per multiple of 128 rows) dequantises
MAX_K = 8192  # x^T of one 128-token tile and one 512-column bf16 slab of every contraction block fit SBUF
FP32_ROUNDOFF = 2.0**-24
BF16_ROUNDOFF = 2.0**-9


class LinearShapeError(ValueError):
    """A weight the 1-byte linear kernel cannot take (the message names the tensor, the shape and the remedy)."""


@dataclass
class LinearWeights:
    """One linear's weights in the kernel layout, its only resident copy.

    ``codes[p, g, n]`` = Trn2 float8_e4m3 code (uint8) of W[n, g*128 + p] after the pow2 repack; ``scales[nb, g]`` =
    the fp32 scale of block (nb, g) (doubled where the block's codes were halved). ``splits`` / ``parts``: the N of
    each fused part and its name (one entry when not fused); ``stats``: what the pow2 repack changed (blocks,
    blocks_shifted = halved blocks, values_changed = rounded odd subnormals, max_abs_error in weight units)."""

    codes: torch.Tensor  # [128, K/128, N] uint8
    scales: torch.Tensor  # [N/128, K/128] float32
    name: str
    splits: tuple[int, ...]
    parts: tuple[str, ...]
    stats: fp8.RepackStats = field(default_factory=fp8.RepackStats)
    mode: str = "pow2"
    block: tuple[int, int] = (P, P)

    @property
    def n(self) -> int:
        return self.codes.shape[2]

    @property
    def k(self) -> int:
        return self.codes.shape[0] * self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def to(self, device) -> "LinearWeights":
        """The same weights on ``device`` (codes stay uint8, scales fp32)."""
        return LinearWeights(self.codes.to(device), self.scales.to(device), self.name, self.splits, self.parts,
                             self.stats, self.mode, self.block)


def _refuse(name: str, msg: str) -> None:
    raise LinearShapeError(f"1-byte linear kernel, tensor {name!r}: {msg}")


def linear_weights(fp8_weight: torch.Tensor, scale: torch.Tensor, *, name: str) -> LinearWeights:
    """``fp8_weight [N, K]`` (uint8 or float8_e4m3fn: E4M3FN bytes, this rank's shard) and its block scales
    ``[ceil(N/128), ceil(K/128)]`` (fp32 / bf16 / fp16) -> :class:`LinearWeights` (pow2 repack, exact).

    Refused, naming ``name`` (:class:`LinearShapeError`): a weight that is not 2-D; N or K not a multiple of 128
    (the kernel contracts and splits whole 128x128 scale blocks: a TP shard cutting a block has no kernel - keep that
    layer on the BF16 path); K > ``MAX_K``; a scale grid that is not exactly [N/128, K/128]; NaN codes, non-finite or
    non-positive scales (``fp8.repack``'s checks, which also name the tensor)."""
    if fp8_weight.dim() != 2:
        _refuse(name, f"the weight must be 2-D [N, K], got shape {tuple(fp8_weight.shape)}")
    if fp8_weight.dtype not in (torch.uint8, torch.float8_e4m3fn):
        _refuse(name, f"dtype {fp8_weight.dtype}: expected the checkpoint's E4M3FN bytes (uint8 or float8_e4m3fn)")
    n, k = fp8_weight.shape
    if n == 0 or k == 0 or n % P or k % P:
        _refuse(name, f"shape [N={n}, K={k}]: N and K must be non-zero multiples of 128 per rank (whole 128x128 "
                      "scale blocks); this shard cuts a block - keep the layer on the BF16 path")
    if k > MAX_K:
        _refuse(name, f"K={k} > {MAX_K}: the kernel keeps one token tile's x^T and one 512-column slab per "
                      "contraction block in SBUF; shard K further (tensor parallelism) or keep the layer on BF16")
    if tuple(scale.shape) != (n // P, k // P):
        _refuse(name, f"scale grid {tuple(scale.shape)} does not match [N/128, K/128] = {(n // P, k // P)} for "
                      f"weight [{n}, {k}] (128x128 blocks); check weight_block_size and that the scale is this shard's")
    r = fp8.repack(fp8_weight, scale, mode="pow2", block=(P, P), name=name)
    codes = r.codes.reshape(n, k // P, P).permute(2, 1, 0).contiguous()
    return LinearWeights(codes, r.scales.float().contiguous(), name, (n,), (name,), r.stats)


def fuse(parts: list[LinearWeights], *, name: str) -> LinearWeights:
    """The linears ``parts`` (same x, same K) concatenated along N in order: one launch computes them all;
    ``result.splits`` are the parts' N (``y.split(result.splits, dim=1)`` cuts the output). A copy: drop the parts."""
    if not parts:
        raise ValueError(f"fuse({name!r}): no parts")
    ks = {p.k for p in parts}
    if len(ks) != 1:
        raise LinearShapeError(f"fuse({name!r}): the parts contract different K ("
                               + ", ".join(f"{p.name} K={p.k}" for p in parts) + "); only linears of one input fuse")
    stats = fp8.RepackStats()
    for p in parts:
        stats = stats.add(p.stats)
    return LinearWeights(torch.cat([p.codes for p in parts], dim=2), torch.cat([p.scales for p in parts], dim=0),
                         name, sum((p.splits for p in parts), ()), sum((p.parts for p in parts), ()), stats)


def bucket_for(tokens: int, lnc: int = 1) -> int:
    """The static T a call of ``tokens`` runs at: the decode buckets up to 128, then the next multiple of 128 x LNC
    (prefill splits its token tiles evenly between the programs)."""
    if tokens <= 0:
        raise ValueError(f"1-byte linear kernel: {tokens} tokens; a launch needs at least one")
    if tokens <= P:
        return host.bucket_for(tokens)
    return math.ceil(tokens / (P * lnc)) * P * lnc


def path_for(tokens: int) -> str:
    """'pow2' (exact) or 'dequant' (bf16 weights on chip) for a call of ``tokens`` tokens (by its bucket)."""
    return "pow2" if tokens <= EXACT_MAX_TOKENS else "dequant"


def split_tokens(bucket: int, lnc: int) -> int:
    """How the programs share a launch (the kernel's ``split_tokens``, a function of the bucket and LNC): 0 splits N
    (decode: each weight byte read by one program), 1 splits the token tiles (prefill at LNC > 1: each program
    streams all N in whole 512-column slabs - N/LNC = 1280 at q+k+v would leave a 256-column slab per 512 - and
    bytes no longer matter)."""
    return int(lnc > 1 and bucket > P)


def check_lnc(lw: LinearWeights, lnc: int) -> None:
    """The LNC programs split N in whole 128-row blocks: N/128 must be a multiple of ``lnc``."""
    if lnc not in (1, 2):
        raise ValueError(f"1-byte linear kernel: lnc={lnc}; trn2 runs at LNC 1 or 2 (NEURON_LOGICAL_NC_CONFIG)")
    if (lw.n // P) % lnc:
        raise LinearShapeError(f"1-byte linear kernel, tensor {lw.name!r}: N={lw.n} is {lw.n // P} blocks of 128, "
                               f"which LNC {lnc} cannot split evenly; fuse it with another linear or run at LNC 1")


def check_linear_args(x, w, scales, lnc: int, split: int) -> None:
    """One launch's static contract (kernels/linear_w8.py): shapes and dtypes only, so it is trace-safe."""
    if len(x.shape) != 2 or len(w.shape) != 3 or w.shape[0] != P:
        raise ValueError(f"1-byte linear kernel: x {tuple(x.shape)} must be [T, K], w {tuple(w.shape)} [128, K/128, N]")
    t, k = x.shape
    _p, g, n = w.shape
    if k != g * P or k > MAX_K:
        raise ValueError(f"1-byte linear kernel: x has K={k}; w {tuple(w.shape)} contracts {g * P} (K <= {MAX_K})")
    if t not in DECODE_BUCKETS and (t <= P or t % (P * lnc)):
        raise ValueError(f"1-byte linear kernel: T={t} is not a bucket at LNC {lnc} (host_linear.bucket_for: 16, 32, "
                         f"64, 128, then multiples of {P * lnc}); pad x")
    if split != split_tokens(t, lnc):
        raise ValueError(f"1-byte linear kernel: split_tokens={split} at T={t}, LNC {lnc}; pass "
                         "host_linear.split_tokens(T, LNC)")
    if tuple(scales.shape) != (n // P, g) or n % P or (not split and (n // P) % lnc):
        raise ValueError(f"1-byte linear kernel: scales {tuple(scales.shape)} must be [N/128, K/128] = "
                         f"{(n // P, g)}, N/128 a multiple of LNC {lnc}")
    for label, t_, want in (("x", x, "bfloat16"), ("w", w, "uint8"), ("scales", scales, "float32")):
        if host._dtype_name(t_) != want:
            raise ValueError(f"1-byte linear kernel: {label} has dtype {t_.dtype}; expected {want}")


def dense_weight(lw: LinearWeights) -> torch.Tensor:
    """float32 [N, K]: the stored codes decoded (Trn2 e4m3) times their block scales - the weights the kernel holds."""
    codes = lw.codes.permute(2, 1, 0).reshape(lw.n, lw.k)
    return fp8.decode(codes, "e4m3") * fp8.expand_scales(lw.scales, (lw.n, lw.k), (P, P))


def _weights64(lw: LinearWeights, weights: str) -> torch.Tensor:
    w = dense_weight(lw)  # fp32: code x scale rounded once, as the engines compute it
    if weights == "bf16":
        return w.to(torch.bfloat16).double()
    if weights != "exact":
        raise ValueError(f"weights={weights!r}: 'exact' (the stored pow2 weights) or 'bf16' (the dequant kernel's)")
    codes = lw.codes.permute(2, 1, 0).reshape(lw.n, lw.k)
    return fp8.decode(codes, "e4m3").double() * fp8.expand_scales(lw.scales, (lw.n, lw.k), (P, P)).double()


def reference(x: torch.Tensor, lw: LinearWeights, *, weights: str = "exact") -> torch.Tensor:
    """float64 [T, N] = bf16(x) @ W.T of the same stored weights: ``exact`` (code x scale in float64: what the pow2
    kernel computes up to fp32 accumulation) or ``bf16`` (each weight rounded to bf16 as the dequant kernel does)."""
    return x.to(torch.bfloat16).double() @ _weights64(lw, weights).T


def magnitude(x: torch.Tensor, lw: LinearWeights, *, weights: str = "exact") -> torch.Tensor:
    """float64 [T, N] = |bf16(x)| @ |W|.T: the sum the rounding bounds scale with."""
    return x.to(torch.bfloat16).double().abs() @ _weights64(lw, weights).abs().T


def error_bound(x: torch.Tensor, lw: LinearWeights, *, weights: str = "exact") -> torch.Tensor:
    """Per-element bound [T, N] on |kernel - reference(x, lw, weights=...)| for the kernel that uses those weights.

    exact (pow2 kernel): each 128-term block partial accumulates in fp32 PSUM (127 roundings), is scaled (1) and added
    to the total (K/128 - 1): ``(128 + K/128) * 2**-24 * |x| @ |W|.T``. bf16 (dequant kernel): the K terms accumulate
    in PSUM: ``K * 2**-24 * |x| @ |W_bf16|.T``. (Against the exact weights the dequant kernel adds one bf16 rounding
    per weight: ``BF16_ROUNDOFF * magnitude(x, lw)``.)"""
    terms = P + lw.k // P if weights == "exact" else lw.k
    return terms * FP32_ROUNDOFF * magnitude(x, lw, weights=weights)


def within_bound(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> tuple[bool, float]:
    """(every |out - ref| <= bound, max err/bound); an exact zero bound needs an exact match."""
    err = (out.double() - ref).abs()
    ratio = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
    return bool((err <= bound).all()), ratio


def gate(out: torch.Tensor, x: torch.Tensor, lw: LinearWeights) -> tuple[bool, float]:
    """A call's output [T, N] judged against the reference of the path ``run_linear_w8`` takes at x's T (exact
    weights for pow2, bf16 weights for dequant), with that path's bound: (passed, max err/bound)."""
    weights = "exact" if path_for(x.shape[0]) == "pow2" else "bf16"
    return within_bound(out, reference(x, lw, weights=weights), error_bound(x, lw, weights=weights))


def read_bytes(n: int, k: int, tokens: int, lnc: int) -> int:
    """HBM bytes one launch reads for ``tokens`` tokens (the interpreter's counter, tests/test_nki_linear.py): the codes
    (1 B per weight) once per program that computes their rows (one in decode; every program when prefill splits the
    tokens), the fp32 scales once per SBUF partition they are broadcast to (min(T, 128) token rows for pow2, 128
    weight partitions for dequant), and x (bf16, T padded to its bucket) once per resident chunk and program.
    Per decoded token at batch B (B <= 128, one launch): ``read_bytes(n, k, B, lnc) / B``; the BF16 weights it
    replaces are 2 B each (``2 * n * k``)."""
    t = bucket_for(tokens, lnc)
    exact = path_for(tokens) == "pow2"
    split = split_tokens(t, lnc)
    copies = lnc if split else 1  # programs reading each weight row
    share = n if split else n // lnc
    chunks = math.ceil(share / chunk_columns(k // P, share, exact))
    scale_rows = min(t, P) if exact else P  # the scale rows are read once per partition that holds them
    x_reads = chunks * (1 if split else lnc)  # every program reads its rows of x once per chunk
    return copies * (n * k + scale_rows * 4 * (n // P) * (k // P)) + x_reads * t * k * 2


__all__ = ["LinearWeights", "LinearShapeError", "linear_weights", "fuse", "reference", "error_bound", "gate",
           "within_bound", "magnitude", "bucket_for", "path_for", "split_tokens", "check_lnc", "check_linear_args",
           "read_bytes", "dense_weight"]
