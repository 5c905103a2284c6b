"""Host-side token grouping for the token-grouped (prefill) kernel: which routed rows each local expert
computes, in 128-row tiles, and which logical core computes each expert.

Routing ``topk_ids [T, k]`` (local ids, -1 = not on this rank) becomes a list of routed rows sorted by
expert; each expert's rows are padded up to whole 128-row tiles (padding rows carry weight 0 and token 0,
and are not scattered back). The kernel's work is then sum_e ceil(n_e / 128) tiles: it grows with the
routed rows T x top_k, not with T x E_local as the dense kernel's does.

The tile schedule (tiles per expert, program per expert) is a trace-time constant of the kernel: on
Neuron every distinct schedule is a distinct compiled kernel (see DEVELOPING.md, "Kernel launch").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

P = 128


@dataclass(frozen=True)
class Groups:
    """Routed rows of one call grouped by local expert into 128-row tiles."""

    token_index: torch.Tensor  # [R] int64: the token each gathered row comes from (padding rows: 0)
    row_weight: torch.Tensor  # [R, 1] float32: routing weight of the row (padding rows: 0)
    valid: torch.Tensor  # [R] bool: False on padding rows
    expert_tiles: tuple[int, ...]  # tiles of 128 rows per local expert, in expert order
    expert_program: tuple[int, ...]  # the program (logical core) that computes each expert

    @property
    def rows(self) -> int:
        return int(self.token_index.shape[0])

    @property
    def routed(self) -> int:
        return int(self.valid.sum())


def group_by_expert(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, programs: int = 1) -> Groups:
    """Group the routed (token, expert) pairs by expert; pad each expert to whole 128-row tiles."""
    ids = topk_ids.long()
    if ids.shape != topk_weights.shape or ids.dim() != 2:
        raise ValueError(f"topk_ids {tuple(ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T, k]")
    if bool((ids >= num_experts).any()):
        raise ValueError(f"topk_ids holds expert id {int(ids.max())} >= the {num_experts} local experts")
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    tokens, pairs = torch.nonzero(ids >= 0, as_tuple=True)
    experts = ids[tokens, pairs]
    order = torch.argsort(experts, stable=True)
    tokens, experts, weights = tokens[order], experts[order], topk_weights.float()[tokens[order], pairs[order]]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    tiles = tuple((c + P - 1) // P for c in counts)
    total = sum(tiles) * P
    token_index = torch.zeros(total, dtype=torch.long)
    row_weight = torch.zeros(total, 1, dtype=torch.float32)
    valid = torch.zeros(total, dtype=torch.bool)
    src = dst = 0
    for count, n_tiles in zip(counts, tiles):
        token_index[dst:dst + count] = tokens[src:src + count]
        row_weight[dst:dst + count, 0] = weights[src:src + count]
        valid[dst:dst + count] = True
        src, dst = src + count, dst + n_tiles * P
    return Groups(token_index, row_weight, valid, tiles, assign_programs(tiles, programs))


def assign_programs(expert_tiles: tuple[int, ...], programs: int) -> tuple[int, ...]:
    """Contiguous expert ranges per program with about equal tile counts (by each expert's middle tile)."""
    total = sum(expert_tiles)
    out, start = [], 0
    for n in expert_tiles:
        middle = start + n / 2
        out.append(min(programs - 1, int(middle * programs / total)) if total else 0)
        start += n
    return tuple(out)


def gather_rows(x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """[R, H] bf16: the hidden state of every gathered row (padding rows: token 0, weighted 0)."""
    return x.to(torch.bfloat16).index_select(0, groups.token_index).contiguous()


def scatter_rows(rows_out: torch.Tensor, groups: Groups, tokens: int) -> torch.Tensor:
    """[T, H] fp32: add each valid row's weighted expert output into its token."""
    out = torch.zeros(tokens, rows_out.shape[1], dtype=torch.float32)
    out.index_add_(0, groups.token_index[groups.valid], rows_out[groups.valid].float())
    return out
