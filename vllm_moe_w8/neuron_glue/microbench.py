"""``neuron-check`` microbenchmarks: the few device facts that decide the pow2 kernel's schedule, measured on
Trainium2 and set beside both cost scenarios (``kernels/nki_cpu/calibration.SCENARIOS``).

Each microbenchmark is a tiny NKI kernel run at two sizes (``n`` small and large); the per-operation cost is the
slope ``(t_large - t_small) / (n_large - n_small)``, which cancels launch overhead:

* ``matmul``: back-to-back ``nc_matmul`` with a different 128x128 FP8 stationary each time and one [128, 16] bf16
  moving tile (the pow2 block product). fitted: 16 + 616 cycles; documented: max(16, 64) cycles.
* ``vector_scalar_psum``: VectorE ``tensor_scalar`` and ScalarE ``activation`` each reading its own PSUM bank,
  alone and together; ``overlap`` = together / (alone + alone): 1 serial (fitted), ~0.5 parallel (documented).
* ``gpsimd_add``: GpSimd fp32 ``tensor_tensor`` adds of [128, 512] in SBUF (assumed 1 element/partition/cycle).
* ``dma_small`` / ``dma_large``: HBM -> SBUF ``dma_copy`` of 8 KiB and 256 KiB: the fixed cost and the rate.
* indirect DMA is not measured yet: the interpreter has no indirect access patterns (issue #20 adds them).

On a Neuron host the kernels run through ``kernel_launch.launch`` (wrap_nki) and are timed on the host around a
synchronising copy (device time + launch; the slope removes the launch). Elsewhere they run in the interpreter,
which counts instructions but has no clock: the "measured" column says so and no calibration file is written.
:func:`choose_schedule` turns measurements into the scenario whose schedule the kernel uses
(``kernels/schedule.py``), :func:`write_calibration` writes the file it reads.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vllm_moe_w8.kernels import schedule
from vllm_moe_w8.kernels.nki_api import nisa, nki, nl

P = 128
MOVING_N = 16
STATIONARIES = 8  # distinct FP8 stationaries the matmul benchmark cycles through
LANE = {"matmul": "tensor", "gpsimd_add": "gpsimd", "dma_small": "dma", "dma_large": "dma"}  # the engine each isolates
SIZES = {"matmul": (8, 40), "vector_scalar_psum": (8, 40), "gpsimd_add": (8, 40), "dma_small": (4, 20), "dma_large": (2, 6)}
DMA_BYTES = {"dma_small": 64, "dma_large": 2048}  # per partition: 8 KiB and 256 KiB per DMA
OVERLAP_PARALLEL = 0.75  # together / (alone + alone) at or below this: VectorE and ScalarE ran in parallel


@nki.jit
def mb_matmul(stationary, moving, n=1):
    """n matmuls cycling through stationary [128, S, 128] uint8 (FP8 codes: a different one each matmul), moving
    [128, 16] bf16 -> [128, 16] fp32. The bytes loaded do not grow with n (the slope is TensorE's)."""
    m = stationary.shape[1]
    st = nl.ndarray((P, m, P), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.dma_copy(dst=st, src=stationary)
    mv = nl.ndarray((P, MOVING_N), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=mv, src=moving)
    codes = st.view(nl.float8_e4m3)
    ps = nl.ndarray((P, MOVING_N), dtype=nl.float32, buffer=nl.psum)
    for i in range(n):
        nisa.nc_matmul(dst=ps, stationary=codes[:, i % m, :], moving=mv, accumulate=(i > 0))
    res = nl.ndarray((P, MOVING_N), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=ps)
    out = nl.ndarray((P, MOVING_N), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res)
    return out


@nki.jit
def mb_psum_reads(x, n_vector=0, n_scalar=0):
    """x [128, 512] fp32 copied to two PSUM banks; n_vector VectorE and n_scalar ScalarE reads of them."""
    src = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=x)
    ps_v = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.psum)
    ps_s = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.psum)
    nisa.tensor_copy(dst=ps_v, src=src, engine=nisa.engine.vector)
    nisa.tensor_copy(dst=ps_s, src=src, engine=nisa.engine.scalar)
    res_v = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.sbuf)
    res_s = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=res_v, value=0.0)
    nisa.memset(dst=res_s, value=0.0)
    for _i in range(n_vector):
        nisa.tensor_scalar(dst=res_v, data=ps_v, op0=nl.multiply, operand0=2.0, engine=nisa.engine.vector)
    for _i in range(n_scalar):
        nisa.activation(dst=res_s, op=nl.copy, data=ps_s, scale=2.0)
    nisa.tensor_tensor(dst=res_v, data1=res_v, data2=res_s, op=nl.add)
    out = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res_v)
    return out


