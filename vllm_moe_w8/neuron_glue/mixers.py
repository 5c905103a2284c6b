"""Qwen3.5-MoE's attention and Gated-DeltaNet projections at 1 byte, adopted the way the MoE blocks are (issue #34).

vllm-neuron's Qwen3.5 mixers (fork whn09/vllm-neuron ``model/qwen3_5/model.py`` @3de9ea3 ``Qwen3_5Attention``,
``deltanet.py`` @7ea9927 ``Qwen3_5GatedDeltaNet``; upstream vllm-project/vllm-neuron ``model.py`` @aa9b76b,
``deltanet.py`` @b3a5a71) hold their projections as bare BF16 parameters stored ``[in, out]`` and multiply with ``@``
in four methods: ``_qkv`` / ``_finish`` (attention), ``_project`` / ``_output`` (DeltaNet). :func:`adopt` turns each
built mixer into ours in place: those methods become ours (:class:`W8Attention`, :class:`W8GatedDeltaNet`, mixed in
front of vllm-neuron's class, which keeps its name), everything else - ``forward``, ``forward_prefill`` /
``forward_decode``, the KV pages and recurrent state, norms, rotary, the delta rule, the collectives - stays
vllm-neuron's. The FP8 projections' parameters are released (so vllm-neuron's loader neither reads nor casts them),
their weight loaders kept: at load our loader (:func:`load`) reads each one's FP8 bytes and 128x128 block scales from
the checkpoint, cuts them with that loader's own TP rule (:mod:`tp_probe`: whole-head q shards, replicated KV heads,
row-parallel o_proj / out_proj, the [q | k | v] segments of in_proj_qkv), and packs them for the block-scaled 1-byte
linear kernel (``kernels.host_linear``), fused where one launch can serve several: q + k + v, in_proj_qkv + in_proj_z.
What the checkpoint keeps BF16 (``in_proj_ba``, ``conv1d``, the norms, ``dt_bias`` / ``A_log``) stays vllm-neuron's.

Our methods do what vllm-neuron's do around the matmuls (its ``q_norm`` / ``k_norm`` modules, its
``apply_partial_rotary``, its query-head replication window ``o_offset`` / ``o_size`` where the module has one), with
each product from ``kernel_launch.run_linear_w8`` (fp32, cast to the module's dtype as vllm-neuron's BF16 ``@``
returns it). They are checked against vllm-neuron's own methods in both trees (tests/test_neuron_glue_mixers.py).
Trace-safe: shapes and Python constants only; the kernels' backend and LNC are resolved at adoption.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_moe_w8.neuron_glue import interfaces, kernel_launch, tp_probe
from vllm_moe_w8.neuron_glue.interfaces import NeuronGlueError
from vllm_moe_w8.vllm_glue import self_check

WEIGHT_LOADER = ("vllm_neuron.utils.weight_loader", "get_weight_loader")


@dataclass(frozen=True)
class Group:
    """One launch: the released parameters it fuses (in output order) and their checkpoint projection names."""

    name: str
    params: tuple[str, ...]
    checkpoint: tuple[str, ...]  # "<mixer>.<proj>" under the layer's prefix, e.g. "self_attn.q_proj"


@dataclass(frozen=True)
class MixerTarget:
    kind: str
    module: tuple[str, str]
    groups: tuple[Group, ...]
    methods: dict  # method -> its parameter names (vllm-neuron's signature, checked at adoption)
    attrs: tuple[str, ...]


ATTENTION = MixerTarget(
    kind="attention", module=("vllm_neuron.model.qwen3_5.model", "Qwen3_5Attention"),
    groups=(Group("qkv", ("q_proj_weight", "k_proj_weight", "v_proj_weight"),
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            Group("o", ("o_proj_weight",), ("self_attn.o_proj",))),
    methods={"_qkv": ("hidden_states", "cos", "sin"), "_finish": ("attn_output", "gate")},
    attrs=("dtype", "head_dim", "num_heads_per_rank", "num_kv_heads_per_rank", "q_size", "kv_size", "q_norm", "k_norm",
           "tp_group", "layer_idx"),
)
DELTANET = MixerTarget(
    kind="deltanet", module=("vllm_neuron.model.qwen3_5.deltanet", "Qwen3_5GatedDeltaNet"),
    groups=(Group("qkvz", ("in_proj_qkv_weight", "in_proj_z_weight"), ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z")),
            Group("out", ("out_proj_weight",), ("linear_attn.out_proj",))),
    methods={"_project": ("hidden_states",), "_output": ("core", "z", "num_tokens")},
    attrs=("dtype", "num_v_heads", "conv_dim", "value_dim", "rms_norm_eps", "norm_weight", "in_proj_ba_weight", "A_log",
           "dt_bias", "tp_group", "layer_idx"),
)
TARGETS = (ATTENTION, DELTANET)
ROTARY = ("vllm_neuron.model.qwen3_5.model", "apply_partial_rotary")


def _host_linear():
    from vllm_moe_w8.kernels import host_linear

    return host_linear


class _W8Linears:
    """Storage of a mixer's 1-byte projections (one ``LinearWeights`` per :class:`Group`, its tensors as buffers so
    the model's ``.to()`` and the compiled graph see them) and the launch."""

    w8_target: MixerTarget

    def w8_setup(self, target: MixerTarget, loaders: dict, rank: int, lnc: int, where) -> None:
        self.w8_target, self.w8_loaders, self.w8_rank, self.w8_lnc, self.w8_backend = target, loaders, rank, lnc, where
        self.w8_templates: dict = {}

    def w8_set_linear(self, group: str, lw, device=None) -> None:
        fields = {}
        for f in dataclasses.fields(lw):
            value = getattr(lw, f.name)
            if torch.is_tensor(value):
                value = value.to(device) if device is not None else value
                self.register_buffer(f"w8_{group}_{f.name}", value, persistent=False)
                fields[f.name] = None
        self.w8_templates[group] = dataclasses.replace(lw, **fields)

    def w8_linear(self, group: str):
        template = self.w8_templates.get(group)
        if template is None:
            raise NeuronGlueError(f"neuron-w8: layer {self.layer_idx} {self.w8_target.kind}: {group} used before "
                                  "load_weights filled it")
        tensors = {f.name: getattr(self, f"w8_{group}_{f.name}") for f in dataclasses.fields(template)
                   if getattr(template, f.name) is None}
        return dataclasses.replace(template, **tensors)

    def w8_matmul(self, x: torch.Tensor, group: str) -> torch.Tensor:
        """``x @ W`` of the group's fused projections [T, N] fp32 through the 1-byte linear kernel."""
        with torch.no_grad():
            return kernel_launch.run_linear_w8(x.detach().to(torch.bfloat16), self.w8_linear(group), lnc=self.w8_lnc,
                                               where=self.w8_backend)


