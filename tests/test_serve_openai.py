"""``vllm serve <ckpt> --quantization neuron-w8`` typed as a user types it (the ``vllm`` command of this
environment), then the ``openai`` client against it: /v1/completions and /v1/chat/completions, streaming and
not. One server (a tiny Qwen3.5-MoE FP8 checkpoint, the multimodal wrapper as the official one ships) for
all these checks. ``--quantization NEURON-W8`` (vLLM lower-cases CLI names) goes through the same CLI parser
and engine-config path without a second server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_log import excerpt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STARTUP_TIMEOUT_S = 600  # 2 shared cores: start-up is ~25 s alone, minutes when the machine is busy
MAX_TOKENS = 8


def _vllm_command() -> str:
    exe = Path(sys.executable).parent / "vllm"
    found = str(exe) if exe.exists() else shutil.which("vllm")
    if not found:
        pytest.skip("no `vllm` command in this environment")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    ckpt = tiny_checkpoint("Qwen3_5MoeForConditionalGeneration")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [_vllm_command(), "serve", str(ckpt), "--quantization", "neuron-w8",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--enforce-eager",
           "--served-model-name", "tiny"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        import requests

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{excerpt(log_path.read_text())}")
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{excerpt(log_path.read_text())}")
            time.sleep(1)
        yield {"port": port, "log": log_path}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="unused", max_retries=0, timeout=300)


def test_server_uses_neuron_w8(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    log = server["log"].read_text()
    assert "neuron-w8: loading routed experts" in log, excerpt(log)


def test_completions_plain_and_streaming_agree(client):
    prompt = "The quick brown fox"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1)
    choice = plain.choices[0]
    assert plain.usage.completion_tokens == MAX_TOKENS and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == MAX_TOKENS
    assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(chunks) >= 2
    assert streamed == choice.text  # greedy: the same tokens either way


def test_chat_completions_plain_and_streaming_agree(client):
    messages = [{"role": "user", "content": "Hello! What is the capital of France?"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
    msg = plain.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    # the chat template wrapped the message: more prompt tokens than the bare text has
    assert plain.usage.prompt_tokens > 8 and plain.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0.0, stream=True))
    streamed = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert streamed == msg.content


def test_upper_case_flag_selects_neuron_w8(tiny_checkpoint):
    """``vllm serve ckpt --quantization NEURON-W8``: vLLM's own CLI parser and engine config accept it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ckpt = str(tiny_checkpoint("Qwen3_5MoeForConditionalGeneration"))
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", ckpt, "--quantization", "NEURON-W8", "--max-model-len", "256"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.model_config.quantization == "neuron-w8"
    assert type(config.quant_config).__name__ == "NeuronW8Config"
