"""A rank's slice of a checkpoint matrix, cut by the vllm-neuron module's own weight loader.

vllm-neuron attaches a loader to every parameter (``vllm_neuron.utils.weight_loader.set_weight_loader``): a
``SafetensorsWeightLoader`` whose ``load(slices, rank)`` slices the checkpoint tensor(s) for the rank - whole-head
q shards, replicated KV heads chosen by ``rank // replicas``, row-parallel output projections, the [q | k | v]
segments of a fused projection each sharded on its own - and transposes to the parameter's ``[in, out]`` storage.
When neuron-w8 releases such a parameter (its 1-byte copy replaces it) it keeps that loader and runs it here on
*index probes* instead of values (:func:`cut`): the loader's own rule says which checkpoint rows and columns the
rank holds, so the FP8 bytes and their 128x128 block scales are cut exactly as vllm-neuron would cut the BF16
values, whatever the rule is. A probe is a ``PySafeSlice`` stand-in (``get_shape``, ``get_dtype``, indexing) over
a zero-stride view of checkpoint row (or column) numbers; the loader's slicing, concatenation and transposition
act on it as on the weights.

The rank's rows are then split into runs of consecutive checkpoint rows (:attr:`Cut.row_runs`: one for a
contiguous shard, one per segment of a fused [q | k | v]); each run's block scales are the checkpoint's block
rows it lies in, which exist only where each 128-row block of the run sits in one checkpoint block
(:func:`block_index`; likewise the columns). A slice that cuts through scale blocks is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128


class _IndexProbe:
    """What the loader sees instead of a safetensors slice: indexing returns checkpoint row (axis 0) or column
    (axis 1) numbers, broadcast to the tensor's shape."""

    def __init__(self, shape: tuple[int, ...], axis: int):
        self._shape, self._axis = tuple(shape), axis

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return "I64"

    def _full(self) -> torch.Tensor:
        n = self._shape[self._axis]
        view = [1] * len(self._shape)
        view[self._axis] = n
        return torch.arange(n, dtype=torch.int64, device="cpu").view(view).expand(self._shape)  # cpu: also under a meta build

    def __getitem__(self, index):
        return self._full()[index]


@dataclass(frozen=True)
class Cut:
    """A rank's slice: checkpoint row numbers of its N rows, column numbers of its K columns (the parameter's
    storage, transposed or not, is undone: rows are the checkpoint's output dim)."""

    rows: torch.Tensor  # [N_rank] int64
    cols: torch.Tensor  # [K_rank] int64
    transposed: bool  # the parameter stores [K, N] (vllm-neuron's [in, out] layout)

    @property
    def row_runs(self) -> list[tuple[int, int]]:
        """(first output row, length) of each run of consecutive checkpoint rows."""
        return runs(self.rows)


def runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """(start position, length) of each maximal run of consecutive values in ``indices``."""
    idx = indices.tolist()
    out, start = [], 0
    for i in range(1, len(idx) + 1):
        if i == len(idx) or idx[i] != idx[i - 1] + 1:
            out.append((start, i - start))
            start = i
    return out


def cut(loader, shape: tuple[int, int], rank: int, where: str) -> Cut:
    """The rank's slice of a checkpoint matrix of ``shape`` [N, K], as ``loader.load([slice], rank)`` takes it."""
    if len(shape) != 2:
        raise ValueError(f"neuron-w8: {where}: a {len(shape)}-d checkpoint tensor; only matrices are cut here")
    got_rows = loader.load([_IndexProbe(shape, 0)], rank)
    got_cols = loader.load([_IndexProbe(shape, 1)], rank)
    if got_rows.dim() != 2 or got_rows.shape != got_cols.shape:
        raise ValueError(f"neuron-w8: {where}: the module's weight loader made {tuple(got_rows.shape)} of a "
                         f"{tuple(shape)} checkpoint matrix; neuron-w8 cuts only 2-d slices")
    # checkpoint rows are constant along one output dim and columns along the other: that tells the storage
    along_dim1 = bool((got_rows == got_rows[:, :1]).all()) and bool((got_cols == got_cols[:1, :]).all())
    along_dim0 = bool((got_rows == got_rows[:1, :]).all()) and bool((got_cols == got_cols[:, :1]).all())
    if not (along_dim1 or along_dim0):
        raise ValueError(f"neuron-w8: {where}: the module's weight loader mixes checkpoint rows or columns within a "
                         "row of its output; neuron-w8 cuts only row x column selections")
    transposed = not along_dim1
    rows = got_rows[0, :] if transposed else got_rows[:, 0]
    cols = got_cols[:, 0] if transposed else got_cols[0, :]
    return Cut(rows.contiguous(), cols.contiguous(), transposed)


def block_index(indices: torch.Tensor, where: str, what: str) -> torch.Tensor:
    """The checkpoint block (of 128) each 128-entry block of ``indices`` lies in; refused when one straddles two."""
    blocks = []
    for b in range(0, indices.numel(), BLOCK):
        part = indices[b: b + BLOCK] // BLOCK
        if not bool((part == part[0]).all()):
            raise ValueError(
                f"neuron-w8: {where}: this rank's {what} {int(indices[b])}..{int(indices[min(b + BLOCK, indices.numel()) - 1])} "
                f"cross a 128x128 scale block of the checkpoint, so they have no block scale of their own; the 1-byte "
                "path needs each 128-row block of a rank's slice inside one checkpoint block (serve this model with "
                "--additional-config '{\"neuron_w8\": {\"non_expert_layers\": \"bf16\"}}' to keep vllm-neuron's BF16 "
                "path for these layers)")
        blocks.append(int(part[0]))
    return torch.tensor(blocks, dtype=torch.int64, device=indices.device)


def take(weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, where: str):
    """(FP8 bytes [len(rows), len(cols)], block scales on the slice's own 128-grid) of checkpoint ``weight`` [N, K]
    (uint8 or float8_e4m3fn) and its ``scale`` [ceil(N/128), ceil(K/128)]."""
    raw = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight  # E4M3FN bytes, as stored
    codes = raw.index_select(0, rows).index_select(1, cols)
    grid = scale.index_select(0, block_index(rows, where, "rows")).index_select(1, block_index(cols, where, "columns"))
    return codes.contiguous(), grid.contiguous()