class W8Attention(_W8Linears):
    """``_qkv`` / ``_finish`` of vllm-neuron's ``Qwen3_5Attention`` with q + k + v in one launch and o_proj in another."""

    def _qkv(self, hidden_states, cos, sin):
        tokens = hidden_states.shape[0]
        hd, nh, nkh = self.head_dim, self.num_heads_per_rank, self.num_kv_heads_per_rank
        y = self.w8_matmul(hidden_states, "qkv").to(self.dtype)
        q, gate = y[:, :2 * self.q_size].reshape(tokens, nh, 2 * hd).chunk(2, dim=-1)
        gate = gate.reshape(tokens, self.q_size)
        k = y[:, 2 * self.q_size:2 * self.q_size + self.kv_size].reshape(tokens, nkh, hd)
        v = y[:, 2 * self.q_size + self.kv_size:].reshape(tokens, nkh, hd).transpose(0, 1)
        q = self.q_norm(q).transpose(0, 1)
        k = self.k_norm(k).transpose(0, 1)
        rotate = self.w8_rotary
        return rotate(q, cos, sin), rotate(k, cos, sin), v, gate

    def _finish(self, attn_output, gate):
        attn_output = attn_output * torch.sigmoid(gate.float()).to(attn_output.dtype)
        if getattr(self, "q_replicas", 1) > 1:  # upstream @aa9b76b: a replicated head's window of this rank
            attn_output = attn_output[:, self.o_offset:self.o_offset + self.o_size]
        return self.w8_matmul(attn_output, "o").to(attn_output.dtype)


