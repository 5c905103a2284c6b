"""``python -m benchmarks.aws_differential <folder> [--json out.json] [--only id,...]``: run every pinned AWS kernel
(or those named) in the interpreter, print one verdict per kernel and write the JSON record."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine_record

from . import case as case_mod
from .cases_fork import CASES as FORK_CASES
from .cases_library import CASES as LIBRARY_CASES
from .cases_sdk import CASES as SDK_CASES

CASES = SDK_CASES + LIBRARY_CASES + FORK_CASES


def summary(records: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for r in records:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return counts


def _revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="local folder of AWS's sources: <repo>@<commit[:7]>/<path>")
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--only", help="comma-separated case ids")
    parser.add_argument("--label", default="", help="a label stored in the record (e.g. before / after)")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if not args.only or c.id in args.only.split(",")]
    records = []
    for c in chosen:
        t0 = time.perf_counter()
        r = case_mod.run(c, args.folder)
        r["seconds"] = round(time.perf_counter() - t0, 2)
        records.append(r)
        print(f"{c.id:34s} {r['verdict']:32s} {r['seconds']:7.1f}s  {r.get('detail', '')[:150]}", flush=True)
    counts = summary(records)
    print("summary:", ", ".join(f"{v}: {n}" for v, n in sorted(counts.items())))
    if args.json:
        record = {"label": args.label, "interpreter_revision": _revision(), "machine": machine_record(),
                  "summary": counts, "cases": records}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
