"""Test helpers for the Neuron glue: the vllm-neuron stand-in on sys.path, rank loops, the fp32 reference.

The stand-in (tests/neuron_standin/, see its README) reproduces only the vllm-neuron signatures the glue
uses; it is not vllm-neuron. Ranks of a TP/EP group run as threads of this process (its groups exchange
tensors through a barrier, in traceable custom ops), each building, loading and compiling the model as
vllm-neuron's runner does (``vllm_neuron.vllm.worker.neuron_model_runner.load_model``). The NKI interpreter runs
one kernel at a time (``neuron_glue.interpreter_hop``).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from vllm_moe_w8 import tiny_models

STANDIN = Path(__file__).parent / "neuron_standin"


def put_standin_on_path() -> None:
    if str(STANDIN) not in sys.path:
        sys.path.insert(0, str(STANDIN))


def drop_standin() -> None:
    for name in [m for m in sys.modules if m == "vllm_neuron" or m.startswith("vllm_neuron.")]:
        del sys.modules[name]
    if str(STANDIN) in sys.path:
        sys.path.remove(str(STANDIN))


def glue_fixture(monkeypatch, install: bool = True):
    """Body of the Neuron-glue tests' fixture (a generator: ``yield from``): the stand-in on sys.path, neuron-w8's
    ``current_vllm_config`` answered from the yielded holder (``holder["config"]``, set by the test), the Neuron
    registration installed on the stand-in platform unless ``install=False``; the stand-in dropped afterwards."""
    put_standin_on_path()
    from vllm_moe_w8.neuron_glue import registration

    from vllm.config import VllmConfig, set_current_vllm_config

    holder: dict = {}
    monkeypatch.setattr(registration, "current_vllm_config", lambda: holder["config"])
    if install:
        from vllm_neuron.vllm.platform import NeuronPlatform

        registration.install(NeuronPlatform)
    try:
        # vLLM's config as the models read it while built (upstream Qwen3MoeExperts: enable_expert_parallel);
        # make_groups sets its parallel sizes; process-wide, so shared by the rank threads
        with set_current_vllm_config(VllmConfig()):
            yield holder
    finally:
        drop_standin()


class Recorder:
    """A torch.compile backend that keeps every graph it is given and runs it eagerly."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    @staticmethod
    def launch_nodes(gm) -> list:
        """The graph's opaque kernel-launch nodes (``moe_w8::nki_interpreted``)."""
        op = torch.ops.moe_w8.nki_interpreted
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (op, op.default)]

    def launches(self, gm) -> int:
        return len(self.launch_nodes(gm))

    def kernels(self, gm) -> list[str]:
        """The kernel launched by each opaque launch node of a graph (the op's first argument)."""
        return [n.args[0] for n in self.launch_nodes(gm)]


def compiled_glue_fixture(monkeypatch):
    """:func:`glue_fixture` for tests that compile the stand-in's model: dynamo's caches reset before and after."""
    torch._dynamo.reset()
    try:
        yield from glue_fixture(monkeypatch)
    finally:
        torch._dynamo.reset()


def as_namespace(d):
    if isinstance(d, dict):
        return SimpleNamespace(**{k: as_namespace(v) for k, v in d.items()})
    return d


PRETRAINED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "glm5_next")  # configs whose vllm-neuron reader needs what transformers makes of them


def hf_config(path: Path):
    """config.json as attributes (quantization_config stays a dict, as transformers keeps it). Qwen3.5-MoE's is
    transformers' own ``PretrainedConfig`` (AutoConfig), as vLLM hands it: the fork's ``Qwen3_5TextConfig.from_hf``
    reads ``rope_parameters`` as a dict (whn09 qwen3_5/config.py @3de9ea3), and GLM-5.3-Flash's
    ``Glm5NextConfig.from_configs`` takes a PretrainedConfig, a dict or a path, nothing else (glm5_next/config.py)."""
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") in PRETRAINED_MODEL_TYPES:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path))
    cfg = as_namespace(raw)
    cfg.quantization_config = raw.get("quantization_config")
    return cfg


def vllm_config(path: Path, quantization="neuron-w8", additional_config=None):
    return SimpleNamespace(
        model_config=SimpleNamespace(quantization=quantization, hf_config=hf_config(path), dtype=torch.bfloat16),
        additional_config=additional_config or {},
    )


def run_ranks(world: int, fn):
    """Run ``fn(rank)`` on ``world`` threads; return the results by rank (re-raising the first error)."""
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            for b in barriers:
                b.abort()

    barriers = list(_barriers)
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _barriers.clear()
    if errors:
        raise errors[0]
    return results


_barriers: list = []


def make_groups(world: int, ep: bool):
    """Per-rank state for a world of ``world`` ranks: TP over all of them, or EP = world with TP 1 inside."""
    from vllm.config import get_current_vllm_config_or_none

    from vllm_neuron.parallel import neuron_parallel_state as ps

    current = get_current_vllm_config_or_none()
    if current is not None:  # what vllm-neuron's models read from vLLM's config
        current.parallel_config.tensor_parallel_size = world
        current.parallel_config.enable_expert_parallel = ep
    tp = ps.ThreadGroup(world)
    _barriers.append(tp.barrier)

    def state(rank):
        tp_group = ps.GroupCoordinator(tp, rank)
        if ep:
            ps.set_rank_state(tp_group, ep_degree=world, ep_rank=rank, ep_tp_group=ps.single())
        else:
            ps.set_rank_state(tp_group)

    return state


# ---- the independent fp32 reference (checkpoint values via torch's float8 conversion) -----------------


