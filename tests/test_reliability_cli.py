"""Bad checkpoints through ``vllm-moe-w8 inspect / convert / plan``: exit code 1, a message naming the file
and tensor (or setting) and the remedy, and ``convert`` never leaves a half-written OUT.

Each case breaks a private copy of one tiny FP8 checkpoint (tests/corrupt.py) the way real downloads and
exports break. The CLI runs in-process through ``cli.main`` (argument parsing, error mapping and exit code
included); one test runs the installed ``vllm-moe-w8`` executable to pin the process exit code.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import corrupt as C
from vllm_moe_w8.tools.cli import main

# Cases that only the data (not the headers) reveals: inspect needs --scan to see them.
DATA_CASES = ("scale_zero", "scale_negative", "scale_nan", "scale_inf", "nan_code_7f", "nan_code_ff")


@pytest.fixture(scope="module")
def base(tiny_checkpoint) -> Path:
    """The session's tiny Qwen3-MoE block-FP8 checkpoint (conftest); every case breaks a private copy."""
    return tiny_checkpoint("qwen3-moe")


def run_cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue() + err.getvalue()


def _break(case: str, path: Path) -> tuple[str, str]:
    """Apply ``case`` to ``path``; returns (file name, tensor/setting) the error must name."""
    if case == "truncated_shard":
        return C.truncate_shard(path), "truncated"
    if case == "garbled_header":
        return C.garble_header(path), "not valid JSON"
    if case == "index_names_missing_shard":
        return C.remove_shard(path), "missing"
    if case == "tensor_missing_from_shard":
        name = C.expert_name(path, "weight")
        return C.drop_tensor(path, name, keep_in_index=True), name
    if case == "weight_without_scale":
        name = C.expert_name(path, "weight_scale_inv")
        shard = C.drop_tensor(path, name, keep_in_index=False)
        return C.shard_of(path, C.expert_name(path, "weight")), name
    if case == "scale_grid_mismatch":
        name = C.wrong_scale_grid(path)
        return C.shard_of(path, name), name
    if case.startswith("scale_"):
        value = {"scale_zero": 0.0, "scale_negative": -1.0, "scale_nan": float("nan"), "scale_inf": float("inf")}[case]
        name = C.set_scale_value(path, value)
        weight = C.expert_name(path, "weight")
        return C.shard_of(path, name), weight[: -len(".weight")]  # the projection (weight or its scale)
    if case.startswith("nan_code_"):
        name = C.set_nan_code(path, int(case[-2:], 16))
        return C.shard_of(path, name), name
    raise KeyError(case)


FILE_CASES = (
    "truncated_shard", "garbled_header", "index_names_missing_shard", "tensor_missing_from_shard",
    "weight_without_scale", "scale_grid_mismatch",
) + DATA_CASES


@pytest.fixture(scope="module")
def broken(base, tmp_path_factory):
    """case -> (checkpoint path, shard file, tensor/word the message must contain), made once per module."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for case in FILE_CASES:
        path = C.copy_checkpoint(base, root / case)
        shard, what = _break(case, path)
        out[case] = (path, shard, what)
    return out


@pytest.mark.parametrize("case", FILE_CASES)
def test_inspect_names_file_and_tensor(broken, case):
    path, shard, what = broken[case]
    argv = ["inspect", path, "--quiet"] + (["--scan"] if case in DATA_CASES else [])
    rc, text = run_cli(*argv)
    assert rc == 1, text
    assert str(path / shard) in text, text
    assert what in text, text


@pytest.mark.parametrize("case", FILE_CASES)
def test_convert_refuses_and_writes_nothing(broken, case, tmp_path):
    path, shard, what = broken[case]
    out = tmp_path / "converted"
    rc, text = run_cli("convert", path, out, "--quiet")
    assert rc == 1, text
    assert what in text, text
    assert str(path / shard) in text, text
    assert not out.exists(), "a failed convert must not leave OUT behind"
    for partial in tmp_path.glob("converted.partial-*"):  # resumable scratch space: never a loadable checkpoint
        assert not (partial / "config.json").exists() and not (partial / C.INDEX).exists()


def test_convert_cli_process_exit_code(broken, tmp_path):
    path, shard, _ = broken["nan_code_ff"]
    exe = Path(sys.executable).with_name("vllm-moe-w8")
    proc = subprocess.run([str(exe), "convert", str(path), str(tmp_path / "out"), "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NaN code" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ---- quantization settings and architecture ------------------------------------------------------

def _config_case(base: Path, root: Path, case: str) -> Path:
    path = C.copy_checkpoint(base, root / case)
    if case == "block_64":
        C.set_quant(path, weight_block_size=[64, 64])
    elif case == "static_activations":
        C.set_quant(path, activation_scheme="static")
    elif case == "unknown_quant_method":
        C.set_quant(path, quant_method="mystery-fp4")
    elif case == "unsupported_architecture":
        C.set_architecture(path, "MixtralForCausalLM")
    return path


CONFIG_CASES = {  # case: word the message must contain
    "block_64": "weight_block_size",
    "static_activations": "static",
    "unknown_quant_method": "mystery-fp4",
    "unsupported_architecture": "MixtralForCausalLM",
}



@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_convert_refuses_unsupported_settings(base, tmp_path, case):
    path = _config_case(base, tmp_path, case)
    rc, text = run_cli("convert", path, tmp_path / "out", "--quiet")
    assert rc == 1, text
    assert CONFIG_CASES[case] in text, text
    assert "config.json" in text or case == "block_64", text  # block_64 is reported per scale tensor, naming the shard
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_inspect_flags_unsupported_settings(base, tmp_path, case):
    path = _config_case(base, tmp_path, case)
    rc, text = run_cli("inspect", path, "--quiet")
    assert rc == 1, text
    assert CONFIG_CASES[case] in text, text


# ---- TP / EP settings the model cannot be split by -----------------------------------------------

@pytest.mark.parametrize("argv, word", [
    (["--tp", "5"], "not divisible by TP=5"),  # moe_intermediate_size 384 over 5 ranks
    (["--tp", "0"], "--tp must be >= 1"),
])
def test_plan_and_convert_refuse_unsplittable_tp(base, tmp_path, argv, word):
    rc, text = run_cli("plan", base, *argv)
    assert rc == 1, text
    assert word in text, text
    rc, text = run_cli("convert", base, tmp_path / "out", "--quiet", *argv)
    assert rc == 1, text
    assert not (tmp_path / "out").exists()


def test_plan_refuses_tp_that_does_not_divide_attention_heads(base):
    rc, text = run_cli("plan", base, "--tp", "3")
    assert rc == 1 and "heads" in text, text


def test_uneven_ep_is_reported(base):
    """8 experts over EP=3: vLLM places experts unevenly (3/3/2), so it is served; plan must say so."""
    rc, text = run_cli("plan", base, "--tp", "3", "--ep", "--json")
    report = json.loads(text)
    joined = " ".join(report.get("warnings", []) + report.get("errors", []))
    assert "8 experts" in joined and "EP=3" in joined, joined
