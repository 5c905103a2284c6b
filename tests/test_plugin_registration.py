"""Registration: the entry point really loads (vLLM silently skips a plugin that fails to import), the
package import stays light, registration is idempotent, and the vLLM version is checked."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_import_is_light():
    out = _run("""
        import sys, vllm_moe_w8
        print(sorted(m for m in ("vllm", "torch") if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("neuron_w8") == "vllm_moe_w8:register"


@pytest.mark.slow
def test_vllm_loads_the_plugin_through_its_entry_point():
    pytest.importorskip("vllm")
    out = _run("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
        from vllm_moe_w8.vllm_glue.quant_config import NeuronW8Config
        import vllm_moe_w8
        vllm_moe_w8.register(); vllm_moe_w8.register()  # idempotent
        from vllm_moe_w8.vllm_glue.register import register_with_vllm
        register_with_vllm()  # idempotent even past the package-level guard
        import torch
        print(get_quantization_config("neuron-w8") is NeuronW8Config, QUANTIZATION_METHODS.count("neuron-w8"),
              hasattr(torch.ops.moe_w8, "fused_moe"))
    """)
    assert out.split()[-3:] == ["True", "1", "True"]


def test_version_range_and_warning(monkeypatch):
    pytest.importorskip("vllm")
    from vllm_moe_w8.vllm_glue import register as vllm_plugin

    assert vllm_plugin.version_supported("0.32.0+cpu") and vllm_plugin.version_supported("0.32.7")
    assert not vllm_plugin.version_supported("0.31.2") and not vllm_plugin.version_supported("0.33.0")
    assert not vllm_plugin.version_supported("unknown")
    assert vllm_plugin.version_supported(vllm_plugin.installed_vllm_version())  # this environment: 0.32

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.neuron_w8")
    logger.addHandler(handler)
    monkeypatch.setattr(vllm_plugin, "installed_vllm_version", lambda: "0.31.2")
    try:
        vllm_plugin.register_with_vllm()
    finally:
        logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("vLLM 0.31.2 is outside the supported range >=0.32.0,<0.33" in w for w in warnings)
