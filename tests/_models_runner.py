"""Child process for the end-to-end model tests: runs vLLM's ``LLM`` on one or more checkpoints in turn
and writes what the tests judge (prompt logprobs, greedy tokens, errors) to a JSON file.

Run as ``python _models_runner.py ARGS.json OUT.json``. ARGS: {"runs": [{"name", "model", "llm": {...},
"dense_mla": bool, "rope_fix": bool, "moe_isa": "vec", "env": {name: value}}], "prompts": [str], "prompt_sets": [[str]], "max_tokens": int,
"max_model_len": int}.
Every run is independent: a run that fails records its error and the next one still starts. Results are written
after every run, so a child that aborts at shutdown (vLLM's CPU build at TP=2) has already delivered them.

``env`` (optional): environment variables set for that run only (e.g. ``VLLM_MOE_W8_CPU_KERNEL``).
``prompt_sets`` (optional): after ``prompts``, each set is one more ``generate`` call, recorded under ``"sets"``
(prompt logprobs per prompt). With the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the
tests set) every prompt of one call is queued before the first engine step, so each call is scheduled as one batch,
the same way every time. ``"rope_fix": false`` turns vllm_moe_w8.cpu_rope_fix's correction off for that run (the
engine core must be in-process for it to reach the model).

vLLM's CPU kernel choices depend on the CPU (AMX hosts get other kernels), so every run records what vLLM picked
(engine core in this process only): ``"attention_backends"`` (the attention backend classes
``CpuPlatform.get_attn_backend_cls`` returned), ``"attention_isas"`` (``cpu_attn._get_attn_isa``) and ``"moe_isas"``
(the ``isa`` of every ``cpu_fused_moe`` call: vLLM's own unquantised MoE; empty under neuron-w8, whose op is its
own), ``"w8_cpu_kernels"`` (what each neuron-w8 routed-experts call ran: ``"op"``, the plugin's op, or
``"vllm-fp8"``, vLLM's FP8 kernel, vllm_glue/cpu_vllm_fp8.py), ``"w8_cpu_linears"`` (``["vllm-fp8"]`` where a non-expert
FP8 linear ran vLLM's FP8 linear kernel, vllm_glue/cpu_vllm_fp8_linear.py; the dequantised ones are vLLM's own), and ``"routing"``: the expert ids each MoE layer chose for every prompt token in the first ``generate``
call's prefill (vLLM's ``cpu_fused_moe`` and neuron-w8's ``op.cpu.fused_moe_cpu`` record them), and
``"amx_permission"``: whether this process holds the AMX tile permission, and what the plugin's registration did.
``"moe_isa": "vec"`` pins vLLM's unquantised MoE to its portable ``"vec"`` kernel for that run (on AMX hosts vLLM would pick ``X86CPUUnquantizedExperts``, isa ``"amx"``; elsewhere it picks ``"vec"`` anyway): the
architecture-specific experts classes report the device unsupported, so vLLM's own oracle selects
``CPUUnquantizedExperts``. Ask the backend you mean with ``"llm": {"attention_backend": "CPU_MLA"}``.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import traceback

from child_log import excerpt  # tests/ is this script's folder, first on sys.path


def dense_mla(cfg):
    """hf_overrides for GLM-5 on CPU: the same model without the DSA indexer (dense MLA).

    vLLM's CPU build refuses sparse (DSA) attention. While a sequence is no longer than ``index_topk``
    the indexer selects every token, so DSA attention equals dense MLA: the override changes no result
    for the short prompts used here. The indexer's checkpoint tensors are then dropped by vLLM's loader.
    """
    from transformers import DeepseekV3Config

    keep = {k: v for k, v in cfg.to_dict().items()
            if not k.startswith("index") and k not in ("model_type", "transformers_version", "architectures")}
    new = DeepseekV3Config(**keep)
    new.architectures = cfg.architectures
    return new


def _prompt_logprobs(output) -> list[float]:
    """Teacher-forced logprob of each prompt token after the first."""
    ids = output.prompt_token_ids
    out = []
    for pos, entry in enumerate(output.prompt_logprobs):
        if entry is None:
            continue
        out.append(entry[ids[pos]].logprob)
    return out


_picked: dict[str, list] = {"attention_backends": [], "attention_isas": [], "moe_isas": [], "w8_cpu_kernels": [],
                            "w8_cpu_linears": []}
# topk_ids of every routed-experts call in this process (vLLM's cpu_fused_moe and neuron-w8's op), for the routing
# each run chose: the accuracy gate sets aside the positions where two runs routed differently (near-ties).
_routing: list = []


def _record_kernel_choices() -> None:
    """Wrap the three places vLLM's CPU build picks a kernel, to record what it picked (this process only)."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends import cpu_attn

    backend_cls = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, *a, **kw):
        path = backend_cls(cls, *a, **kw)
        _picked["attention_backends"].append(path.rsplit(".", 1)[-1])
        return path

    attn_isa, fused_moe = cpu_attn._get_attn_isa, cpu_moe.cpu_fused_moe

    def get_attn_isa(*a, **kw):
        isa = attn_isa(*a, **kw)
        _picked["attention_isas"].append(isa)
        return isa

    def cpu_fused_moe(*a, **kw):
        _picked["moe_isas"].append(kw["isa"] if "isa" in kw else a[9])
        _routing.append((kw["topk_ids"] if "topk_ids" in kw else a[7]).tolist())
        return fused_moe(*a, **kw)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    cpu_attn._get_attn_isa, cpu_moe.cpu_fused_moe = get_attn_isa, cpu_fused_moe

    from vllm_moe_w8.op import cpu as op_cpu

    w8_op = op_cpu.fused_moe_cpu  # what the plugin's custom op calls on CPU (op/custom_op.py), every implementation

    def fused_moe_cpu(*a, **kw):
        _picked["w8_cpu_kernels"].append("op")
        _routing.append((kw["topk_ids"] if "topk_ids" in kw else a[2]).tolist())
        return w8_op(*a, **kw)

    op_cpu.fused_moe_cpu = fused_moe_cpu

    from vllm_moe_w8.vllm_glue import cpu_vllm_fp8

    fp8_forward = cpu_vllm_fp8.forward  # the MoE method's path where it runs vLLM's FP8 kernel (cpu_vllm_fp8.decide)

    def vllm_fp8_forward(*a, **kw):
        _picked["w8_cpu_kernels"].append("vllm-fp8")
        _routing.append((kw["topk_ids"] if "topk_ids" in kw else a[2]).tolist())
        return fp8_forward(*a, **kw)

    cpu_vllm_fp8.forward = vllm_fp8_forward

    from vllm_moe_w8.vllm_glue import cpu_vllm_fp8_linear

    linear_forward = cpu_vllm_fp8_linear.forward  # a non-expert FP8 linear kept at 1 byte for vLLM's FP8 linear kernel

    def vllm_fp8_linear_forward(*a, **kw):
        _picked["w8_cpu_linears"].append("vllm-fp8")
        return linear_forward(*a, **kw)

    cpu_vllm_fp8_linear.forward = vllm_fp8_linear_forward


