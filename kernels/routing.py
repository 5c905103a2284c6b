"""Routing metadata for the block-scheduled kernels (:mod:`.moe_w8_blocks`), built by traceable torch ops.

One place for both the interpreter path and the Neuron path: every function here is plain torch on the
routing's own device - no ``.item()``, ``.tolist()``, ``nonzero`` or Python loop over values - so it runs
inside a ``torch.compile(fullgraph=True)`` forward and its outputs stay device tensors the kernel reads
through registers and indirect DMA. Only the sizes are Python ints, and they depend on (T, top_k, E, B,
programs) alone, never on the routing: one compiled kernel per length bucket.

Layout (B rows per block; T tokens, E local experts, n programs):

* ``capacity_blocks(T, k, E, B)`` = N: the most blocks any routing of T x k local routes can need when each
  expert's rows are padded to whole blocks, ceil((T*k - (E-1)) / B) + E - 1 (E-1 experts with one row each
  and the rest in one expert; nki-library's ``bwmm_shard_on_I`` uses the same static capacity).
* ``token_position_to_id [N, B] int32``: the hidden row each block row gathers; padding rows point at the
  zero rows T + (position mod B) of the kernel's padded hidden [T + B, H]; past the kernel's [T, H] output, so
  its scatter-add skips them (``oob_mode.skip``: no bytes move for padding). In selective decode (T <= B) a
  block's rows are the token rows: row t is token t where it is routed to the block's expert, padding (T + t,
  weight 0) where not - so the kernel (kernels/selective_decode.py) needs neither the gather nor the stores.
* ``position_weight [N, B] float32``: the routing weight of that row (0 on padding); a token routed twice
  to the same expert gets one row with the summed weight.
* ``position_store [N, B, 2] int32``: where the kernel stores each block row's result in its program's output
  slab: column 0 the token when the row is the token's FIRST row in its program's blocks (in the order the program
  walks them: block order, then row order) - a plain indirect write -, column 1 the token for its later rows - a
  read-modify-write add -, and T + (position mod B) (past the [T, H] slab: ``oob_mode.skip`` moves nothing) in the
  other column and on padding rows. A token routed twice to one expert has one row (weights summed), so a block
  never holds two rows of one token and its write and add rows never address the same token.
* ``block_to_expert [N, 1] int32``: the local expert of each block (blocks past the used ones: E - 1,
  never visited).
* ``block_load_expert [N, 1] int32``: the block's expert where it differs from the previous block's or the block
  starts a program's share - the kernel loads that expert's scales (and resident codes) there -, else E (past the
  weight tables: the loading DMAs, ``oob_mode.skip``, move nothing and the previous expert's stay in SBUF).
* ``block_range [n, 2] int32``: (first block, block count) of each program; programs take contiguous,
  equal shares of the used blocks, so the work of a call is proportional to its routed rows - or, with
  ``aligned=True`` (block prefill where an expert's codes stay resident, ``host_routed.aligned_shares``),
  contiguous shares that start at expert boundaries (nearest the equal split), so each expert's codes cross HBM
  once per call - or, with ``split=True`` (the kernel splits each block's intermediate across the programs), every
  program walks all the used blocks: (0, used) on every row.
* ``program_tokens [n, T] bool`` (host side only, not a kernel input): the tokens program p's blocks store. In
  block prefill at LNC > 1 the kernel writes no zero fill (``moe_w8_blocks.zero_fill``): a slab row no block of that
  program stores is never written (garbage on the device), so :func:`combine` takes each slab only where its
  program stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

P = 128


def capacity_blocks(tokens: int, top_k: int, num_experts: int, block_rows: int) -> int:
    """N, the static block capacity (a Python int from sizes only)."""
    routes = tokens * top_k
    if routes <= num_experts - 1:
        return routes
    return -(-(routes - (num_experts - 1)) // block_rows) + num_experts - 1


@dataclass(frozen=True)
class BlockSchedule:
    token_position_to_id: torch.Tensor  # [N, B] int32
    position_weight: torch.Tensor  # [N, B] float32
    position_store: torch.Tensor  # [N, B, 2] int32: (plain-write token, read-modify-write token), T + row = neither
    block_to_expert: torch.Tensor  # [N, 1] int32
    block_load_expert: torch.Tensor  # [N, 1] int32: the expert whose weights the block loads, E = none
    block_range: torch.Tensor  # [programs, 2] int32: first block, count
    program_tokens: torch.Tensor  # [programs, T] bool: the tokens each program's blocks store (host side)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The kernel's metadata arguments, in launch order."""
        return (self.token_position_to_id, self.position_weight, self.position_store, self.block_to_expert,
                self.block_load_expert, self.block_range)