@nki.jit
def mb_gpsimd_add(x, n=1):
    """n GpSimd fp32 adds of [128, 512] SBUF tiles."""
    a = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    acc = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0, engine=nisa.engine.gpsimd)
    for _i in range(n):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=a, op=nl.add, engine=nisa.engine.gpsimd)
    out = nl.ndarray((P, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


@nki.jit
def mb_dma(src):
    """src [n, 128, b] uint8: n HBM -> SBUF DMAs of [128, b]; returns the last tile's first column."""
    n, _p, b = src.shape
    tile = nl.ndarray((P, b), dtype=nl.uint8, buffer=nl.sbuf)
    for i in range(n):
        nisa.dma_copy(dst=tile, src=src[i])
    out = nl.ndarray((P, 1), dtype=nl.uint8, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile[:, 0:1])
    return out


def _case(name: str, n: int):
    """(kernel, tensors as numpy, constants, operations counted) of microbenchmark ``name`` at size ``n``."""
    rng = np.random.default_rng(0)
    if name == "matmul":
        import ml_dtypes

        codes = rng.integers(0, 0x30, size=(P, STATIONARIES, P), dtype=np.uint8)  # small finite Trn2 FP8 codes
        moving = rng.standard_normal((P, MOVING_N)).astype(ml_dtypes.bfloat16)
        return mb_matmul, (codes, moving), {"n": n}, n
    x = rng.standard_normal((P, 512)).astype(np.float32)
    if name == "vector_scalar_psum":
        return mb_psum_reads, (x,), {"n_vector": n, "n_scalar": n}, n
    if name == "vector_psum":
        return mb_psum_reads, (x,), {"n_vector": n}, n
    if name == "scalar_psum":
        return mb_psum_reads, (x,), {"n_scalar": n}, n
    if name == "gpsimd_add":
        return mb_gpsimd_add, (x,), {"n": n}, n
    if name in DMA_BYTES:
        return mb_dma, (np.zeros((n, P, DMA_BYTES[name]), np.uint8),), {}, n
    raise KeyError(f"unknown microbenchmark {name!r}")


BENCHES = ("matmul", "vector_psum", "scalar_psum", "vector_scalar_psum", "gpsimd_add", "dma_small", "dma_large")


@dataclass
class Result:
    name: str
    unit: str
    modelled: dict  # scenario -> seconds per operation
    measured: float | None = None  # seconds per operation on the device (None: interpreter, no clock)
    extra: dict = field(default_factory=dict)


def _sizes(name: str) -> tuple[int, int]:
    return SIZES.get(name, SIZES["vector_scalar_psum"])


def _modelled_per_op(name: str) -> dict[str, float]:
    """Slope of the cost model's time (each scenario) between the two sizes, from the interpreter's counts."""
    from vllm_moe_w8.kernels.nki_cpu import calibration as cal
    from vllm_moe_w8.kernels.nki_cpu import cost, run

    lo, hi = _sizes(name)
    out = {}
    stats = {}
    for n in (lo, hi):
        kernel, tensors, constants, _ops = _case(name, n)
        stats[n] = run(kernel, *tensors, **constants)[1]
    for scen_name, scen in cal.SCENARIOS.items():
        # the engine the benchmark isolates (its lane), or the whole kernel for the PSUM-overlap ones
        t = {n: cost.estimate(s, scen).lanes.get(LANE.get(name), cost.estimate(s, scen).time_s) for n, s in stats.items()}
        out[scen_name] = (t[hi] - t[lo]) / (hi - lo)
    return out


def _device_per_op(name: str, lnc: int, timer) -> float:
    lo, hi = _sizes(name)
    t = {}
    for n in (lo, hi):
        kernel, tensors, constants, _ops = _case(name, n)
        t[n] = timer(kernel, tensors, constants, lnc)
    return (t[hi] - t[lo]) / (hi - lo)


def device_timer(kernel, tensors, constants, lnc: int, repeats: int = 5, device: str = "neuron") -> float:
    """Median wall time of one launch on the Neuron device (through kernel_launch.launch, synchronised by .cpu()).
    Unverified until the first trn2 run (the launch path is the one the MoE kernels use)."""
    import torch

    from vllm_moe_w8.neuron_glue import kernel_launch

    def to_device(a):
        if a.dtype.name == "bfloat16":  # ml_dtypes bfloat16 -> torch bfloat16 (same bits)
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(device)
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    dev = [to_device(t) for t in tensors]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        kernel_launch.launch(kernel, lnc, tuple(dev), constants).cpu()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def modelled_table() -> dict[str, dict[str, float]]:
    """Every benchmark's modelled seconds per operation in both scenarios. Where the kernels here are bound to AWS's
    nki (a Neuron host), the interpreter's counts come from a child process forced onto it
    (``VLLM_MOE_W8_NKI=interpreter``), as neuron-check prices the MoE kernels."""
    from vllm_moe_w8.kernels.nki_api import BACKEND

    if BACKEND == "interpreter":
        return {name: _modelled_per_op(name) for name in BENCHES}
    import os
    import subprocess
    import sys

    code = "import json; from vllm_moe_w8.neuron_glue import microbench as m; print(json.dumps(m.modelled_table()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, VLLM_MOE_W8_NKI="interpreter"))
    if proc.returncode != 0:
        raise RuntimeError(f"pricing the microbenchmarks in the interpreter failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_all(on_neuron: bool, lnc: int = 1, timer=None, device: str = "neuron") -> list[Result]:
    """Every microbenchmark: modelled per operation in both scenarios, and measured when on a Neuron host
    (``timer``: how one launch is timed, :func:`device_timer` on ``device`` by default)."""
    if timer is None and on_neuron:
        def timer(kernel, tensors, constants, lnc_):
            return device_timer(kernel, tensors, constants, lnc_, device=device)
    modelled = modelled_table()
    results = []
    for name in BENCHES:
        unit = "s per DMA" if name.startswith("dma") else "s per instruction"
        r = Result(name, unit, modelled[name])
        if on_neuron or timer is not None:
            r.measured = _device_per_op(name, lnc, timer)
        results.append(r)
    return results


def overlap(results: list[Result], key: str) -> float | None:
    """VectorE+ScalarE together / (VectorE alone + ScalarE alone), per operation pair."""
    by = {r.name: r.measured if key == "measured" else r.modelled[key] for r in results}
    v, s, both = by.get("vector_psum"), by.get("scalar_psum"), by.get("vector_scalar_psum")
    if v is None or s is None or both is None or v + s <= 0:
        return None
    return both / (v + s)


def choose_schedule(results: list[Result]) -> tuple[str, str]:
    """(scenario, why) from device measurements: VectorE ‖ ScalarE decides the schedule (kernels/schedule.py)."""
    ratio = overlap(results, "measured")
    if ratio is None:
        return "fitted", "no device measurement: the default (fitted) schedule"
    if ratio <= OVERLAP_PARALLEL:
        return "documented", f"VectorE and ScalarE overlapped on PSUM (together / alone-sum = {ratio:.2f} <= {OVERLAP_PARALLEL})"
    return "fitted", f"VectorE and ScalarE did not overlap on PSUM (together / alone-sum = {ratio:.2f} > {OVERLAP_PARALLEL})"


def write_calibration(results: list[Result], path: Path, measured_on: str) -> dict:
    """Write the calibration file the pow2 kernel's schedule reads at load; refuses without device measurements."""
    if any(r.measured is None for r in results):
        raise ValueError(f"not writing {path}: the microbenchmarks have no device measurements (interpreter run); "
                         "the kernel keeps the default schedule")
    scenario, why = choose_schedule(results)
    record = {"scenario": scenario, "decided_by": why, "measured_on": measured_on,
              "vector_blocks": schedule.SCHEDULES[scenario], "block_period": schedule.BLOCK_PERIOD,
              "microbenchmarks": [r.__dict__ for r in results]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return record


def format_results(results: list[Result]) -> str:
    def us(v):
        return "n/a" if v is None else f"{v * 1e6:9.4f} µs"

    lines = [f"{'microbenchmark':20s} {'fitted model':>13s} {'documented':>13s} {'measured':>13s}"]
    for r in results:
        lines.append(f"{r.name:20s} {us(r.modelled['fitted']):>13s} {us(r.modelled['documented']):>13s} "
                     f"{(us(r.measured) if r.measured is not None else 'interpreter: no clock'):>13s}")
    fo, do, mo = (overlap(results, k) for k in ("fitted", "documented", "measured"))
    lines.append(f"VectorE ‖ ScalarE on PSUM, together / alone-sum: fitted {fo:.2f}, documented {do:.2f}, measured "
                 + (f"{mo:.2f}" if mo is not None else "n/a"))
    lines.append("indirect DMA: not measured (no indirect access patterns in the interpreter yet; issue #20)")
    return "\n".join(lines)


def check(on_neuron: bool, lnc: int, path: Path | None = None, timer=None, device: str = "neuron") -> dict:
    """neuron-check's microbenchmark section: run, print measured vs both scenarios, and on a Neuron host write the
    calibration file (``path`` or ``kernels/schedule.calibration_path()``). Returns what the JSON record keeps."""
    where = "Neuron device" if on_neuron or timer is not None else "NKI interpreter (instruction counts, no device clock)"
    print(f"\n== microbenchmarks (what decides the pow2 kernel's schedule), run on the {where}")
    results = run_all(on_neuron, lnc, timer, device)
    print(format_results(results))
    record = {"ran_on": where, "results": [r.__dict__ for r in results], "active_schedule": schedule.load().__dict__}
    target = schedule.calibration_path() if path is None else Path(path)
    if any(r.measured is None for r in results):
        print(f"  calibration file: not written (no device measurement); the pow2 kernel uses "
              f"{record['active_schedule']['scenario']!r} ({record['active_schedule']['source']})")
        return record
    written = write_calibration(results, target, measured_on=where)
    print(f"  calibration file: {target}: scenario {written['scenario']!r} ({written['decided_by']}); "
          "the pow2 kernel reads it when it is next loaded")
    record["calibration_file"] = str(target)
    record["chosen"] = written["scenario"]
    return record