def _prefill_routing(prompt_lens: list[int]) -> list:
    """The routing of the first ``generate`` call's prefill: the calls whose rows are all the prompts' tokens (one
    batch, one call per MoE layer, in layer order); each a [tokens, k] list of expert ids."""
    rows = sum(prompt_lens)
    return [ids for ids in _routing if len(ids) == rows]


def _pin_moe_isa(isa: str | None):
    """``"vec"``: vLLM's arch-specific unquantised experts (x86 AMX, Arm, Power) report the device unsupported."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    classes = (cpu_moe.X86CPUUnquantizedExperts, cpu_moe.ArmCPUUnquantizedExperts, cpu_moe.PowerCPUUnquantizedExperts)
    if isa is None:
        return []
    if isa != "vec":
        raise ValueError(f"moe_isa {isa!r}: only 'vec' can be pinned")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise ValueError("moe_isa needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    saved = [(c, c.__dict__["_supports_current_device"]) for c in classes]
    for c in classes:
        c._supports_current_device = staticmethod(lambda: False)
    return saved


def _amx_permission() -> dict:
    """This process's AMX tile permission as the kernel reports it (``ARCH_GET_XCOMP_PERM``), and what the plugin's
    registration did about it (``install()`` runs once per process: here it only returns its first answer)."""
    from vllm_moe_w8.vllm_glue import cpu_amx_permission as amx

    return {"held": amx.permitted(), "install": amx.install()}


def run(args: dict, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    _record_kernel_choices()
    results = {}
    for spec in args["runs"]:
        kwargs = dict(max_model_len=args.get("max_model_len", 128), enforce_eager=True,
                      gpu_memory_utilization=0.05, seed=0)
        kwargs.update(spec.get("llm", {}))
        if spec.get("dense_mla"):
            kwargs["hf_overrides"] = dense_mla
        entry: dict = {}
        llm = None
        from vllm_moe_w8.vllm_glue import cpu_rope_fix

        cpu_rope_fix.enabled = spec.get("rope_fix", True)
        for picks in _picked.values():
            picks.clear()
        from vllm.v1.attention import selector

        selector._cached_get_attn_backend.cache_clear()  # each run asks the platform again (so it is recorded)
        pinned = []
        saved_env = {key: os.environ.get(key) for key in spec.get("env", {})}
        os.environ.update(spec.get("env", {}))
        try:
            pinned = _pin_moe_isa(spec.get("moe_isa"))
            llm = LLM(model=spec["model"], **kwargs)
            params = SamplingParams(max_tokens=args.get("max_tokens", 4), temperature=0.0, prompt_logprobs=0, logprobs=0)
            _routing.clear()
            outs = llm.generate(args["prompts"], params)
            entry["prompt_logprobs"] = [_prompt_logprobs(o) for o in outs]
            entry["prompt_lens"] = [len(o.prompt_token_ids) for o in outs]
            entry["routing"] = _prefill_routing(entry["prompt_lens"])
            entry["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            entry["text"] = [o.outputs[0].text for o in outs]
            entry["finite"] = all(math.isfinite(v) for row in entry["prompt_logprobs"] for v in row)
            entry["sets"] = [[_prompt_logprobs(o) for o in llm.generate(prompts, params)]
                             for prompts in args.get("prompt_sets", [])]
        except Exception as exc:  # recorded for the test to report
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = excerpt(traceback.format_exc(), 3000)  # the root cause kept, not only the tail
        for cls, original in pinned:
            cls._supports_current_device = original
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        entry.update({key: sorted(set(picks)) for key, picks in _picked.items()})
        entry["amx_permission"] = _amx_permission()
        results[spec["name"]] = entry
        with open(out_path, "w") as f:
            json.dump(results, f)
        del llm
        gc.collect()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run(json.load(f), sys.argv[2])
