"""The ``vllm-moe-w8`` command: inspect, plan, convert, demo, configs, neuron-check.

Thin: argument parsing only; each sub-command lives in its own module, imported when it runs (so
``vllm-moe-w8 plan`` does not even import torch). Exit code 0 only on success; 1 when the input is
bad or the work failed (the message names the file/tensor/setting); 2 for usage errors (argparse).
Every report takes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_moe_w8.about import __version__

MODES = ("pow2", "output-block", "lut")  # mirrors vllm_moe_w8.codec.fp8.MODES without importing torch


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_inspect(args) -> int:
    from vllm_moe_w8.tools.inspect_ckpt import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.checkpoint, scan=args.scan, progress=not args.json and not args.quiet)
    _print_json(report) if args.json else print(format_report(report))
    return 0 if not report["errors"] else 1


def cmd_plan(args) -> int:
    from vllm_moe_w8.tools.plan import PlanError, format_plan, make_plan, resolve_config

    try:
        config, source = resolve_config(args.target, args.config)
        report = make_plan(config, tp=args.tp, ep=args.ep, dp=args.dp, hbm_gb=args.hbm_gb, max_model_len=args.max_model_len,
                           mode=args.mode, kv_dtype_bytes=1 if args.kv_cache_dtype == "fp8" else 2,
                           utilization=args.utilization, source=source, ep_size=args.ep_size, lnc=args.lnc,
                           decode_batch=args.decode_batch)
    except PlanError as e:
        _fail(args, str(e))
        return 1
    _print_json(report) if args.json else print(format_plan(report))
    return 0 if not report["errors"] else 1


def cmd_convert(args) -> int:
    from vllm_moe_w8.tools.convert import convert_checkpoint

    report = convert_checkpoint(args.checkpoint, args.out, mode=args.mode, tp=args.tp, ep=args.ep, force=args.force,
                                progress=not args.json and not args.quiet)
    if args.json:
        _print_json(report)
    elif report["ok"]:
        print(report["message"])
    else:
        for e in report["errors"]:
            print(f"error: {e}", file=sys.stderr)
    return 0 if report["ok"] else 1


def cmd_demo(args) -> int:
    from vllm_moe_w8.tools.demo import run_demo

    return run_demo(directory=args.dir, prompt=args.prompt, timeout=args.timeout, max_tokens=args.max_tokens,
                    json_out=args.json, mode=args.mode, keep_log=args.keep_log)


def cmd_neuron_check(args) -> int:
    from vllm_moe_w8.neuron_glue.neuron_check import run

    return run(lnc=args.lnc, experts=args.experts, json_path=args.json_out, device=args.device)


def cmd_configs(args) -> int:
    from vllm_moe_w8.tools.plan import load_model_entry, packaged_configs

    rows = []
    for stem in packaged_configs():
        e = load_model_entry(stem)
        rows.append({"file": stem, "name": e.get("name"), "architecture": (e["config"].get("architectures") or ["?"])[0],
                     "recommended": e.get("recommended", {})})
    if args.json:
        _print_json(rows)
    else:
        for r in rows:
            rec = r["recommended"]
            dp = rec.get("dp", 1)
            split = f"TP={rec.get('tp')}" + (f" x DP={dp}" if dp > 1 else "") + (f", EP={rec.get('tp') * dp}" if rec.get("ep") else "")
            print(f"{r['file']:20s} {r['name']:18s} {r['architecture']:36s} {rec.get('instance', '')}, {split}, {rec.get('mode', '')}")
    return 0


def _fail(args, message: str) -> None:
    if getattr(args, "json", False):
        _print_json({"ok": False, "errors": [message]})
    else:
        print(f"error: {message}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-moe-w8",
        description="Serve FP8 MoE checkpoints with 1-byte experts (neuron-w8): inspect, plan, convert, demo.",
    )
    p.add_argument("--version", action="version", version=f"vllm-moe-w8 {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("inspect", help="report a checkpoint's architecture, format and shapes; validate it")
    s.add_argument("checkpoint", help="checkpoint folder (config.json + *.safetensors)")
    s.add_argument("--scan", action="store_true", help="read every expert tensor: per-layer e4m3fn-only code histograms, NaN codes")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("plan", help="per-rank memory: experts as neuron-w8 vs BF16, other weights, KV cache")
    s.add_argument("target", nargs="?", help="checkpoint folder, config.json, or a packaged model name (see `configs`)")
    s.add_argument("--config", help="a config.json file")
    s.add_argument("--tp", type=int, default=1, help="ranks (tensor-parallel size; with --ep also the expert-parallel size)")
    s.add_argument("--ep", action="store_true", help="expert parallelism: whole experts per rank (over TP x DP ranks)")
    s.add_argument("--dp", type=int, default=1, help="data-parallel replicas of attention (with --ep the experts spread over TP x DP)")
    s.add_argument("--ep-size", type=int, default=None, help="expert-parallel degree below TP x DP (implies --ep): experts over EP "
                   "groups, each expert's I over the ranks of a group (vllm-neuron's GLM-5.3-Flash: --tp 64 --ep-size 16)")
    s.add_argument("--lnc", type=int, choices=(1, 2), default=2, help="Trn2 logical core size: sets the default HBM per rank")
    s.add_argument("--hbm-gb", type=float, default=None, help="HBM per rank in GB (default: Trn2 logical core, 25.77 GB at LNC=2, 12.88 at LNC=1)")
    s.add_argument("--utilization", type=float, default=0.9, help="share of HBM usable for weights + KV (default 0.9)")
    s.add_argument("--max-model-len", type=int, default=None, help="context length: also report sequences that fit")
    s.add_argument("--mode", choices=MODES, default="pow2", help="neuron-w8 mode (scale grid)")
    s.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16")
    s.add_argument("--decode-batch", type=int, default=128, help="the large batch of the decode-bytes table (besides batch 1)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("convert", help="write a pre-converted neuron-w8 checkpoint (no repack at start-up)")
    s.add_argument("checkpoint", help="source FP8 checkpoint folder")
    s.add_argument("out", help="output folder (written atomically)")
    s.add_argument("--mode", choices=MODES, default="pow2")
    s.add_argument("--tp", type=int, default=1, help="validate (and record) that the experts split over this TP size")
    s.add_argument("--ep", action="store_true", help="with --tp: expert parallelism")
    s.add_argument("--force", action="store_true", help="replace an existing, different OUT")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("demo", help="tiny Qwen3.5-MoE FP8 model served by `vllm serve --quantization neuron-w8`")
    s.add_argument("--dir", default=None, help="where the tiny checkpoint lives (default ~/.cache/vllm-moe-w8/demo)")
    s.add_argument("--prompt", default="Hello! Who are you?")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to become healthy")
    s.add_argument("--mode", choices=MODES, default=None, help="neuron-w8 mode (default: the plugin's)")
    s.add_argument("--keep-log", action="store_true", help="keep the server log file")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("neuron-check", help="first Trainium2 run: inventory, each NKI kernel vs the reference, a tiny model "
                       "served (exit 2 off Neuron after the checks CPU can run)")
    s.add_argument("--lnc", type=int, choices=(1, 2), default=None, help="LNC to launch at (default: NEURON_LOGICAL_NC_CONFIG, else 2)")
    s.add_argument("--experts", type=int, default=None, help="local experts in the checked layer (default 32 on Neuron, 4 off it)")
    s.add_argument("--device", default="neuron", help="torch device of the Neuron backend (default 'neuron')")
    s.add_argument("--json-out", default=None, help="also write the inventory and results to this JSON file")
    s.set_defaults(func=cmd_neuron_check)

    s = sub.add_parser("configs", help="list the packaged model configs and their recommended trn2 settings")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_configs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every failure becomes a one-line message and exit 1
        from vllm_moe_w8.codec.checkpoint import CheckpointError

        if isinstance(e, (CheckpointError, ValueError, OSError)):
            _fail(args, str(e))
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