def local_affinities(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E] float32: each local expert's weight per token (ids outside [0, E) dropped, duplicates summed).

    Traceable twin of ``host.dense_affinities`` without its host-side id check (call
    :func:`check_routing` outside the traced graph to refuse ids >= E)."""
    ids = topk_ids.long()
    keep = (ids >= 0) & (ids < num_experts)
    aff = torch.zeros(ids.shape[0], num_experts, dtype=torch.float32, device=ids.device)
    return aff.scatter_add_(1, torch.where(keep, ids, 0), torch.where(keep, topk_weights.float(), 0.0))


def check_routing(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Eager-only check (reads values): refuse local ids >= E instead of dropping them."""
    if bool((topk_ids >= num_experts).any()):
        raise ValueError(f"topk_ids holds expert id {int(topk_ids.max())} >= the {num_experts} local experts")


def block_schedule(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, block_rows: int,
                   programs: int = 1, split: bool = False, aligned: bool = False) -> BlockSchedule:
    """The block metadata of one call (see the module docstring); device and traceable. ``split``: every program
    takes every used block (the intermediate-split selective decode, ``host_routed.split_inter``); ``aligned``: each
    program's share starts at an expert's first block (``host_routed.aligned_shares``)."""
    tokens, top_k = topk_ids.shape
    e, b = num_experts, block_rows
    n = capacity_blocks(tokens, top_k, e, b)
    dev = topk_ids.device
    aff = local_affinities(topk_weights, topk_ids, e)
    routed = aff != 0  # a zero-weight route adds exactly nothing: it needs no row
    counts = routed.sum(dim=0)
    blocks = (counts + b - 1) // b
    ends = torch.cumsum(blocks, dim=0)
    starts = ends - blocks
    if tokens <= b:  # selective decode: one block per routed expert, row t of it is token t (padding where unrouted)
        rank = torch.arange(tokens, device=dev)[:, None].expand(tokens, e)
    else:
        rank = torch.cumsum(routed.long(), dim=0) - 1  # row of (t, e) among expert e's rows
    dump = n * b  # one slot past the schedule for the routes that are not routed
    pos = torch.where(routed, starts[None, :] * b + rank, dump).reshape(-1)
    token = torch.arange(tokens, device=dev)[:, None].expand(tokens, e).reshape(-1)
    slots = torch.full((n * b + 1,), -1, dtype=torch.long, device=dev).scatter(0, pos, token)[: n * b]
    padding = tokens + torch.arange(n * b, device=dev) % b
    t2i = torch.where(slots >= 0, slots, padding).to(torch.int32).reshape(n, b)
    weight = torch.zeros(n * b + 1, dtype=torch.float32, device=dev).scatter(0, pos, aff.reshape(-1))[: n * b]
    block_ids = torch.arange(n, device=dev)
    b2e = torch.searchsorted(ends, block_ids, right=True).clamp(max=e - 1).to(torch.int32).reshape(n, 1)
    used = ends[-1]
    share = used if split else (used + programs - 1) // programs
    first = torch.minimum(torch.arange(programs, device=dev) * (0 if split else share), used)
    count = torch.minimum(used - first, share)
    if aligned and not split and programs > 1:
        first = _expert_boundaries(starts, used, programs)
        count = torch.cat([first[1:], used.reshape(1)]) - first
    block_range = torch.stack([first, count], dim=1).to(torch.int32)
    experts = b2e.reshape(-1)
    new = torch.ones(n, dtype=torch.int32, device=dev)
    if n > 1:
        new[1:] = (experts[1:] != experts[:-1]).to(torch.int32)
    new = new.scatter(0, first.clamp(max=max(n - 1, 0)), torch.ones(programs, dtype=torch.int32, device=dev))
    load = torch.where(new > 0, experts, e).to(torch.int32).reshape(n, 1)
    groups = 1 if split else programs
    if split:
        group = torch.zeros_like(block_ids)
    elif aligned:
        group = (torch.searchsorted(first.contiguous(), block_ids, right=True) - 1).clamp(0, groups - 1)
    else:
        group = (block_ids // share.clamp(min=1)).clamp(max=groups - 1)
    store, stored = _first_stores(slots, group.repeat_interleave(b), padding, tokens, groups)
    program_tokens = stored.expand(programs, tokens) if split else stored
    return BlockSchedule(t2i, weight.reshape(n, b), store.reshape(n, b, 2), b2e, load, block_range, program_tokens)


def _expert_boundaries(starts: torch.Tensor, used: torch.Tensor, programs: int) -> torch.Tensor:
    """[programs] first block of each program's share when the shares start at expert boundaries: the expert start
    (or ``used``: an empty share) nearest to p x used / programs - so no expert's blocks are split between programs
    and each expert's resident codes are read by one program only; the shares differ by at most an expert's blocks."""
    candidates = torch.cat([starts, used.reshape(1)])  # non-decreasing: so are the chosen starts
    p = torch.arange(programs, device=starts.device)
    distance = (programs * candidates[None, :] - used * p[:, None]).abs()  # programs x |start - p x used / programs|
    return candidates[distance.argmin(dim=1)]


def _first_stores(slots: torch.Tensor, group: torch.Tensor, padding: torch.Tensor, tokens: int, groups: int):
    """([N*B, 2] int32 store columns, [groups, T] bool stored): a slot (token ``slots``, -1 = padding, walked by
    program ``group``) is its token's first in that program when no earlier slot of the program holds the token."""
    real = slots >= 0
    slot = torch.arange(slots.shape[0], device=slots.device)
    key = torch.where(real, group * tokens + slots, groups * tokens)  # padding -> one slot past the keys
    first_slot = torch.full((groups * tokens + 1,), slots.shape[0], dtype=torch.long, device=slots.device)
    first_slot = first_slot.scatter_reduce(0, key, slot, reduce="amin", include_self=True)
    first = real & (first_slot[key] == slot)
    write = torch.where(first, slots, padding)
    add = torch.where(real & ~first, slots, padding)
    stored = (first_slot[:-1] < slots.shape[0]).reshape(groups, tokens)
    return torch.stack([write, add], dim=1).to(torch.int32), stored


def padded_hidden(x: torch.Tensor, block_rows: int) -> torch.Tensor:
    """[T + B, H] bf16: the tokens, then B zero rows the padding positions gather."""
    return torch.cat([x.to(torch.bfloat16), x.new_zeros((block_rows, x.shape[1]), dtype=torch.bfloat16)]).contiguous()


def combine(partials: torch.Tensor, tokens: int, program_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """[programs, T, H] fp32 partial sums -> [tokens, H]: the programs' shares added (one program: a view - its
    slab is zero-filled by the kernel). With ``program_tokens`` [programs, T] (the block kernels at LNC > 1, whose
    slabs hold only the rows their program stored) each slab counts only where its program stored: a selection, so
    the never-written rows (garbage, NaN in the interpreter) are never read into the sum."""
    if partials.shape[0] == 1:
        return partials[0, :tokens]
    if program_tokens is None:
        return partials.sum(dim=0)[:tokens]
    zero = partials.new_zeros(())
    total = torch.where(program_tokens[0, :, None], partials[0], zero)
    for p in range(1, partials.shape[0]):
        total = total + torch.where(program_tokens[p, :, None], partials[p], zero)
    return total[:tokens]
