"""Shared fixtures: tiny FP8 checkpoints (and their exact twins) generated once per test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

TESTS_DIR = Path(__file__).parent

# CI (CI=true) replays the same hypothesis examples every run, so a red CI is reproducible and never a coin toss;
# local runs keep exploring new examples (and store failures in .hypothesis/ for replay).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch, fmt="block", **overrides) -> Path``: a tiny FP8 checkpoint, written once per session."""
    from vllm_moe_w8 import tiny_models

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    cache: dict = {}

    def make(arch: str, fmt: str = "block", **overrides) -> Path:
        key = (arch, fmt, tuple(sorted((k, str(v)) for k, v in overrides.items())))
        if key not in cache:
            name = f"{arch}-{fmt}-{len(cache)}"
            cache[key] = tiny_models.write_checkpoint(root / name, arch, fmt=fmt, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_twin(tiny_checkpoint):
    """``tiny_twin(arch, fmt="block", dtype=torch.float32, **overrides) -> Path``: the exactly dequantised twin."""
    import torch

    from vllm_moe_w8 import tiny_models

    cache: dict = {}

    def make(arch: str, fmt: str = "block", dtype=torch.float32, **overrides) -> Path:
        src = tiny_checkpoint(arch, fmt, **overrides)
        key = (src, dtype)
        if key not in cache:
            cache[key] = tiny_models.write_twin(src, src.parent / f"{src.name}-twin-{str(dtype).removeprefix('torch.')}", dtype=dtype)
        return cache[key]

    return make


def run_models_child(args: dict, workdir: Path, env: dict | None = None, timeout: float = 900) -> dict:
    """Run ``tests/_models_runner.py`` in a fresh process; return its JSON results (see that module), plus
    ``_log`` (the end of the child's output) and ``_plugin_log`` (every ``neuron-w8:`` log line, all ranks).

    The results file is judged even when the child exits non-zero after writing it (vLLM's CPU build
    may abort at shutdown with TP=2); with no results at all the child's log is shown.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    args_path, out_path = workdir / "args.json", workdir / "results.json"
    args_path.write_text(json.dumps(args))
    child_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    proc = subprocess.run([sys.executable, str(TESTS_DIR / "_models_runner.py"), str(args_path), str(out_path)],
                          capture_output=True, text=True, timeout=timeout, env=child_env, cwd=workdir)
    full_log = proc.stdout + proc.stderr
    log = full_log[-8000:]
    if not out_path.exists():
        raise AssertionError(f"the vLLM child wrote no results (exit {proc.returncode}):\n{log}")
    results = json.loads(out_path.read_text())
    results["_log"] = log
    results["_plugin_log"] = [line for line in full_log.splitlines() if "neuron-w8:" in line]  # every rank's load lines
    results["_returncode"] = proc.returncode
    return results
