"""`vllm-moe-w8 demo`: the README's main-job command, end to end, plus its server-handling helpers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from child_log import excerpt

from vllm_moe_w8.tools import demo

DEMO_TIMEOUT_S = 900  # vllm serve start-up (~25 s alone, minutes on a loaded 2-core machine) + one request


def _demo_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("vllm-moe-w8")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm_moe_w8.tools.cli"]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_serves_a_chat_answer_through_neuron_w8(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    proc = subprocess.run(_demo_cmd() + ["demo", "--dir", str(tmp_path / "demo"), "--json", "--timeout", "600"],
                          capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, excerpt(proc.stdout, 3000) + excerpt(proc.stderr, 5000)
    r = json.loads(proc.stdout)
    assert r["ok"] and isinstance(r["answer"], str)
    summary = "\n".join(r["load_summary"])
    # the plugin really loaded and repacked the FP8 experts, and its self-check ran
    assert "neuron-w8: loading routed experts" in summary and "checkpoint block, mode pow2" in summary
    assert "neuron-w8: processed 2 MoE layers (mode pow2)" in summary and "self-check passed" in summary
    assert all("'quantization': 'neuron-w8'" not in l for l in r["load_summary"])  # only the plugin's own records
    assert not _port_open(r["port"]), "the demo must stop its server"
    assert (tmp_path / "demo" / "config.json").is_file() and (tmp_path / "demo" / demo.MARKER).is_file()
    assert not Path(r["log"]).exists()  # log removed on success unless --keep-log


def test_stop_ends_the_whole_process_group():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"],
                             start_new_session=True)
    demo.stop(child)
    assert child.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(child.pid, 0)  # no process of the group is left


def test_wait_healthy_reports_an_early_exit_with_the_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("ValueError: neuron-w8 cannot serve this\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    proc.wait()
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*neuron-w8 cannot serve this"):
        demo.wait_healthy(proc, demo.free_port(), timeout=5, log_path=log)


def test_server_command_binds_loopback_and_uses_the_plugin(tmp_path):
    cmd = demo.server_command(tmp_path, 12345, "lut")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "12345"
    assert cmd[cmd.index("--quantization") + 1] == "neuron-w8"
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"neuron_w8": {"mode": "lut"}}
    assert Path(cmd[0]).parent == Path(sys.executable).parent
    lines = ["(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'quantization': 'neuron-w8'}",
             "(Worker pid=2) INFO [moe_method.py:342] neuron-w8: processed 2 MoE layers (mode pow2)"]
    (tmp_path / "log").write_text("\n".join(lines))
    assert demo.summary_lines(tmp_path / "log") == [lines[1]]
