"""How much ScalarE approximation error the kernels' numerics gate tolerates (#31, numerics honesty).

ScalarE's activations are "approximated with piece-wise polynomials" on the device (aws-neuron-sdk @81ce03ae
``nki/api/nki.api.shared.rst``); AWS documents no accuracy figure, and the interpreter evaluates them exactly, so every
accuracy figure measured here is a best case. This sweep runs the served launch (``kernel_check.run_case``: the layer
through ``kernel_launch.run_routed_experts`` compiled as vllm-neuron compiles it) with every approximated activation's
result off by a relative ``eps`` (``nki_cpu.perturbed``: ``uniform`` random per element, ``high`` all +eps, a
systematic bias), and records the gate's ``err / bound`` (passes below 1). The largest passing ``eps`` is the margin
the gate keeps; a device whose SiLU / sigmoid error exceeds it fails ``neuron-check`` although the kernel is right -
the first hardware run must measure the activation error (or the gate's bound must carry it).

    .venv/bin/python -m benchmarks.bench_activation_margin     # -> benchmarks/results/activation_margin.json
"""

from __future__ import annotations

import time

from vllm_moe_w8.kernels import nki_cpu
from vllm_moe_w8.neuron_glue import kernel_check as kc

EPS = (0.0, 2.0**-14, 2.0**-12, 2.0**-10, 2.0**-9, 2.0**-8, 2.0**-7, 2.0**-6)
CASES = {  # name: (tokens, top_k, lnc, swiglu_limit): the three schedules of the served launch
    "selective decode T=8": (8, 4, 2, 0.0),
    "dense T=100": (100, 4, 2, 0.0),
    "block prefill T=200": (200, 4, 2, 0.0),
}


def run() -> list[dict]:
    ckpt = kc.checkpoint_experts(4, 256, 256, seed=0)
    rows = []
    for name, (tokens, top_k, lnc, limit) in CASES.items():
        for mode in ("uniform", "high"):
            for eps in EPS:
                t0 = time.perf_counter()
                with nki_cpu.perturbed(eps, mode):
                    r = kc.run_case(name, ckpt, "pow2", tokens, top_k, lnc, seed=tokens, swiglu_limit=limit)
                rows.append({"case": name, "kernel": r.kernel, "mode": mode, "eps": eps, "passed": r.passed,
                             "err_over_bound": r.err_over_bound, "seconds": round(time.perf_counter() - t0, 2)})
                print(f"  {name:26s} {mode:8s} eps 2^{(-1e9 if eps == 0 else __import__('math').log2(eps)):.0f}: "
                      f"{r.err_over_bound:.3f} x bound {'pass' if r.passed else 'FAIL'}", flush=True)
    return rows


def margins(rows: list[dict]) -> dict:
    """Per case and mode: the largest eps that passes with every smaller one passing too."""
    out = {}
    for r in rows:
        key = f"{r['case']} / {r['mode']}"
        if key not in out:
            out[key] = {"margin_eps": 0.0, "broken": False}
        if not r["passed"]:
            out[key]["broken"] = True
        elif not out[key]["broken"]:
            out[key]["margin_eps"] = r["eps"]
    return {k: v["margin_eps"] for k, v in out.items()}


def main() -> int:
    from benchmarks.common import write_json

    rows = run()
    write_json("activation_margin", {"eps": list(EPS), "cases": CASES, "rows": rows, "margins": margins(rows),
                                     "gate": kc.__doc__, "method": __doc__})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
