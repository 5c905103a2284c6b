"""One rank of a Neuron-glue run, the same body in both trees, and the two ways ranks are made.

* stand-in tree (CI): ranks are threads of this process with the stand-in's thread process groups;
* real tree: ranks are processes (``tests/_realtree_rank.py``), as vllm-neuron's workers are: torch.distributed
  with gloo, vLLM's and vllm-neuron's process groups made by the real
  ``neuron_parallel_state.initialize_neuron_parallel_state(ep_degree, tp_global_ranks=..., local_rank=...)``
  (its test path), the real ``SafetensorsCheckpoint`` loader on its thread pool.

:func:`rank_body` follows vllm-neuron's runner (upstream ``vllm/worker/neuron_model_runner.py`` @9fc042ea,
``load_model``): the factory's ``from_configs`` under ``torch.device("meta")``, ``load_weights(path, cpu, None)``
(or, for ``lite``, ``load_weights_lite`` + ``.to("meta")``), ``.to(cpu)``, then ``torch.compile(fullgraph=True,
dynamic=False)`` - here of the decoder layers' MoE halves (``_glue_families``), attention being NKI-only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

import _glue_families as fams
import _neuron_standin as st

TESTS = Path(__file__).parent


@dataclass
class Job:
    family: str
    world: int
    ep: bool
    ckpt: str
    cases: list = field(default_factory=list)  # [(name, tokens, decode, seed)]
    compile: bool = False
    second_seed: int = 0  # 0: no second routing; else the cases again with seed + second_seed, no recompile allowed
    lite: bool = False
    additional_config: dict = field(default_factory=dict)
    glue: bool = True
    relax: str = "bind"  # how the size pins are relaxed (_glue_families: "bind", "assign", "keep-key-count")
    precheck: bool = False  # run the platform's start-up check (registration._precheck_config) first, as vLLM does
    layout: str = ""  # "" the family's checkpoint; else the caller wrote ckpt in this tiny_models layout
    extra: str = ""  # "module:function" of tests/ run on the loaded rank: fn(model, family, rank, job) -> results["extra"]


class TestPlatform:
    """The attributes of vllm-neuron's NeuronPlatform that ``registration.install`` extends (tests only)."""

    supported_quantization: list = []

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        pass

    @classmethod
    def verify_quantization(cls, quant) -> None:
        pass


def vllm_config(job: Job, hf):
    """What the glue reads of vLLM's config; ``additional_config["neuron_config"]`` is the family's default (the
    launch its serve line makes) updated with the job's."""
    family = fams.FAMILIES[job.family]
    neuron = dict(family.neuron_config, **(job.additional_config.get("neuron_config") or {}))
    return SimpleNamespace(model_config=SimpleNamespace(quantization="neuron-w8" if job.glue else None, hf_config=hf,
                                                        dtype=torch.bfloat16, model=job.ckpt),
                           parallel_config=SimpleNamespace(tensor_parallel_size=job.world,
                                                           enable_expert_parallel=job.ep),
                           additional_config=dict(job.additional_config, neuron_config=neuron))


