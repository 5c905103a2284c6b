"""Shared fixtures: tiny FP8 checkpoints (and their exact twins) generated once per test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_log import excerpt
from hypothesis import settings

TESTS_DIR = Path(__file__).parent

# The /proc/cpuinfo flags that select code paths here: the plugin's native MoE kernels (op/native.py: avx512bf16
# needs avx512f/bw/vl/vbmi + avx512_bf16 + fma, avx2 needs avx2 + fma + f16c) and vLLM 0.32's CPU kernels (AMX for
# bf16 attention, bf16 MoE, MLA and small bf16 GEMMs when amx_tile is present; avx512_bf16 for its GDN and conv1d).
CODE_PATH_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_bf16", "avx512_vnni",
                   "avx512_fp16")
AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def cpu_variant(flags: frozenset[str]) -> str:
    """This project's name for the machine variant: which of vLLM's / the plugin's CPU code paths run here."""
    if "amx_tile" in flags:
        return "Intel AMX"
    if "avx512f" in flags:
        return "AVX-512 without AMX" + (" (avx512_bf16)" if "avx512_bf16" in flags else "")
    if "avx2" in flags:
        return "AVX2-only"
    return "no AVX2"


def cpu_variant_line(flags: frozenset[str], model: str) -> str:
    """One line naming the CPU, its code-path flags and its AMX state (pytest's header; tests quote it)."""
    have = " ".join(f for f in CODE_PATH_FLAGS if f in flags) or "-"
    amx = " ".join(f for f in AMX_FLAGS if f in flags)
    amx_text = f"yes ({amx}): vLLM picks AMX kernels for bf16" if "amx_tile" in flags else "no"
    return f"cpu: {model} | {cpu_variant(flags)} | {have} | amx: {amx_text}"


def this_cpu_flags() -> frozenset[str]:
    from vllm_moe_w8.vllm_glue.cpu_amx_permission import cpu_flags  # reads /proc/cpuinfo; imports neither torch nor vLLM

    return cpu_flags()


# The routed experts' CPU kernel is named, not left to the host: on an AMX host VLLM_MOE_W8_CPU_KERNEL=auto would run
# vLLM's FP8 kernel (vllm_glue/cpu_vllm_fp8.py) wherever the layout fits, elsewhere the plugin's op, so every test and
# every child it starts runs the op unless it asks for vLLM's kernel by name (tests/test_cpu_vllm_fp8.py, the
# accuracy gate's vllm-fp8 run).
os.environ.setdefault("VLLM_MOE_W8_CPU_KERNEL", "native")
# Likewise the non-expert FP8 linears (vllm_glue/cpu_vllm_fp8_linear.py: auto would keep them at 1 byte for vLLM's FP8
# linear kernel on AMX hosts): dequantised unless a test asks for vLLM's kernel by name.
os.environ.setdefault("VLLM_MOE_W8_CPU_LINEAR", "dequant")

CPU_FLAGS = this_cpu_flags()
CPU_VARIANT = cpu_variant(CPU_FLAGS)
CPU_LINE = cpu_variant_line(CPU_FLAGS, cpu_model())


def pytest_report_header(config):
    return CPU_LINE


def pytest_addoption(parser):
    parser.addoption("--vllm-neuron-tree", default=None, metavar="FOLDER",
                     help="a folder of real vllm-neuron files (tests/neuron_realtree/README.md): the Neuron glue's "
                          "real-tree tests run against it (also VLLM_MOE_W8_VLLM_NEURON_TREE); without it they skip")

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


def run_models_child(args: dict, workdir: Path, env: dict | None = None, timeout: float = 900,
                     may_die: bool = False) -> dict:
    """Run ``tests/_models_runner.py`` in a fresh process; return its JSON results (see that module), plus
    ``_log`` (the end of the child's output), ``_plugin_log`` (every ``neuron-w8:`` log line, all ranks) and
    ``_returncode``.

    The results file is judged even when the child exits non-zero after writing it (vLLM's CPU build
    may abort at shutdown with TP=2); with no results at all the child's log is shown, unless ``may_die``
    (a test that expects the child to be killed): then only the ``_`` keys come back.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    args_path, out_path = workdir / "args.json", workdir / "results.json"
    args_path.write_text(json.dumps(args))
    child_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    proc = subprocess.run([sys.executable, str(TESTS_DIR / "_models_runner.py"), str(args_path), str(out_path)],
                          capture_output=True, text=True, timeout=timeout, env=child_env, cwd=workdir)
    full_log = proc.stdout + proc.stderr
    log = excerpt(full_log, 8000)
    if not out_path.exists() and not may_die:
        raise AssertionError(f"the vLLM child wrote no results (exit {proc.returncode}):\n{log}")
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    results["_log"] = log
    results["_plugin_log"] = [line for line in full_log.splitlines() if "neuron-w8:" in line]  # every rank's load lines
    results["_returncode"] = proc.returncode
    return results
