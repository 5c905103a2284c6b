"""docs/nki-interpreter.md table: the kernels' numerics gate under a bounded ScalarE activation error
(``benchmarks/bench_activation_margin.py`` -> ``activation_margin.json``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def _eps(e: float) -> str:
    return "exact" if e == 0 else f"2^{int(round(math.log2(e)))}"


def render(results_dir: Path) -> str:
    data = json.loads((results_dir / "activation_margin.json").read_text())
    eps = data["eps"]
    rows = []
    for key, margin in data["margins"].items():
        case, mode = key.rsplit(" / ", 1)
        cells = {r["eps"]: r for r in data["rows"] if r["case"] == case and r["mode"] == mode}
        rows.append([case, mode] + [f"{cells[e]['err_over_bound']:.2f}" + ("" if cells[e]["passed"] else " (fails)")
                                    for e in eps] + [_eps(margin)])
    m = data["machine"]
    return (markdown_table(["served launch", "error sign"] + [f"err/bound, eps {_eps(e)}" for e in eps] + ["margin"], rows)
            + f"\nThe gate passes below 1 (kernel_check.error_bound: 1.5 x 2^-9 x sum |act| |W2|). Run on {m['cpu_model']}, "
              f"load {m['loadavg_1_5_15'][0]:.2f}.\n")