class W8GatedDeltaNet(_W8Linears):
    """``_project`` / ``_output`` of vllm-neuron's ``Qwen3_5GatedDeltaNet``: in_proj_qkv + in_proj_z in one launch,
    out_proj in another; ``in_proj_ba`` (BF16 in the checkpoint) stays vllm-neuron's matmul."""

    def _project(self, hidden_states):
        hidden_states = hidden_states.to(self.dtype)
        y = self.w8_matmul(hidden_states, "qkvz").to(self.dtype)
        qkv, z = y[:, :self.conv_dim], y[:, self.conv_dim:]
        ba = hidden_states @ self.in_proj_ba_weight
        b, a = ba[..., :self.num_v_heads], ba[..., self.num_v_heads:]
        beta = b.float().sigmoid()
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        return qkv, z, beta, g

    def _output(self, core, z, num_tokens):
        core = core.float()
        core = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.rms_norm_eps)
        core = self.norm_weight * core.to(self.dtype)
        core = core * F.silu(z.reshape_as(core).float())
        core = core.to(self.dtype).reshape(num_tokens, self.value_dim)
        return self.w8_matmul(core, "out").to(self.dtype)


MIXINS = {"attention": W8Attention, "deltanet": W8GatedDeltaNet}
_classes: dict = {}


def _w8_class(cls: type, mixin: type) -> type:
    key = (cls, mixin)
    if key not in _classes:
        _classes[key] = type(cls.__name__, (mixin, cls), {"__module__": __name__, "__qualname__": f"W8{cls.__name__}"})
    return _classes[key]


def check_module(module, target: MixerTarget, where: str) -> None:
    """The built mixer has every attribute, released parameter and method (with vllm-neuron's signature) we use."""
    params = [p for g in target.groups for p in g.params]
    missing = [a for a in target.attrs + tuple(params) if not hasattr(module, a)]
    wrong = []
    for name, args in target.methods.items():
        method = getattr(type(module), name, None)
        got = tuple(inspect.signature(method).parameters)[1:] if method is not None else None
        if got != args:
            wrong.append(f"{name}{'(' + ', '.join(got) + ')' if got is not None else ' missing'}, expected ({', '.join(args)})")
    if missing or wrong:
        raise NeuronGlueError(
            f"neuron-w8 on Neuron: {where} ({type(module).__module__}.{type(module).__name__}, vllm-neuron "
            f"{interfaces.vllm_neuron_version()}) lacks {missing + wrong}; its interface changed from the one neuron-w8 "
            "was written against (DEVELOPING.md, 'vllm-neuron interfaces we use'). --additional-config "
            "'{\"neuron_w8\": {\"non_expert_layers\": \"bf16\"}}' keeps vllm-neuron's BF16 path for these layers"
        )


