"""``benchmarks.bench_e2e.start_failure``: the reason a vLLM start-up stopped, as the e2e record and docs/cpu-path.md state it.

The log below is the shape vLLM 0.32's CPU build prints when ``quantization="fp8"`` meets a CPU without AMX (worker
prefix, logger prefix, the error and its reason lines, then the engine's own traceback)."""

from __future__ import annotations

from benchmarks.bench_e2e import start_failure

LOG = """\
(Worker pid=19913) INFO 12-01 11:02:46 [parallel_state.py:1906] world_size=1 rank=0 local_rank=0
(Worker pid=19913) ERROR 12-01 11:02:46 [multiproc_executor.py:953]   File "vllm/model_executor/kernels/linear/__init__.py", line 720
(Worker pid=19913) ERROR 12-01 11:02:46 [multiproc_executor.py:953]     raise ValueError(
(Worker pid=19913) ERROR 12-01 11:02:46 [multiproc_executor.py:953] ValueError: Failed to find a kernel that can implement the ScaledMM linear layer. Reasons: 
(Worker pid=19913) ERROR 12-01 11:02:46 [multiproc_executor.py:953] CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)..
(Worker pid=19913) ERROR 12-01 11:02:46 [multiproc_executor.py:953] CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)..
(EngineCore pid=19865) INFO 12-01 11:02:46 [multiproc_executor.py:479] [shutdown] Executor: waiting for worker exit count=1
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_first_error_with_its_reasons_without_prefixes():
    reason = start_failure(LOG)
    assert reason.startswith("ValueError: Failed to find a kernel that can implement the ScaledMM linear layer.")
    assert "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support" in reason
    assert "CPUFp8BlockScaledMMKernel requires AMX tile support" in reason
    assert "pid=" not in reason and "multiproc_executor" not in reason and "Engine core" not in reason


def test_a_log_without_an_error_says_so():
    assert start_failure("INFO all fine\n") == "no error line found in the log"
