"""Checkpoint loading for the Neuron experts module, in vllm-neuron's TP and EP conventions.

Routed experts (:func:`load_layer_experts`): one layer's local experts are read straight from the FP8
checkpoint (per-expert ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` E4M3FN bytes plus their
``weight_scale_inv`` blocks or ``weight_scale`` rows), cut to this rank exactly as vllm-neuron's BF16
loaders cut them, repacked (:func:`vllm_moe_w8.codec.fp8.repack`, pow2 by default, output-block opt-in),
self-checked on a few experts (:mod:`vllm_moe_w8.vllm_glue.self_check`) and laid out for the NKI kernels
(:func:`vllm_moe_w8.kernels.host.to_kernel_layout`). The kernel layout is the only copy kept.

* EP: linear placement, EP rank ``k`` owns global experts ``[k*L, (k+1)*L)`` (``L = E / ep_degree``).
* TP: the intermediate dim is split ``tp_degree`` ways; shard ``r = tp_rank % tp_degree`` holds rows
  ``[r*I_r, (r+1)*I_r)`` of gate and up and the same columns of down.

Every other FP8 tensor (attention, shared expert, dense MLP) reaches vllm-neuron's own loaders already
dequantised to the model dtype (:mod:`vllm_moe_w8.neuron_glue.slice_hook`): they see an ordinary BF16 checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from vllm_moe_w8.codec import fp8
from vllm_moe_w8.codec.checkpoint import Checkpoint, CheckpointError
from vllm_moe_w8.vllm_glue import self_check
from vllm_moe_w8.kernels.host import KernelWeights, P, to_kernel_layout

logger = logging.getLogger("vllm.neuron_w8")

PROJS = ("gate_proj", "up_proj", "down_proj")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


@dataclass(frozen=True)
class RankPlan:
    """Which experts and which slice of the intermediate dim this rank holds."""

    num_experts: int
    ep_degree: int
    ep_rank: int
    tp_degree: int
    tp_rank: int  # already reduced modulo tp_degree
    intermediate_size: int
    hidden_size: int

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_degree

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local

    @property
    def inter_per_rank(self) -> int:
        return self.intermediate_size // self.tp_degree

    def validate(self, where: str) -> None:
        if self.num_experts % self.ep_degree:
            raise ValueError(f"neuron-w8: {where}: {self.num_experts} experts do not split over ep_degree {self.ep_degree}")
        if self.intermediate_size % self.tp_degree:
            raise ValueError(f"neuron-w8: {where}: moe_intermediate_size {self.intermediate_size} does not split over tp_degree {self.tp_degree}")
        if self.inter_per_rank % P or self.hidden_size % P:
            raise ValueError(
                f"neuron-w8: {where}: the NKI kernels need hidden_size ({self.hidden_size}) and the per-rank intermediate "
                f"size ({self.intermediate_size} / tp_degree {self.tp_degree} = {self.inter_per_rank}) to be multiples of "
                f"{P}. Use fewer tensor-parallel ranks per expert: enable expert parallelism (--enable-expert-parallel) "
                "so that tp_degree = tensor_parallel_size / ep_degree is smaller"
            )


class ExpertSource:
    """Per-expert tensors of one checkpoint folder (headers read once; data read per layer)."""

    def __init__(self, path: str, text_prefix: str):
        self.ckpt = Checkpoint(path)
        self.ckpt.raise_on_file_problems()
        self.prefix = text_prefix  # e.g. "model.layers." or "model.language_model.layers."

    def stem(self, layer: int, expert: int, proj: str) -> str:
        return f"{self.prefix}{layer}.mlp.experts.{expert}.{proj}"

    def names(self, layer: int, expert: int, proj: str) -> tuple[str, str]:
        return self.fp8_names(self.stem(layer, expert, proj),
                              f"<prefix>{layer}.mlp.experts.<e>.<gate|up|down>_proj.weight")

    def fp8_names(self, stem: str, pattern: str = "") -> tuple[str, str]:
        """(weight, scale) names of the FP8 matrix ``stem``; CheckpointError naming what is missing."""
        weight = f"{stem}.weight"
        if weight not in self.ckpt.tensors:
            raise CheckpointError(
                f"{self.ckpt.path}: no tensor {weight!r}; neuron-w8 loads FP8 tensors "
                f"({pattern or stem + '.weight'}) of a block-FP8 or per-channel checkpoint"
            )
        for suffix in SCALE_SUFFIXES:
            if f"{stem}.{suffix}" in self.ckpt.tensors:
                return weight, f"{stem}.{suffix}"
        raise CheckpointError(f"{self.ckpt.path}: {weight!r} has no {' or '.join(SCALE_SUFFIXES)}: an FP8 weight without its scale")

    def read_expert(self, layer: int, expert: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
        return self._read({proj: self.names(layer, expert, proj) for proj in PROJS})

    def read_mlp(self, stem: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
        """gate/up/down of an MLP at ``stem`` (e.g. ``...layers.3.mlp.shared_expert``), read like one expert."""
        return self._read({proj: self.fp8_names(f"{stem}.{proj}") for proj in PROJS})

    def _read(self, wanted: dict[str, tuple[str, str]]) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
        got = self.ckpt.load_many([n for pair in wanted.values() for n in pair])
        return {proj: (got[w], got[s], w) for proj, (w, s) in wanted.items()}


def expert_keys(prefix: str, layer: int, plan: RankPlan) -> list[str]:
    """The checkpoint keys this rank's experts of ``layer`` can be read from (per-expert layout: each projection's
    ``.weight`` and either scale name), in the EP linear placement: what :func:`load_layer_experts` reads, for a
    host whose own loader accounts for every key of its rank (vllm-neuron's GLM-5, ``neuron_glue.glm_moe_dsa``)."""
    return [f"{prefix}{layer}.mlp.experts.{plan.first_expert + e}.{proj}.{suffix}"
            for e in range(plan.num_local) for proj in PROJS for suffix in ("weight",) + SCALE_SUFFIXES]


def _tp_cut(proj: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], plan: RankPlan):
    """This rank's slice of one projection and its scale grid (block rows/cols cut where the weight is)."""
    i_r, r = plan.inter_per_rank, plan.tp_rank
    if plan.tp_degree == 1:
        return weight, scale
    lo, hi = r * i_r, (r + 1) * i_r
    bn, bk = block
    if proj in ("gate_proj", "up_proj"):  # [I, H]: rows
        return weight[lo:hi], (scale[lo // bn: hi // bn] if bn > 1 else scale[lo:hi])
    # down [H, I]: columns; per-channel scales are per output row (H) and stay whole
    w = weight[:, lo:hi]
    return w, (scale[:, lo // bk: hi // bk] if bk > 0 else scale)


def _check_shapes(proj: str, weight: torch.Tensor, plan: RankPlan, name: str) -> None:
    want = (plan.hidden_size, plan.intermediate_size) if proj == "down_proj" else (plan.intermediate_size, plan.hidden_size)
    if tuple(weight.shape) != want:
        raise CheckpointError(f"neuron-w8: tensor {name} has shape {tuple(weight.shape)}; the model config implies {want}")


def _sampled(settings, num_local: int) -> list[int]:
    n = min(settings.self_check_experts, num_local) if settings.self_check else 0
    if n <= 0:
        return []
    return sorted({round(i * (num_local - 1) / max(n - 1, 1)) for i in range(n)})


@dataclass
class LayerLoad:
    weights: KernelWeights
    stats: fp8.RepackStats
    checked: int
    seconds: float


def load_layer_experts(source: ExpertSource, layer: int, plan: RankPlan, settings, read=None, cut=None) -> LayerLoad:
    """Read, cut, repack, self-check and lay out one layer's local experts (see the module docstring).
    ``read(layer, global expert) -> {proj: (weight, scale, name)}`` and ``cut(proj, weight, scale) -> (codes, grid)``
    replace the per-expert reader and the TP cut of the plan (the shared expert: ``neuron_glue.shared_expert``)."""
    read = read or source.read_expert
    t0 = time.perf_counter()
    plan.validate(f"layer {layer}")
    mode, fmt = settings.mode, settings.fmt
    block = tuple(fmt.expert_block)
    out_block = (fp8.OUTPUT_BLOCK_ROWS, 0) if mode == "output-block" else block
    code_format = fp8.CODE_FORMAT[mode]
    L, h, i_r = plan.num_local, plan.hidden_size, plan.inter_per_rank
    w13 = torch.empty(L, 2 * i_r, h, dtype=torch.uint8)
    w2 = torch.empty(L, h, i_r, dtype=torch.uint8)
    s13_parts, s2_parts = [], []
    stats = fp8.RepackStats()
    sampled = set(_sampled(settings, L))
    checked = 0
    for e in range(L):
        g = plan.first_expert + e
        where = f"layer {layer}, expert {g} (local {e})"
        raw = read(layer, g)
        reps = {}
        for proj, (weight, scale, name) in raw.items():
            _check_shapes(proj, weight, plan, name)
            codes, grid = cut(proj, weight, scale) if cut else _tp_cut(proj, weight, scale, block, plan)
            if fmt.converted:
                rep = fp8.Repacked(fp8._as_bytes(codes).contiguous(), grid.float().contiguous(), mode, out_block)
            else:
                rep = fp8.repack(codes, grid, mode, block, name=name)
            reps[proj] = (rep, codes, grid)
            stats = stats.add(rep.stats)
        w13[e, :i_r] = reps["gate_proj"][0].codes
        w13[e, i_r:] = reps["up_proj"][0].codes
        w2[e] = reps["down_proj"][0].codes
        s13_parts.append(torch.cat([reps["gate_proj"][0].scale_grid, reps["up_proj"][0].scale_grid]))
        s2_parts.append(reps["down_proj"][0].scale_grid)
        if e in sampled:
            _self_check(reps, where, mode, block, code_format, converted=fmt.converted)
            checked += 1
    kw = to_kernel_layout(w13, torch.stack(s13_parts), w2, torch.stack(s2_parts), out_block[0], out_block[1], code_format)
    return LayerLoad(kw, stats, checked, time.perf_counter() - t0)


def _self_check(reps, where: str, mode: str, block, code_format: str, converted: bool) -> None:
    """The stored codes x scales of one expert against the checkpoint (the rules of :mod:`vllm_moe_w8.vllm_glue.self_check`)."""
    got = {proj: fp8.dequantize(rep) for proj, (rep, _, _) in reps.items()}
    self_check.check_finite(got, where, code_format, mode)
    if converted:
        return
    n_diff, counted = 0, 0
    for proj, (rep, codes, grid) in reps.items():
        new_scale_el = fp8.expand_scales(rep.scale_grid, tuple(codes.shape), rep.block) if mode == "output-block" else None
        n_diff += self_check.check_projection(got[proj], codes, grid, block, mode, where, proj, new_scale_el)
        counted += rep.stats.values_changed
    self_check.check_rounded_count(mode, n_diff, counted, where)


def meta_weights(plan: RankPlan, mode: str, extra_experts: int = 0) -> KernelWeights:
    """Kernel-layout buffers on the meta device (shapes and dtypes of what :func:`load_layer_experts` makes; with
    ``extra_experts`` more local experts of the same shape, the shared expert's slot)."""
    e, h, i_r = plan.num_local + extra_experts, plan.hidden_size, plan.inter_per_rank
    g13, g2 = (h // P, i_r // P) if mode == "pow2" else (1, 1)
    meta = dict(device="meta")
    return KernelWeights(torch.empty(e, P, h // P, 2 * i_r, dtype=torch.uint8, **meta),
                         torch.empty(e, 2 * i_r // P, g13, dtype=torch.float32, **meta),
                         torch.empty(e, P, i_r // P, h, dtype=torch.uint8, **meta),
                         torch.empty(e, h // P, g2, dtype=torch.float32, **meta), mode)


def from_kernel_layout(kw: KernelWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The op layout (w13 [E, 2I, H], w2 [E, H, I] uint8) back from the kernel layout (tests, self-checks)."""
    e, p, hc, two_i = kw.w13.shape
    w13 = kw.w13.transpose(1, 2).reshape(e, hc * p, two_i).transpose(1, 2).contiguous()
    e, p, ic, h = kw.w2.shape
    w2 = kw.w2.transpose(1, 2).reshape(e, ic * p, h).transpose(1, 2).contiguous()
    return w13, w2


def resolve_checkpoint_dir(path: str, cache_dir: str | None) -> str:
    """A local folder for ``path`` (a folder already, or a hub id vllm-neuron's loader has downloaded)."""
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, cache_dir=cache_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means: no local copy to read experts from
        raise CheckpointError(
            f"neuron-w8: cannot find a local copy of {path!r} to read its experts from ({e}); pass a local checkpoint "
            "folder as the model, or download it first (huggingface-cli download)"
        ) from e


def log_totals(loads: list[LayerLoad], settings, plan: RankPlan, layers: int | None = None) -> None:
    """One INFO line over every load (``layers``: the MoE layers they belong to, default one load per layer)."""
    if not loads:
        return
    stats = fp8.RepackStats()
    for ld in loads:
        stats = stats.add(ld.stats)
    nbytes = sum(t.numel() * t.element_size() for ld in loads
                 for t in (ld.weights.w13, ld.weights.w13_scales, ld.weights.w2, ld.weights.w2_scales))
    logger.info(
        "neuron-w8 on Neuron: loaded %d MoE layers (mode %s from %s; EP rank %d/%d, TP shard %d/%d, %d local experts, "
        "kernel layout %.2f MB): blocks shifted %d of %d, values rounded %d (max abs error %.3g); self-check %s; %.2f s; "
        "LNC %d",
        layers or len(loads), settings.mode, settings.mode_source, plan.ep_rank, plan.ep_degree, plan.tp_rank, plan.tp_degree,
        plan.num_local, nbytes / 1e6, stats.blocks_shifted, stats.blocks, stats.values_changed, stats.max_abs_error,
        f"passed on {sum(ld.checked for ld in loads)} experts" if any(ld.checked for ld in loads) else "off",
        sum(ld.seconds for ld in loads), settings.lnc,
    )
