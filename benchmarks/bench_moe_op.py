"""One MoE layer on CPU at real shapes: neuron-w8's op (1-byte experts) vs the fastest vLLM CPU kernel for the same
checkpoint on this host.

Side by side in one run, for each token count T:

* ``w8``       -- ``vllm_moe_w8.op.cpu.fused_moe_cpu`` (the op's CPU body, its path under this environment: the
                  exact h by default; run with ``VLLM_MOE_W8_CPU_H=bf16`` to measure the opt-in BF16 h, which the
                  results recorded before it became opt-in used) with the native variant chosen by ``--isa``;
* ``w8_exact`` -- the same kernel with the exact h, where that is another path (i.e. under ``VLLM_MOE_W8_CPU_H=bf16``);
* ``w8_4k``    -- ``w8`` on a copy of the codes left in 4 KiB pages (the op backs the resident codes with 2 MiB pages,
                  :mod:`vllm_moe_w8.op.hugepages`; this column is what that buys), native paths only;
* vLLM's kernels (:mod:`benchmarks.vllm_moe_kernels`): its FP8 W8A16 MoE where vLLM picks it (AMX hosts; elsewhere,
  where its kernel runs all the same, measured as ``vllm_fp8_noamx``: what neuron-w8 runs with
  ``VLLM_MOE_W8_CPU_KERNEL=vllm-fp8``, not counted as the fastest vLLM kernel for the checkpoint), its BF16 MoE with the ISA it picks here (``amx`` or ``vec``) over
  the exactly dequantised experts rounded to BF16 (the BF16 twin), and ``vec`` for continuity.

Protocol: every call gets a fresh random top-k routing and fresh activations (all implementations see the same
ones), so the routed experts' weights come from memory as successive layers of a real model see them; the
implementations alternate call by call (order reversed every repetition); medians of wall and process CPU time.
The OpenMP threads are bound one per CPU, as vLLM's CPU worker binds them before a model runs (``--omp-bind none``:
unbound, files ``-unbound``), so both sides run on the threads and CPUs they would have in ``vllm serve``.
Goals, evaluated per row and recorded: >= 1.0x the fastest vLLM kernel for the checkpoint at every T; >= 1.3x vLLM
BF16 at T <= 8 on hosts without AMX; expert memory <= 0.51x BF16. ``--check`` measures each path's error vs a
float64 reference (BF16 in and out, and float32 in and out for w8's exact path).

Writes ``benchmarks/results/moe_op-[amx-]<isa>[-forced][-<n>thread].json`` (CPU model, flags, load average).

    .venv/bin/python -m benchmarks.bench_moe_op --check
    .venv/bin/python -m benchmarks.bench_moe_op --isa avx2 --tokens 1 8 64    # the AVX2 variant, forced
    .venv/bin/python -m benchmarks.bench_moe_op --threads 1    # one thread each: no thread scheduling in the ratio
    .venv/bin/python -m benchmarks.bench_moe_op --isa avx2 --vllm-build avx2   # an AVX2-only host, emulated

``--vllm-build avx2`` loads vLLM's ``_C_AVX2`` library (the build ``vllm/platforms/cpu.py`` imports on a CPU without
AVX-512) instead of the one this CPU selects, so with ``--isa avx2`` both sides run what an AVX2-only host runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

GOAL_SMALL_T, GOAL_ANY_T, GOAL_SMALL_T_MAX, GOAL_MEMORY = 1.3, 1.0, 8, 0.51
MODELS = {
    # name: (hidden H, moe intermediate I, routed experts E, top-k)
    "qwen35": ("Qwen3.5-35B-A3B", 2048, 512, 256, 8),
    "qwen3": ("Qwen3-30B-A3B", 2048, 768, 128, 8),
    "glm45air": ("GLM-4.5-Air", 4096, 1408, 128, 8),
}
BLOCK = (128, 128)
CHECK_T = 16


def random_experts(e, h, inter, gen):
    """Checkpoint-like e4m3 codes: Gaussian weights quantised so each expert matrix peaks near 240
    (what a pow2 repack of an amax/448-scaled checkpoint gives), and positive scales on a 128x128 grid."""
    def codes(shape):
        out = torch.empty(shape, dtype=torch.uint8)
        for i in range(shape[0]):
            w = torch.randn(shape[1:], generator=gen) * 48.0  # ~5 sigma = 240
            out[i] = w.clamp(-240, 240).to(torch.float8_e4m3fn).view(torch.uint8)
        return out

    w13, w2 = codes((e, 2 * inter, h)), codes((e, h, inter))
    gi, gh = -(-inter // 128), -(-h // 128)
    w13_s = torch.rand((e, 2 * gi, gh), generator=gen) * 1e-4 + 1e-5
    w2_s = torch.rand((e, gh, gi), generator=gen) * 1e-4 + 1e-5
    return w13, w13_s, w2, w2_s


def dequantized_bf16(w13, w13_s, w2, w2_s):
    """The BF16 twin's expert weights (exact fp32 dequantisation, rounded to bf16), one expert at a time."""
    from vllm_moe_w8.op import cpu as cpu_moe

    e, two_i, h = w13.shape
    inter = two_i // 2
    gi = -(-inter // BLOCK[0])
    b13 = torch.empty(w13.shape, dtype=torch.bfloat16)
    b2 = torch.empty(w2.shape, dtype=torch.bfloat16)
    for i in range(e):
        b13[i, :inter] = cpu_moe.dequantize_rows(w13[i, :inter], w13_s[i, :gi], *BLOCK, "e4m3")
        b13[i, inter:] = cpu_moe.dequantize_rows(w13[i, inter:], w13_s[i, gi:], *BLOCK, "e4m3")
        b2[i] = cpu_moe.dequantize_rows(w2[i], w2_s[i], *BLOCK, "e4m3")
    return b13, b2


def fresh_inputs(t, h, e, k, gen):
    """A new routing (softmax top-k of random logits) and new bf16 activations."""
    topk_w, topk_ids = torch.softmax(torch.randn((t, e), generator=gen), -1).topk(k, dim=-1)
    return torch.randn((t, h), generator=gen).to(torch.bfloat16), topk_w, topk_ids.to(torch.int32)


def interleaved(fns: dict, make_inputs, reps: int) -> dict:
    """Per implementation: median wall and CPU seconds over ``reps`` calls, each call with fresh inputs shared
    by all implementations, implementations alternating (order reversed every other repetition)."""
    names = list(fns)
    for fn in fns.values():  # warm-up (page-in, thread pools)
        fn(make_inputs())
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for rep in range(reps):
        inputs = make_inputs()
        for n in (names if rep % 2 == 0 else names[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            fns[n](inputs)
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in names}


def reps_for(t: int, budget: int) -> int:
    return max(7, min(budget, budget * 8 // max(t, 8)))


def rel_err(out, ref) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def measure_errors(fns, w8_exact, h, e, k, gen, experts):
    """Each path's max |out - float64 reference| / max |reference| at T = CHECK_T (BF16 in and out), and w8's
    exact path with float32 in and out; the reference is over the exactly dequantised experts."""
    from vllm_moe_w8.op.reference import reference_moe

    x, tw, ti = fresh_inputs(CHECK_T, h, e, k, gen)
    ref = reference_moe(x, tw, ti, *experts, *BLOCK, "e4m3", dtype=torch.float64)
    errors = {name: rel_err(fn((x, tw, ti)), ref) for name, fn in fns.items()}
    ref32 = reference_moe(x.float(), tw, ti, *experts, *BLOCK, "e4m3", dtype=torch.float64)
    errors["w8_exact (float32 in/out)"] = rel_err(w8_exact((x.float(), tw, ti)), ref32)
    return {"T": CHECK_T, "metric": "max |out - float64 reference| / max |reference|", "errors": errors}


def bench_model(key, tokens, reps, check, vllm_kernels, amx, experts_override=None, seed=0):
    from benchmarks.vllm_moe_kernels import FP8_NOT_PICKED
    from vllm_moe_w8.op import cpu as cpu_moe
    from vllm_moe_w8.op import hugepages

    name, h, inter, e, k = MODELS[key]
    e = experts_override or e
    gen = torch.Generator().manual_seed(seed)
    print(f"  preparing {name} experts (E={e}) ...", flush=True)
    w13, w13_s, w2, w2_s = random_experts(e, h, inter, gen)
    b13, b2 = dequantized_bf16(w13, w13_s, w2, w2_s)
    states = {n: kern.prepare(w13, w13_s, w2, w2_s, b13, b2) for n, kern in vllm_kernels.items()}
    del b13, b2
    w8_bytes = w13.nbytes + w2.nbytes + w13_s.nbytes + w2_s.nbytes
    bf16_bytes = 2 * (w13.numel() + w2.numel())
    impl = cpu_moe.implementation(h, inter, BLOCK[1])
    isa = impl.removeprefix("native-")
    h_default = cpu_moe.h_precision(torch.bfloat16, isa) if impl != "torch" else "exact"
    experts = (w13, w13_s, w2, w2_s)
    fns = {"w8": lambda a: cpu_moe.fused_moe_cpu(a[0], a[1], a[2], *experts, *BLOCK, "e4m3")}
    w8_exact = (lambda a: cpu_moe.fused_moe_native(a[0], a[1], a[2], *experts, *BLOCK, "e4m3", isa=isa, h_mode="exact")
                ) if impl != "torch" else fns["w8"]
    if h_default != "exact":
        fns["w8_exact"] = w8_exact
    if impl != "torch" and hugepages.choice() != "off":  # the same path on codes in 4 KiB pages
        small = (w13.clone(), w2.clone())
        for codes in small:
            hugepages.ensure(codes, mode="off")  # registered as seen: the op leaves these pages alone
        fns["w8_4k"] = lambda a: cpu_moe.fused_moe_cpu(a[0], a[1], a[2], small[0], w13_s, small[1], w2_s, *BLOCK, "e4m3")
        for fn in (fns["w8"], fns["w8_4k"]):  # first touch now (the collapse), not in the warm-up of the timing
            fn(fresh_inputs(1, h, e, k, gen))
    for n, kern in vllm_kernels.items():
        fns[n] = lambda a, kern=kern, st=states[n]: kern.run(a[0], a[1], a[2], st)
    bf16_name = "vllm_bf16_amx" if amx else "vllm_bf16_vec"
    rows = []
    for t in tokens:
        n_calls = reps_for(t, reps)
        timing = interleaved(fns, lambda: fresh_inputs(t, h, e, k, gen), n_calls)
        row = {"model": name, "T": t, "reps": n_calls}
        for impl_name, (wall, cpu) in timing.items():
            row[f"{impl_name}_ms"], row[f"{impl_name}_cpu_ms"] = 1e3 * wall, 1e3 * cpu
        fastest = min((n for n in vllm_kernels if n != FP8_NOT_PICKED), key=lambda n: row[f"{n}_ms"])
        row["fastest_vllm"] = fastest
        for other in vllm_kernels:
            row[f"w8_vs_{other}"] = row[f"{other}_ms"] / row["w8_ms"]  # throughput ratio (> 1: w8 faster)
        row["w8_vs_fastest"] = row[f"{fastest}_ms"] / row["w8_ms"]
        row["w8_vs_fastest_cpu"] = row[f"{fastest}_cpu_ms"] / row["w8_cpu_ms"]
        row["goal_fastest_met"] = row["w8_vs_fastest"] >= GOAL_ANY_T
        if not amx and t <= GOAL_SMALL_T_MAX:
            row["goal_bf16_small_t_met"] = row[f"w8_vs_{bf16_name}"] >= GOAL_SMALL_T
        rows.append(row)
        print(_fmt_row(row, list(vllm_kernels), "w8_exact" in fns, bf16_name), flush=True)
    huge = {**hugepages.status(), "anon_huge_bytes": hugepages.huge_bytes_of_process(),
            "codes_bytes": w13.nbytes + w2.nbytes}
    res = {"model": name, "H": h, "I": inter, "E": e, "top_k": k, "w8_h": h_default, "hugepages": huge,
           "w8_h_reason": cpu_moe.h_reason(torch.bfloat16, isa, h_default) if impl != "torch" else "torch path: exact",
           "resident_bytes": {"w8": w8_bytes, "bf16": bf16_bytes}, "memory_ratio": w8_bytes / bf16_bytes,
           "memory_goal": GOAL_MEMORY, "memory_goal_met": w8_bytes / bf16_bytes <= GOAL_MEMORY, "rows": rows}
    if check:
        res["check"] = measure_errors({n: f for n, f in fns.items()}, w8_exact, h, e, k, gen, experts)
        for n, err in res["check"]["errors"].items():
            print(f"  error vs float64 at T={CHECK_T}: {n}: {err:.2e}")
    return res


def _fmt_row(r, vllm_names, with_exact, bf16_name):
    cells = [r["T"], r["reps"], f"{r['w8_ms']:.2f}"] + ([f"{r['w8_exact_ms']:.2f}"] if with_exact else [])
    cells += [f"{r['w8_4k_ms']:.2f} ({r['w8_4k_ms'] / r['w8_ms']:.2f}x)"] if "w8_4k_ms" in r else []
    cells += [f"{r[f'{n}_ms']:.2f}" for n in vllm_names]
    cells += [f"{r['w8_vs_fastest']:.2f}x ({r['fastest_vllm']})", f"{r['w8_vs_fastest_cpu']:.2f}x",
              f">= 1.0x: {'met' if r['goal_fastest_met'] else 'NOT met'}"]
    if "goal_bf16_small_t_met" in r:
        cells.append(f"{r[f'w8_vs_{bf16_name}']:.2f}x, >= 1.3x: {'met' if r['goal_bf16_small_t_met'] else 'NOT met'}")
    else:
        cells.append("")
    return "| " + " | ".join(str(c) for c in cells) + " |"


BOUND_MARK = "VLLM_MOE_W8_BENCH_BOUND"


def _bind_like_vllm(a) -> None:
    """With ``--omp-bind vllm``, run in a fresh interpreter whose OpenMP threads are bound one per CPU, as vLLM's CPU
    worker binds them before torch starts (its ``VLLM_CPU_OMP_THREADS_BIND=auto``: ``OMP_PLACES`` of single CPUs,
    ``OMP_PROC_BIND=true``, ``OMP_NUM_THREADS``); libgomp reads them once, so this interpreter (torch loaded) re-executes."""
    if a.omp_bind != "vllm" or os.environ.get(BOUND_MARK) == "1":
        return
    import sys

    cpus = sorted(os.sched_getaffinity(0))[: a.threads or torch.get_num_threads()]
    os.environ.update({"OMP_PLACES": ",".join("{%d}" % c for c in cpus), "OMP_PROC_BIND": "true",
                       "OMP_NUM_THREADS": str(len(cpus)), BOUND_MARK: "1"})
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.bench_moe_op", *sys.argv[1:]])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen35"], choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 32, 64, 128, 256, 512])
    ap.add_argument("--reps", type=int, default=30, help="calls per implementation at T <= 8 (fewer, >= 7, above)")
    ap.add_argument("--experts", type=int, default=None, help="override E (default: the model's)")
    ap.add_argument("--isa", default="auto", help="VLLM_MOE_W8_CPU_ISA for w8: auto, avx512bf16, avx2, torch")
    ap.add_argument("--check", action="store_true", help=f"also measure each path's error vs float64 at T={CHECK_T}")
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    ap.add_argument("--vllm-build", default="host", choices=["host", "avx2"],
                    help="vLLM's kernel library: the one this CPU selects, or _C_AVX2 (what an AVX2-only host runs)")
    ap.add_argument("--omp-bind", default="vllm", choices=["vllm", "none"],
                    help="vllm (default): bind each OpenMP thread to one CPU as vLLM's CPU worker does "
                         "(VLLM_CPU_OMP_THREADS_BIND=auto sets OMP_PLACES + OMP_PROC_BIND); none: leave threads unbound")
    a = ap.parse_args(argv)
    _bind_like_vllm(a)
    if a.vllm_build == "avx2":  # vllm.platforms.cpu.import_kernels picks _C_AVX2 where AVX-512 is absent
        torch.cpu._is_avx512_supported = lambda: False
    os.environ["VLLM_MOE_W8_CPU_ISA"] = a.isa
    if a.threads:
        torch.set_num_threads(a.threads)
    from benchmarks import vllm_moe_kernels
    from benchmarks.common import write_json
    from vllm_moe_w8.op import cpu as cpu_moe
    from vllm_moe_w8.op import native as cpu_moe_native

    impl = cpu_moe.implementation(MODELS[a.models[0]][1], MODELS[a.models[0]][2], BLOCK[1])  # builds before timing
    isa = impl.removeprefix("native-")
    forced = a.isa != "auto" and cpu_moe_native.host_isas()[:1] != [a.isa]
    kernels, record = vllm_moe_kernels.kernels(BLOCK)
    amx = record["bf16_isa"] == "amx"
    record["library"] = vllm_moe_kernels.loaded_library() + (" (forced: --vllm-build avx2)" if a.vllm_build == "avx2" else "")
    print(f"vLLM's kernel library: {record['library']}")
    load_start = os.getloadavg()
    print(f"threads={torch.get_num_threads()}  w8 implementation: {impl}{' (forced)' if forced else ''}  "
          f"load average at start: {load_start[0]:.1f}")
    print(f"vLLM here: BF16 isa {record['bf16_isa']} ({record['bf16_isa_reason']}); FP8: {record['fp8']}; "
          f"zentorch: {record['zentorch']}")
    print("ratios are throughput ratios w8 / vLLM, medians of interleaved calls with fresh routings")
    with_exact = impl == "native-avx512bf16" and cpu_moe.h_precision(torch.bfloat16, isa) != "exact"
    head = ["T", "calls", "w8 ms"] + (["w8 exact-h ms"] if with_exact else []) + \
        (["w8 in 4 KiB pages ms (w8 faster by)"] if impl != "torch" else []) + \
        [f"{n} ms" for n in kernels] + ["w8/fastest vLLM (wall)", "(CPU time)", "goal", "w8/vLLM BF16 at T<=8"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    results = {"w8_impl": impl, "isa": isa, "forced": forced, "amx": amx, "vllm": record,
               "kernels": {n: kern.what for n, kern in kernels.items()}, "models": []}
    for key in a.models:
        res = bench_model(key, a.tokens, a.reps, a.check, kernels, amx, a.experts)
        results["models"].append(res)
        print(f"  expert memory {res['model']} (E={res['E']}): w8 / BF16 = {res['memory_ratio']:.3f} "
              f"(goal <= {GOAL_MEMORY}: {'met' if res['memory_goal_met'] else 'NOT met'}); w8 h: {res['w8_h_reason']}")
        unmet = [r["T"] for r in res["rows"] if not r["goal_fastest_met"]]
        small = [r["T"] for r in res["rows"] if r.get("goal_bf16_small_t_met") is False]
        print(f"  goals: >= 1.0x fastest vLLM at every T: {'met' if not unmet else f'NOT met at T={unmet}'}"
              + ("" if amx else f"; >= 1.3x vLLM BF16 at T <= 8: {'met' if not small else f'NOT met at T={small}'}"))
    results["loadavg_at_start"] = list(load_start)
    results["omp_bind"] = {"mode": a.omp_bind, "OMP_PLACES": os.environ.get("OMP_PLACES"),
                           "caller_affinity": sorted(os.sched_getaffinity(0))}
    results["threads_forced"] = a.threads
    variant = (f"{'amx-' if amx else ''}{isa}{'-forced' if forced else ''}{f'-{a.threads}thread' if a.threads else ''}"
               f"{'-vllm_avx2' if a.vllm_build == 'avx2' else ''}{'-unbound' if a.omp_bind == 'none' else ''}")
    write_json(f"moe_op-{variant}", results)


if __name__ == "__main__":
    main()
