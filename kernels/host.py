"""Host-side preparation for the MoE kernels (torch; no NKI): the kernels' argument contract (checked here,
before every launch, because a traced kernel body cannot raise), the one-time weight re-layout, static
token buckets with padding, and dense affinities from top-k routing.

The op's storage (DEVELOPING.md) is ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` uint8 with scale grids over
(block_n, block_k) tiles. The kernels want the contraction dimension on partitions, split as
``[E, 128, H/128, 2I]`` / ``[E, 128, I/128, H]`` (see kernels/moe_w8.py); scales keep their grids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

P = 128
T_BUCKETS = (16, 32, 64, 128, 256)  # static token counts the kernels are compiled for
T_MAX = T_BUCKETS[-1]
KERNEL_MODES = {(128, 128): "pow2", (128, 0): "output-block"}
_ARG_DTYPES = {"hidden": "bfloat16", "rows": "bfloat16", "w13": "uint8", "w13_scales": "float32", "w2": "uint8",
               "w2_scales": "float32", "affinities": "float32", "row_weight": "float32"}


def _fail(msg: str) -> None:
    raise ValueError(f"moe_w8 kernel: {msg}")


def _dtype_name(tensor) -> str:
    """'bfloat16', 'uint8', ... for torch tensors and numpy / ml_dtypes arrays alike."""
    return str(tensor.dtype).removeprefix("torch.")


def check_kernel_args(hidden, w13, w13_scales, w2, w2_scales, affinities, mode: str, swiglu_limit: float = 0.0) -> None:
    """Validate one dense-kernel launch's shapes, dtypes and scale grids (kernels/moe_w8.py documents the contract).

    Works on torch tensors and numpy arrays; raises ValueError naming the tensor and the remedy."""
    if len(hidden.shape) != 2:
        _fail(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    t, h = hidden.shape
    e = _check_expert_shapes(h, w13, w2)
    if tuple(affinities.shape) != (t, e):
        _fail(f"affinities has shape {tuple(affinities.shape)}; expected [T, E_local] = {(t, e)}")
    if not (1 <= t <= T_MAX and (t <= P or t % P == 0)):
        _fail(f"T={t} tokens: the kernel takes T <= 128 or a multiple of 128 up to {T_MAX}; pad to a bucket (host.bucket_for)")
    _check_dtypes(dict(hidden=hidden, w13=w13, w13_scales=w13_scales, w2=w2, w2_scales=w2_scales, affinities=affinities))
    _check_scale_grids(h, w13, w13_scales, w2_scales, mode, swiglu_limit)


def check_grouped_args(rows, row_weight, w13, w13_scales, w2, w2_scales, expert_tiles, expert_program, mode: str,
                       programs: int, swiglu_limit: float = 0.0) -> None:
    """Validate one token-grouped launch (kernels/moe_w8_grouped.py documents the contract) on the host."""
    if len(rows.shape) != 2:
        _fail(f"rows must be [R, H], got {tuple(rows.shape)}")
    r, h = rows.shape
    e = _check_expert_shapes(h, w13, w2)
    tiles, owners = tuple(expert_tiles), tuple(expert_program)
    if len(tiles) != e or len(owners) != e:
        _fail(f"expert_tiles ({len(tiles)}) and expert_program ({len(owners)}) need one entry per local expert ({e})")
    if any(int(n) != n or n < 0 for n in tiles):
        _fail(f"expert_tiles {tiles} must be non-negative tile counts (grouping.group_by_expert)")
    if any(int(p) != p or not 0 <= p < programs for p in owners):
        _fail(f"expert_program {owners} names programs outside the launch grid [{programs}]")
    if r != P * sum(tiles):
        _fail(f"rows has {r} rows; expert_tiles {tiles} need 128 x {sum(tiles)} = {P * sum(tiles)}")
    if tuple(row_weight.shape) != (r, 1):
        _fail(f"row_weight has shape {tuple(row_weight.shape)}; expected [R, 1] = {(r, 1)}")
    _check_dtypes(dict(rows=rows, row_weight=row_weight, w13=w13, w13_scales=w13_scales, w2=w2, w2_scales=w2_scales))
    _check_scale_grids(h, w13, w13_scales, w2_scales, mode, swiglu_limit)


def _check_expert_shapes(h: int, w13, w2) -> int:
    """The local expert count, after checking w13/w2 against hidden size ``h``."""
    if len(w13.shape) != 4:
        _fail(f"w13 must be [E, 128, H/128, 2I] (host.to_kernel_layout), got {tuple(w13.shape)}")
    e, p, gh, two_i = w13.shape
    inter = two_i // 2
    if p != P or h % P or gh * P != h:
        _fail(f"w13 {tuple(w13.shape)} does not match hidden size H={h}: expected [E, 128, {h // P}, 2I] with H a multiple of 128")
    if inter % P or two_i != 2 * inter:
        _fail(f"intermediate size I={two_i / 2} (w13 last dim {two_i}) must be a multiple of 128")
    if tuple(w2.shape) != (e, P, inter // P, h):
        _fail(f"w2 has shape {tuple(w2.shape)}; expected [E, 128, I/128, H] = {(e, P, inter // P, h)}")
    return e


def _check_dtypes(tensors: dict) -> None:
    for name, tensor in tensors.items():
        dtype = _ARG_DTYPES[name]
        if _dtype_name(tensor) != dtype:
            _fail(f"{name} has dtype {tensor.dtype}; expected {dtype}")


def _check_scale_grids(h: int, w13, w13_scales, w2_scales, mode: str, swiglu_limit: float) -> None:
    e, _p, gh, two_i = w13.shape
    gi = two_i // 2 // P
    if mode == "pow2":
        g13, g2 = gh, gi
    elif mode == "output-block":
        g13, g2 = 1, 1
        for name, tensor, cols in (("w13_scales", w13_scales, gh), ("w2_scales", w2_scales, gi)):
            if len(tensor.shape) == 3 and tensor.shape[2] == cols and cols > 1:
                _fail(
                    f"{name} {tuple(tensor.shape)} is a 128x128 block-scale grid; the output-block kernel needs one scale "
                    "per 128 output rows ([E, rows/128, 1]). Use moe_w8_pow2 for block scales, or repack with mode='output-block'"
                )
    else:
        _fail(f"unknown mode {mode!r}; kernels exist for {sorted(set(KERNEL_MODES.values()))}")
    if tuple(w13_scales.shape) != (e, 2 * gi, g13):
        _fail(f"w13_scales has shape {tuple(w13_scales.shape)}; {mode} expects [E, 2I/128, {'H/128' if mode == 'pow2' else 1}] = {(e, 2 * gi, g13)}")
    if tuple(w2_scales.shape) != (e, h // P, g2):
        _fail(f"w2_scales has shape {tuple(w2_scales.shape)}; {mode} expects [E, H/128, {'I/128' if mode == 'pow2' else 1}] = {(e, h // P, g2)}")
    if not swiglu_limit >= 0:
        _fail(f"swiglu_limit must be >= 0 (0: no clamp), got {swiglu_limit}")


def kernel_mode(block_n: int, block_k: int, code_format: str) -> str:
    """The kernel variant for a scale tiling, or ValueError saying why none applies."""
    if code_format != "e4m3":
        raise ValueError(f"the NKI kernels multiply Trn2 float8_e4m3 codes; code_format {code_format!r} (lut storage) has no kernel, use the torch path")
    mode = KERNEL_MODES.get((block_n, block_k))
    if mode is None:
        raise ValueError(
            f"no NKI kernel for scale tiles ({block_n}, {block_k}); kernels exist for 128x128 blocks (pow2) and "
            "(128, 0) output blocks. Refined grids under tensor parallelism (per-rank size not a multiple of 128) "
            "and per-channel scales use the torch path"
        )
    return mode


@dataclass
class KernelWeights:
    """One layer's experts in the kernels' layout (made once at load time)."""

    w13: torch.Tensor  # [E, 128, H/128, 2I] uint8
    w13_scales: torch.Tensor  # [E, 2I/128, G13] float32
    w2: torch.Tensor  # [E, 128, I/128, H] uint8
    w2_scales: torch.Tensor  # [E, H/128, G2] float32
    mode: str

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[3]


def to_kernel_layout(w13: torch.Tensor, w13_scales: torch.Tensor, w2: torch.Tensor, w2_scales: torch.Tensor,
                     block_n: int, block_k: int, code_format: str) -> KernelWeights:
    """Re-lay out the op's expert storage for the kernels (a copy; do it once per layer)."""
    mode = kernel_mode(block_n, block_k, code_format)
    e, two_i, h = w13.shape
    inter = two_i // 2
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"expert codes must be uint8 (got w13 {w13.dtype}, w2 {w2.dtype})")
    if h % P or inter % P:
        raise ValueError(f"the NKI kernels need hidden ({h}) and per-rank intermediate ({inter}) sizes that are multiples of 128")
    if tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"w2 shape {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}: expected {(e, h, inter)}")
    k13 = w13.transpose(1, 2).reshape(e, h // P, P, two_i).transpose(1, 2).contiguous()
    k2 = w2.transpose(1, 2).reshape(e, inter // P, P, h).transpose(1, 2).contiguous()
    return KernelWeights(k13, w13_scales.float().contiguous(), k2, w2_scales.float().contiguous(), mode)


def dense_affinities(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] routing -> [T, E] fp32 on the ids' device: weight of each local expert per token; ids < 0 dropped,
    duplicates summed. Trace-safe (torch ops only, no value read in Python); ids >= E are an error when run
    eagerly and are dropped under torch.compile (the glue's local ids are in [-1, E) by construction)."""
    ids = topk_ids.long()
    if not torch.compiler.is_compiling() and ids.device.type != "meta" and bool((ids >= num_experts).any()):
        raise ValueError(f"topk_ids holds expert id {int(ids.max())} >= the {num_experts} local experts")
    keep = (ids >= 0) & (ids < num_experts)
    aff = torch.zeros(ids.shape[0], num_experts, dtype=torch.float32, device=ids.device)
    aff.scatter_add_(1, torch.where(keep, ids, 0), torch.where(keep, topk_weights.float(), 0.0))
    return aff


def bucket_for(tokens: int) -> int:
    """Smallest static bucket holding ``tokens`` (<= T_MAX)."""
    for b in T_BUCKETS:
        if tokens <= b:
            return b
    raise ValueError(f"{tokens} tokens exceed the largest bucket {T_MAX}; split into chunks (host.chunks)")


def chunks(tokens: int) -> list[tuple[int, int, int]]:
    """(start, stop, bucket) per kernel call for a batch of ``tokens``."""
    out = []
    for start in range(0, tokens, T_MAX):
        stop = min(tokens, start + T_MAX)
        out.append((start, stop, bucket_for(stop - start)))
    return out


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))]).contiguous()


def run_chunked(launch, x: torch.Tensor, affinities: torch.Tensor) -> torch.Tensor:
    """Call ``launch(hidden_bf16 [B, H], affinities [B, E]) -> [B, H] fp32`` per bucketed chunk; unpad."""
    outs = []
    for start, stop, bucket in chunks(x.shape[0]):
        hidden = pad_rows(x[start:stop].to(torch.bfloat16), bucket)
        aff = pad_rows(affinities[start:stop], bucket)  # padded tokens have zero affinity: they add nothing
        outs.append(launch(hidden, aff)[: stop - start])
    return torch.cat(outs) if outs else x.new_zeros((0, 0), dtype=torch.float32)
