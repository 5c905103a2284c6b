"""End to end on vLLM's CPU build: a small real-width FP8 MoE served with neuron-w8 vs its BF16 twin.

The model (written once by vllm_moe_w8.tiny_models, cached in --dir): Qwen3-MoE layout, hidden 2048,
moe_intermediate 512 (Qwen3.5-35B-A3B's expert width), top-8, a few layers, 64 experts by default (the real
256 only multiplies the memory; pass --experts 256 if the machine has room). Five variants by default (a sixth on request), each
served in its own process, one after the other:

* ``w8``        -- the FP8 checkpoint with ``quantization="neuron-w8"`` (experts repacked at load time);
* ``w8-conv``   -- the same checkpoint pre-converted by ``vllm-moe-w8 convert`` (no conversion work at load);
* ``w8-vllmfp8`` -- ``w8`` with ``VLLM_MOE_W8_CPU_KERNEL=vllm-fp8``: the routed experts on vLLM's own FP8 W8A16 kernel
                   (vllm_glue/cpu_vllm_fp8.py; what ``auto`` picks on AMX hosts), here whatever the CPU;
* ``w8-vllmfp8-linear`` -- ``w8-vllmfp8`` with ``VLLM_MOE_W8_CPU_LINEAR=vllm-fp8`` too: the other FP8 layers at 1 byte
                   on vLLM's FP8 W8A16 linear kernel (vllm_glue/cpu_vllm_fp8_linear.py): both choices ``auto`` makes on
                   AMX hosts where the layouts fit (not in the default list: run it with ``--variants``);
* ``bf16-twin`` -- the exactly dequantised BF16 twin, unquantised (what vLLM serves without the plugin here);
* ``vllm-fp8``  -- the same FP8 checkpoint with vLLM's own ``quantization="fp8"`` (no plugin). vLLM 0.32's CPU FP8
                   linear and MoE kernels need Intel AMX; where it cannot start, the JSON records why (the error it
                   stops with) and the other variants run on.

Reported: start-up (``LLM(...)`` wall time) and the plugin's own repack seconds, routed-expert bytes
resident (from the plugin's summary line; the twin's from its tensors), the process tree's RSS after
load, and generation tokens/s at batch 1, 8, 32 (greedy, ``ignore_eos``, --max-tokens new tokens per
sequence); the variants alternate over ``--repeats`` rounds and medians are reported. The goal -- neuron-w8 at least the twin's tokens/s at every batch -- is evaluated and recorded.
Table on stdout, JSON (with CPU model, ISA flags, load average) in ``benchmarks/results/e2e-<isa>.json``, named by
the instruction set of the native CPU MoE kernel that served (``--isa`` forces one).

    .venv/bin/python -m benchmarks.bench_e2e                      # ~10 min on 2 cores
    .venv/bin/python -m benchmarks.bench_e2e --layers 2 --batches 1 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

GOAL_VS_TWIN = 1.0  # neuron-w8 tokens/s / the BF16 twin's, at every batch

RUNNER = textwrap.dedent(
    """
    import json, os, sys, time
    if __name__ == "__main__":
        a = json.loads(sys.argv[1])
        import psutil
        from vllm import LLM, SamplingParams
        t0 = time.perf_counter()
        llm = LLM(model=a["model"], max_model_len=512, dtype="bfloat16", enforce_eager=a["eager"],
                  max_num_seqs=max(a["batches"]), seed=0, **a["llm"])
        startup = time.perf_counter() - t0
        me = psutil.Process()
        rss = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
        res = {"startup_s": startup, "rss_after_load_bytes": rss, "tokens_per_s": {}}
        llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        for b in a["batches"]:
            prompts = [" ".join(words[(i + j) % len(words)] for j in range(8)) for i in range(b)]
            sp = SamplingParams(max_tokens=a["max_tokens"], temperature=0, ignore_eos=True)
            t1 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t1
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            res["tokens_per_s"][str(b)] = n / dt
        print("RESULT " + json.dumps(res), flush=True)
    """
)


def make_models(root: Path, a) -> dict[str, Path]:
    from vllm_moe_w8 import tiny_models
    from vllm_moe_w8.tools.convert import convert_checkpoint

    tag = f"qwen3moe-h{a.hidden}-i{a.inter}-e{a.experts}-k{a.top_k}-l{a.layers}"
    src, twin, conv = root / f"{tag}-fp8", root / f"{tag}-bf16-twin", root / f"{tag}-w8-converted"
    if not (src / "config.json").exists():
        print(f"writing {src} ...", flush=True)
        tiny_models.write_checkpoint(
            src, "qwen3-moe", fmt="block", hidden_size=a.hidden, moe_intermediate_size=a.inter, num_experts=a.experts,
            num_experts_per_tok=a.top_k, num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=4,
            head_dim=128, num_shards=max(2, a.layers),
        )
    if not (twin / "config.json").exists():
        print(f"writing {twin} ...", flush=True)
        tiny_models.write_twin(src, twin, dtype=__import__("torch").bfloat16)
    if not (conv / "config.json").exists():
        print(f"converting to {conv} ...", flush=True)
        summary = convert_checkpoint(src, conv, mode="pow2", progress=False)
        if not summary.get("ok", True):
            raise SystemExit(f"convert failed: {summary.get('message')}")
    return {"w8": src, "w8-conv": conv, "w8-vllmfp8": src, "w8-vllmfp8-linear": src, "bf16-twin": twin, "vllm-fp8": src}


def expert_bytes_in(ckpt: Path) -> int:
    """Bytes of the routed experts' weights (and scales) stored in a checkpoint."""
    from safetensors import safe_open

    total = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if ".mlp.experts." in name:
                    t = st.get_slice(name)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    total += n * {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1}.get(t.get_dtype(), 4)
    return total


