"""docs/nki-interpreter.md table: each AWS kernel's verdict before and after the interpreter followed AWS's docs rule by
rule (``python -m benchmarks.aws_differential`` -> ``aws_differential_before.json`` / ``aws_differential_after.json``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.readme_tables import markdown_table


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _short(r: dict) -> str:
    detail = r.get("detail", "").split(" [")[0]
    return _cell(detail if len(detail) <= 90 else detail[:87] + "...")


def render(results_dir: Path) -> str:
    before = json.loads((results_dir / "aws_differential_before.json").read_text())
    after = json.loads((results_dir / "aws_differential_after.json").read_text())
    old = {r["id"]: r for r in before["cases"]}
    rows = []
    for r in after["cases"]:
        b = old.get(r["id"], {"verdict": "(not run)"})
        rows.append([f"`{r['id']}`", f"{r['repo'].split('/')[1]} `{'/'.join(r['path'].split('/')[-2:])}` `{r['kernel']}`",
                     f"{b['verdict']}: {_short(b)}" if b["verdict"] != "exact" else "exact",
                     r["verdict"] + ("" if r["verdict"] == "exact" and "worst_over_bound" not in r
                                     else f" ({r['worst_over_bound']:.2g} x bound)" if r["verdict"] == "exact"
                                     else f": {_short(r)}"),
                     _cell(r["bound"])])
    counts = lambda d: ", ".join(f"{v} {k}" for k, v in sorted(d["summary"].items()))  # noqa: E731
    m = after["machine"]
    return (markdown_table(["case", "AWS kernel", f"before (interpreter {before['interpreter_revision']})",
                            f"after (interpreter {after['interpreter_revision']})", "bound"], rows)
            + f"\nBefore: {counts(before)}. After: {counts(after)}. Run on {m['cpu_model']}, load "
              f"{m['loadavg_1_5_15'][0]:.2f}.\n")