def checkpoint_tensors(path: Path) -> dict:
    from vllm_moe_w8.tiny_models.shards import load_all

    return load_all(path)


def dequant(t: dict, name: str) -> torch.Tensor:
    """A checkpoint FP8 weight, exactly dequantised in fp32 (tiny_models.dequantize_exact: torch's float8 cast)."""
    scale = t.get(name + "_scale_inv")
    if scale is not None:
        return tiny_models.dequantize_exact(t[name], scale, (128, 128))
    return tiny_models.dequantize_exact(t[name], t[name + "_scale"], None)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = (1.0 + weight.float()) if zero_centred else weight.float()
    return (x * w).to(h.dtype)


def reference_routed(x: torch.Tensor, t: dict, prefix: str, num_experts: int, top_k: int, renormalize: bool = True,
                     real: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j w_j * down_e(silu(gate_e x) * up_e x), float64, over the top-k of softmax(router x)."""
    xf = x.double()
    router = t[f"{prefix}.mlp.gate.weight"].double()
    probs = torch.softmax(x.float() @ router.float().T, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in range(num_experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        g = dequant(t, f"{prefix}.mlp.experts.{e}.gate_proj.weight").double()
        u = dequant(t, f"{prefix}.mlp.experts.{e}.up_proj.weight").double()
        d = dequant(t, f"{prefix}.mlp.experts.{e}.down_proj.weight").double()
        xe = xf[rows]
        h = torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)
        out.index_add_(0, rows, (h @ d.T) * w[rows, slots].double()[:, None])
    if real is not None:
        out[~real] = 0
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


# ---- checkpoints as the real loader may meet them; the independent dequantisation of non-expert weights -----


def scales_in_later_shard(src: Path, dst: Path) -> Path:
    """A copy of checkpoint ``src`` whose every FP8 scale sits in a shard after the one holding its weight
    (shard 1: everything but the scales; shard 2: the scales), with its index; other files copied."""
    import shutil

    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors = checkpoint_tensors(src)
    scales = {k: v.contiguous() for k, v in tensors.items() if k.endswith(("_scale_inv", "_scale"))}
    rest = {k: v.contiguous() for k, v in tensors.items() if k not in scales}
    files = {"model-00001-of-00002.safetensors": rest, "model-00002-of-00002.safetensors": scales}
    weight_map = {}
    for name, part in files.items():
        save_file(part, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def ml_dtypes_dequant(codes: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """E4M3FN bytes decoded by ml_dtypes times their 128x128 block scale, one fp32 product each (numpy)."""
    import ml_dtypes
    import numpy as np

    values = codes.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = scale.float().numpy()
    s_el = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: values.shape[0], : values.shape[1]]
    return torch.from_numpy(values * s_el.astype(np.float32))


def non_expert_mismatches(model, tensors: dict, pairs) -> list[str]:
    """The gate on non-expert FP8 weights: for each (parameter name, checkpoint weight name, transposed), the
    parameter must equal the independent dequantisation rounded once to the parameter's dtype. Returns the
    parameters that do not (empty: all exact)."""
    params = dict(model.named_parameters())
    bad = []
    for pname, wname, transposed in pairs:
        want = ml_dtypes_dequant(tensors[wname], tensors[wname + "_scale_inv"])
        want = (want.T if transposed else want).to(params[pname].dtype)
        got = params[pname].detach().cpu()
        if got.shape != want.shape or not torch.equal(got, want[: got.shape[0], : got.shape[1]]):
            bad.append(pname)
    return bad


# ---- the two families through the runner, and their float64 references ----------------------------------

FAMILIES = {  # one layer each: the compile tests trace whole models (per-layer loading is tested with two layers)
    "qwen3_moe": dict(arch="Qwen3MoeForCausalLM", factory=("vllm_neuron.model.qwen3_moe", "Qwen3MoeForCausalLM"),
                      prefix="model.layers", zero_centred=False,
                      sizes=dict(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                                 num_hidden_layers=1)),
    "qwen3_5_moe": dict(arch="Qwen3_5MoeForConditionalGeneration",
                        factory=("vllm_neuron.model.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
                        prefix="model.language_model.layers", zero_centred=True,
                        sizes=dict(hidden_size=256, moe_intermediate_size=256, shared_intermediate_size=256,
                                   num_experts=8, num_experts_per_tok=2, num_hidden_layers=1)),
}


def write_family_checkpoint(family: str, path: Path) -> Path:
    from vllm_moe_w8 import tiny_models

    f = FAMILIES[family]
    return tiny_models.write_checkpoint(path, f["arch"], **f["sizes"])


def reference_layer(family: str, t: dict, layer: int, hidden: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference of one layer's MoE block output (Qwen3.5: routed + gated shared expert)."""
    f = FAMILIES[family]
    prefix = f"{f['prefix']}.{layer}"
    x = rms_norm(hidden, t[f"{prefix}.post_attention_layernorm.weight"], 1e-6, zero_centred=f["zero_centred"])
    sizes = f["sizes"]
    out = reference_routed(x, t, prefix, sizes["num_experts"], sizes["num_experts_per_tok"], real=real)
    if family == "qwen3_5_moe":
        xd = x.double()
        g, u, d = (dequant(t, f"{prefix}.mlp.shared_expert.{p}_proj.weight").double() for p in ("gate", "up", "down"))
        gate = torch.sigmoid(xd @ t[f"{prefix}.mlp.shared_expert_gate.weight"].double().T)
        out = out + (torch.nn.functional.silu(xd @ g.T) * (xd @ u.T)) @ d.T * gate
    return out