def adopt(model, settings) -> tuple[list, list]:
    """Adopt every Qwen3.5 attention / DeltaNet module of a built model (``non_expert_layers`` ``w8``): (adopted,
    kept BF16 with why). A module whose rank slice the 1-byte kernel cannot take (:func:`plan_cuts`) keeps
    vllm-neuron's BF16 parameters and matmuls, and the load log names it."""
    if not settings.non_expert_w8:
        return [], []
    get_loader = interfaces.import_attr(*WEIGHT_LOADER)
    rotary = interfaces.import_attr(*ROTARY)
    where = kernel_launch.backend()
    classes = {t.kind: (t, interfaces.import_attr(*t.module)) for t in TARGETS}
    shapes = checkpoint_shapes(model.text_config)
    adopted, kept = [], []
    for name, module in model.named_modules():
        for target, cls in classes.values():
            if type(module) is not cls:
                continue
            check_module(module, target, name)
            loaders = {p: get_loader(getattr(module, p)) for g in target.groups for p in g.params}
            rank = int(module.tp_group.rank_in_group)
            cuts, why = plan_cuts(target, loaders, rank, shapes, settings.lnc, name)
            if cuts is None:
                kept.append((name, why))
                continue
            for p in loaders:
                delattr(module, p)
            module.__class__ = _w8_class(cls, MIXINS[target.kind])
            module.w8_setup(target, loaders, rank, settings.lnc, where)
            module.w8_cuts, module.w8_rotary = cuts, rotary
            adopted.append((name, module))
    return adopted, kept


def plan_cuts(target: MixerTarget, loaders: dict, rank: int, shapes: dict, lnc: int, where: str):
    """({param: tp_probe.Cut}, None) when every group's parts can be 1-byte linears, else (None, why): each part (a
    run of consecutive checkpoint rows of a rank's slice) whole 128x128 blocks of the checkpoint, K within the kernel's
    limit, and each fused group's N/128 a multiple of the LNC (the decode kernel splits N between the programs)."""
    hl = _host_linear()
    cuts = {}
    for group in target.groups:
        n_total = 0
        for param, proj in zip(group.params, group.checkpoint):
            cut = tp_probe.cut(loaders[param], shapes[proj], rank, f"{where} {proj}")
            k = cut.cols.numel()
            for start, length in cut.row_runs:
                rows = cut.rows[start:start + length]
                if length % hl.P or k % hl.P or k > hl.MAX_K:
                    return None, (f"{proj}: this rank's slice is {length} rows x {k} columns; the 1-byte linear kernel "
                                  f"takes whole {hl.P}x{hl.P} blocks and K <= {hl.MAX_K}")
                try:
                    tp_probe.block_index(rows, f"{where} {proj}", "rows")
                    tp_probe.block_index(cut.cols, f"{where} {proj}", "columns")
                except ValueError as e:
                    return None, str(e).split("; the 1-byte path")[0]
                n_total += length
            cuts[param] = cut
        if (n_total // hl.P) % lnc:
            return None, f"{group.name}: N = {n_total} is {n_total // hl.P} blocks of {hl.P}, which LNC {lnc} cannot split"
    return cuts, None


def adopted_mixers(model) -> list:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _W8Linears)]


