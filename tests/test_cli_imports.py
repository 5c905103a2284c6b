"""The `vllm-moe-w8` modules import neither vLLM (the demo runs `vllm serve` as a subprocess) nor, for
`plan` and `configs`, torch: planning works on a laptop without either."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import io, contextlib, sys
from vllm_moe_w8.tools import cli
with contextlib.redirect_stdout(io.StringIO()):
    assert cli.main(["plan", "glm-5.3-flash", "--tp", "32", "--ep", "--json"]) == 0
    assert cli.main(["configs", "--json"]) == 0
assert "torch" not in sys.modules and "vllm" not in sys.modules, "plan/configs pulled in torch or vllm"
import vllm_moe_w8.codec.checkpoint, vllm_moe_w8.tools.inspect_ckpt, vllm_moe_w8.tools.convert, vllm_moe_w8.tools.demo, vllm_moe_w8.tools.plan
assert "vllm" not in sys.modules, "a CLI module imports vllm at import time"
print("ok")
"""


def test_cli_modules_import_neither_vllm_nor_torch_for_planning():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