def hidden(tokens: int, seed: int, h: int) -> torch.Tensor:
    return (torch.randn(tokens, h, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


class MoeHalves(torch.nn.Module):
    """Every MoE layer's MoE half on the same hidden states, stacked [layers, T, H] (what is compiled)."""

    def __init__(self, family, model):
        super().__init__()
        self.family, self.model = family, model
        self.layers = family.moe_layers(model)

    def forward(self, h, decode: bool, positions):
        return torch.stack([self.family.moe_half(self.model, layer, h, decode, positions) for layer in self.layers])


def _install_glue(job: Job, hf, holder: list):
    from vllm_moe_w8.neuron_glue import registration

    config = vllm_config(job, hf)
    holder.append(config)
    registration.current_vllm_config = lambda: config
    registration.install(TestPlatform)
    if job.precheck:
        TestPlatform.check_and_update_config(config)  # neuron-w8's start-up check runs first, as under vLLM


_SEEN_THREADS: set = set()


def _thread_recorder():
    """Names of the threads ``SafetensorsCheckpoint._get_slice`` runs on (instrumentation: calls through; neuron-w8's
    own wrapper, when it installs one, wraps this one)."""
    from vllm_neuron.utils.checkpoints import SafetensorsCheckpoint

    original = SafetensorsCheckpoint.__dict__["_get_slice"]
    if not getattr(original, "_records_threads", False):
        def _get_slice(self, key):
            _SEEN_THREADS.add(threading.current_thread().name)
            return original(self, key)

        _get_slice._records_threads = True
        SafetensorsCheckpoint._get_slice = _get_slice
    return _SEEN_THREADS


def rank_body(job: Job, rank: int) -> dict:
    """Build, load and run one rank (module docstring); the results the tests judge."""
    family = fams.FAMILIES[job.family]
    ckpt = Path(job.ckpt)
    family.relax(ckpt, job.world, job.relax)
    holder: list = []
    hf = family.config(ckpt)
    if job.glue:
        _install_glue(job, hf, holder)
    factory = getattr(__import__(family.factory[0], fromlist=[family.factory[1]]), family.factory[1])
    nc = fams.neuron_config(family, job.additional_config.get("neuron_config"))
    threads = _thread_recorder()
    threads.clear()
    with torch.device("meta"):
        model = family.build(factory, hf, nc)
    lite_was_the_forks = hasattr(type(model), "load_weights_lite")
    out: dict = {"rank": rank, "bank_classes": [(type(b).__qualname__, type(b).__name__) for b in map(family.bank, family.moe_layers(model))]}
    if job.lite:  # the runner: load_weights_lite when the model has it (neuron-w8 gives it one), then meta
        if hasattr(model, "load_weights_lite"):
            model.load_weights_lite(str(ckpt), torch.device("cpu"), None)
        model = model.to("meta")
    else:
        model.load_weights(str(ckpt), torch.device("cpu"), None)
        model = model.to("cpu")
    out["threads"] = sorted(threads)
    out["caller"] = threading.current_thread().name
    banks = [family.bank(layer) for layer in family.moe_layers(model)]
    if job.glue and job.lite:
        out["lite_buffers"] = [{n: (str(getattr(b, n).device), getattr(b, n).dtype) for n in ("w8_w13", "w8_w2")}
                               for b in banks]
        out["has_own_lite"] = lite_was_the_forks
    if job.glue and not job.lite:
        out["kernel_weights"] = [{n: getattr(b, n) for n in ("w8_w13", "w8_w13_scales", "w8_w2", "w8_w2_scales")} for b in banks]
        out["plans"] = [asdict(b.w8_plan) for b in banks]
        # Qwen3.5's shared expert through the kernels: (layout, its one-expert plan, its own bank's buffers or None)
        out["shared"] = [None if getattr(b, "w8_shared", None) is None else
                         (b.w8_shared.layout, asdict(b.w8_shared.plan),
                          {n: getattr(b, n) for n in ("w8_shared_w13", "w8_shared_w13_scales", "w8_shared_w2",
                                                      "w8_shared_w2_scales")} if b.w8_shared.layout == "bank" else None)
                         for b in banks]
    if job.extra:
        module, fn = job.extra.split(":")
        out["extra"] = getattr(__import__(module), fn)(model, family, rank, job)
    halves = MoeHalves(family, model)
    device = "meta" if job.lite else "cpu"
    size = int(hf.hidden_size if getattr(hf, "hidden_size", None) else hf.text_config.hidden_size)

    def run_cases(fn, seed_offset=0):
        res = {}
        for name, tokens, decode, seed in job.cases:
            x = hidden(tokens, seed + seed_offset, size).to(device)
            if family.sequence_parallel_prefill and not decode:
                x = x.chunk(job.world)[rank]  # the rank's sequence-parallel share; the block all-gathers
            with torch.no_grad():
                res[name] = fn(x, decode, torch.arange(tokens, device=device))
        return res

    if job.compile:
        rec = st.Recorder()
        torch._dynamo.config.cache_size_limit = 2**62
        compiled = torch.compile(halves, backend=rec, fullgraph=True, dynamic=False)
        out["outputs"] = run_cases(compiled)
        out["graphs"] = len(rec.graphs)
        out["kernels"] = [rec.kernels(g) for g in rec.graphs]
        if job.second_seed:
            with torch._dynamo.config.patch(error_on_recompile=True):
                out["outputs_second"] = run_cases(compiled, job.second_seed)
            out["graphs_after_second"] = len(rec.graphs)
    else:
        out["outputs"] = run_cases(halves)
    return out


# ---- stand-in: ranks as threads ------------------------------------------------------------------------------


def parallel_config(job: Job):
    """vLLM's config as vllm-neuron's models read it while they are built (``get_current_vllm_config()``:
    ``parallel_config.enable_expert_parallel`` / ``data_parallel_size``, ``cache_config``)."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig(
        tensor_parallel_size=job.world, enable_expert_parallel=job.ep)))


def run_standin(job: Job) -> list[dict]:
    """The ranks of ``job`` as threads over the stand-in (the caller has put it on sys.path)."""
    state = st.make_groups(job.world, job.ep)

    def one(rank):
        state(rank)
        return rank_body(job, rank)

    with parallel_config(job):  # vLLM's config is process-wide: set once for all rank threads
        return st.run_ranks(job.world, one)


# ---- real tree: ranks as processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_real(job: Job, tree_root: Path, workdir: Path, timeout: float = 1500) -> list[dict]:
    """The ranks of ``job`` as processes over the assembled real tree; their results (tensors included)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "job.json").write_text(json.dumps(asdict(job)))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree_root), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(TESTS / "_realtree_rank.py"), str(workdir), str(rank), str(port)],
                              env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(job.world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    results = []
    for rank, p in enumerate(procs):
        path = workdir / f"rank{rank}.pt"
        if not path.exists():
            raise AssertionError(f"real-tree rank {rank} wrote no results (exit {p.returncode}):\n{logs[rank][-6000:]}")
        res = torch.load(path, weights_only=False)
        if "error" in res:
            raise AssertionError(f"real-tree rank {rank} failed:\n{res['error']}\n--- log tail ---\n{logs[rank][-3000:]}")
        results.append(res)
    return results


def real_rank_main(workdir: Path, rank: int, port: int) -> None:
    """Entry of one real-tree rank process (tests/_realtree_rank.py)."""
    import torch.distributed as dist

    job = Job(**json.loads((workdir / "job.json").read_text()))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=job.world)
        from vllm_neuron.parallel import neuron_parallel_state as ps

        ps.initialize_neuron_parallel_state(ep_degree=job.world if job.ep else 1, tp_global_ranks=list(range(job.world)),
                                            local_rank=rank)
        with parallel_config(job):
            res = rank_body(job, rank)
    except BaseException:  # noqa: BLE001 - reported to the test
        res = {"error": traceback.format_exc()}
    torch.save(res, workdir / f"rank{rank}.pt")
    os._exit(0)  # vLLM's process groups may hang at interpreter exit