def checkpoint_shapes(text_config) -> dict[str, tuple[int, int]]:
    """[N, K] of every adopted projection in the checkpoint, from the model's text config (vllm-neuron's
    ``Qwen3_5TextConfig`` field names): the gated q emits [query | gate] per head."""
    c, h = text_config, text_config.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    return {"self_attn.q_proj": (2 * q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "linear_attn.in_proj_qkv": (2 * kd + vd, h), "linear_attn.in_proj_z": (vd, h),
            "linear_attn.out_proj": (h, vd)}


def group_parts(module, group: Group, shapes: dict, where: str, read=None, cuts: dict | None = None) -> list:
    """The group's (FP8 codes, block scales, name) parts in output order: each released parameter's rank slice
    (its own loader's rule, :func:`plan_cuts`; ``cuts`` to use others) split at every break in its checkpoint rows.
    ``read(proj) -> (weight [N, K], scale, weight name)``; None: zero codes and unit scales of the checkpoint's shapes
    (a weights-free load)."""
    parts = []
    cuts = cuts or module.w8_cuts
    for param, proj in zip(group.params, group.checkpoint):
        if read is not None:
            weight, scale, weight_name = read(proj)
            if tuple(weight.shape) != shapes[proj]:
                raise NeuronGlueError(f"neuron-w8: {weight_name} has shape {tuple(weight.shape)}; the model's config "
                                      f"implies {shapes[proj]}")
        else:
            n, k = shapes[proj]
            weight, weight_name = torch.zeros(n, k, dtype=torch.uint8, device="cpu"), f"{where}.{proj} (shapes only)"
            scale = torch.ones(-(-n // tp_probe.BLOCK), -(-k // tp_probe.BLOCK), dtype=torch.float32, device="cpu")
        cut = cuts[param]
        for start, length in cut.row_runs:
            rows = cut.rows[start:start + length]
            codes, grid = tp_probe.take(weight, scale, rows, cut.cols, f"{where} {proj}")
            parts.append((codes, grid, weight_name if len(cut.row_runs) == 1 else f"{weight_name}[rows {int(rows[0])}..]"))
    return parts


def pack(parts: list, name: str):
    """One ``LinearWeights`` of the parts, concatenated along N (``host_linear.fuse`` when more than one)."""
    hl = _host_linear()
    lws = [hl.linear_weights(codes, grid, name=part_name) for codes, grid, part_name in parts]
    return lws[0] if len(lws) == 1 else hl.fuse(lws, name=name)


def load(source, model, device, check: bool = True) -> int:
    """Fill every adopted mixer's projections from the checkpoint (``loaders.ExpertSource``) onto ``device``; the
    number of packed launches' weights. With ``check`` (the ``self_check`` setting) the first mixer of each kind is
    self-checked as the experts are (:func:`check_packed`) before anything moves to ``device``."""
    shapes, count, checked = checkpoint_shapes(model.text_config), 0, set()
    for name, module in adopted_mixers(model):
        kind = module.w8_target.kind
        for group in module.w8_target.groups:
            parts = group_parts(module, group, shapes, name, reader(source, module))
            lw = pack(parts, f"{name}.{group.name}")
            if check and kind not in checked:
                check_packed(parts, lw, f"{name}.{group.name}")
            module.w8_set_linear(group.name, lw, device)
            count += 1
        checked.add(kind)
    return count


def check_packed(parts: list, lw, where: str) -> None:
    """The packed weights (what the kernel holds: stored codes x scales) against the checkpoint's codes x scales of
    every part, by the experts' self-check rules (``vllm_glue.self_check``, pow2: equal except the odd subnormals the
    repack says it rounded, each within its bound). Raises ``NumericsSelfCheckError`` naming the part."""
    hl = _host_linear()
    got = hl.dense_weight(lw)
    self_check.check_finite({where: got}, where, "e4m3", "pow2")
    row, n_diff = 0, 0
    for codes, grid, part_name in parts:
        n = codes.shape[0]
        n_diff += self_check.check_projection(got[row:row + n], codes, grid, (hl.P, hl.P), "pow2", where, part_name)
        row += n
    self_check.check_rounded_count("pow2", n_diff, lw.stats.values_changed, where)


def reader(source, module):
    """``read(proj) -> (weight, scale, name)`` of one mixer's FP8 projections from the checkpoint."""
    def read(proj):
        weight_name, scale_name = source.fp8_names(f"{source.prefix}{module.layer_idx}.{proj}")
        got = source.ckpt.load_many([weight_name, scale_name])
        return got[weight_name], got[scale_name], weight_name
    return read


def set_meta(model) -> None:
    """Meta buffers of the packed layout for a weights-free load: each group packed from zero codes and unit scales
    of the checkpoint's shapes (from the config; nothing read), then moved to meta."""
    shapes = checkpoint_shapes(model.text_config)
    for name, module in adopted_mixers(model):
        for group in module.w8_target.groups:
            module.w8_set_linear(group.name, pack(group_parts(module, group, shapes, name), f"{name}.{group.name}"), "meta")