ERROR_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR [\d-]+ [\d:]+ \[[^\]]+\] )?((?:ValueError|RuntimeError|NotImplementedError|"
                        r"AssertionError|TypeError): .*)$")
LOG_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:\w+ [\d-]+ [\d:]+ \[[^\]]+\] )?")


def start_failure(log: str) -> str:
    """The first error a vLLM start-up stopped with (and the reason lines right after it), without log prefixes."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = ERROR_LINE.match(line)
        if m:
            more = [LOG_PREFIX.sub("", ln).strip() for ln in lines[i + 1:i + 3]]
            more = [t for t in more if t and not t.startswith(("Traceback", "File ", "[shutdown]"))]
            return " ".join([m.group(1).strip(), *more])
    return "no error line found in the log"


def run_variant(name: str, model: Path, a, tmp: Path) -> dict:
    llm_kwargs = {"quantization": "neuron-w8"} if name.startswith("w8") else ({"quantization": "fp8"} if name == "vllm-fp8" else {})
    script = tmp / "bench_e2e_runner.py"
    script.write_text(RUNNER)
    payload = {"model": str(model), "llm": llm_kwargs, "eager": not a.compile, "batches": a.batches, "max_tokens": a.max_tokens}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(a.kv_gb), VLLM_MOE_W8_AUTO="0",
               VLLM_MOE_W8_CPU_KERNEL="vllm-fp8" if name.startswith("w8-vllmfp8") else os.environ.get("VLLM_MOE_W8_CPU_KERNEL", "auto"),
               VLLM_MOE_W8_CPU_LINEAR="vllm-fp8" if name == "w8-vllmfp8-linear" else os.environ.get("VLLM_MOE_W8_CPU_LINEAR", "auto"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), json.dumps(payload)], capture_output=True, text=True,
                          timeout=3600, env=env)
    log = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines and name == "vllm-fp8":  # vLLM's own FP8 path may not exist on this CPU: record why
        return {"started": False, "exit": proc.returncode, "reason": start_failure(log), "process_s": time.perf_counter() - t0}
    if not lines:
        raise SystemExit(f"{name}: no result (exit {proc.returncode}):\n{log[-5000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_s"] = time.perf_counter() - t0
    m = re.search(r"expert bytes ([\d.]+) MB before -> ([\d.]+) MB after.*?repack ([\d.]+) s", log)
    if m:
        res["expert_bytes"] = float(m.group(2)) * 1e6
        res["repack_s"] = float(m.group(3))
    else:
        res["expert_bytes"] = expert_bytes_in(model)
        res["repack_s"] = 0.0
    native = re.search(r"neuron-w8 CPU MoE: native kernel, instruction set (\w+)", log)
    fallback = re.search(r"neuron-w8 CPU MoE: torch implementation", log)
    res["w8_cpu_impl"] = f"native-{native.group(1)}" if native else ("torch" if fallback else None)
    return res


def median_of(runs: list[dict], batches: list[int]) -> dict:
    """Median start-up and tokens/s per batch over rounds of one variant."""
    return {"startup_s": statistics.median(r["startup_s"] for r in runs),
            "tokens_per_s": {str(b): statistics.median(r["tokens_per_s"][str(b)] for r in runs) for b in batches}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(os.path.expanduser("~/.cache/vllm-moe-w8/bench-e2e")))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GB)")
    ap.add_argument("--compile", action="store_true", help="vLLM's default torch.compile instead of enforce_eager")
    ap.add_argument("--variants", nargs="+", default=["w8", "w8-conv", "w8-vllmfp8", "bf16-twin", "vllm-fp8"])
    ap.add_argument("--repeats", type=int, default=2, help="rounds of all variants, alternating; medians reported")
    ap.add_argument("--isa", default="auto", help="VLLM_MOE_W8_CPU_ISA for the served w8 variants")
    a = ap.parse_args(argv)
    os.environ["VLLM_MOE_W8_CPU_ISA"] = a.isa
    a.dir.mkdir(parents=True, exist_ok=True)
    models = make_models(a.dir, a)
    results = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "variants": {}}
    runs: dict[str, list[dict]] = {name: [] for name in a.variants}
    for rep in range(a.repeats):  # variants alternate (order reversed every other round): load drift hits all alike
        for name in (a.variants if rep % 2 == 0 else a.variants[::-1]):
            if runs[name] and runs[name][-1].get("started") is False:
                continue  # it could not start: once is the record
            print(f"running {name} (round {rep + 1}/{a.repeats}) ...", flush=True)
            runs[name].append(run_variant(name, models[name], a, a.dir))
            print(f"  {name}: {json.dumps(runs[name][-1])}", flush=True)
    not_started = {}
    for name, rs in runs.items():
        if rs and rs[-1].get("started") is False:
            not_started[name] = rs[-1]
            print(f"{name}: did not start: {rs[-1]['reason']}")
            continue
        results["variants"][name] = {**rs[-1], **median_of(rs, a.batches), "runs": rs}
    results["not_started"] = not_started
    v = results["variants"]
    base = v.get("bf16-twin")
    print(f"\nmodel: Qwen3-MoE layout, {a.layers} layers, H {a.hidden}, I {a.inter}, E {a.experts}, top-{a.top_k}; "
          f"{'torch.compile' if a.compile else 'enforce_eager'}; {a.max_tokens} new tokens per sequence")
    cols = ["variant", "start-up s", "repack s"] + [f"tok/s b={b}" for b in a.batches] + ["expert MB", "RSS MB"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for name, r in v.items():
        cells = [name, f"{r['startup_s']:.1f}", f"{r['repack_s']:.2f}"]
        for b in a.batches:
            tps = r["tokens_per_s"][str(b)]
            ratio = f" ({tps / base['tokens_per_s'][str(b)]:.2f}x)" if base and name != "bf16-twin" else ""
            cells.append(f"{tps:.1f}{ratio}")
        cells += [f"{r['expert_bytes'] / 1e6:.0f}" + (f" ({r['expert_bytes'] / base['expert_bytes']:.2f}x)" if base and name != "bf16-twin" else ""),
                  f"{r['rss_after_load_bytes'] / 1e6:.0f}"]
        print("| " + " | ".join(cells) + " |")
    if base and "w8" in v:
        w8 = v["w8"]
        print(f"repack share of w8 start-up: {w8['repack_s'] / w8['startup_s']:.1%}; "
              f"w8 start-up / twin start-up: {w8['startup_s'] / base['startup_s']:.2f}")
    if base:
        for name, r in v.items():
            if name != "bf16-twin":
                r["vs_twin"] = {b: r["tokens_per_s"][str(b)] / base["tokens_per_s"][str(b)] for b in a.batches}
                r["goal_met"] = {b: ratio >= GOAL_VS_TWIN for b, ratio in r["vs_twin"].items()}
                r["expert_bytes_vs_twin"] = r["expert_bytes"] / base["expert_bytes"]
    impls = {r.get("w8_cpu_impl") for name, r in v.items() if name != "bf16-twin"} - {None}
    isa = impls.pop().removeprefix("native-") if len(impls) == 1 else "mixed"
    forced = a.isa != "auto"
    from benchmarks.common import write_json

    write_json(f"e2e-{isa}{'-forced' if forced else ''}", {**results, "goal_vs_twin": GOAL_VS_TWIN, "forced": forced})

if __name__ == "__main__":
    main()
