"""The native libraries' threads are the process's OpenMP team, so they run where vLLM's CPU worker put it.

vLLM's CPU worker binds each OpenMP thread to one CPU (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``: it sets
``OMP_PLACES`` and ``OMP_PROC_BIND`` or ``GOMP_CPU_AFFINITY`` before torch starts). A thread a library made itself
would inherit the calling thread's one-CPU mask: with 2 threads asked for, all the work would run on one CPU
(measured before this design: the op at two threads took as long as at one under that binding). Here a fresh
interpreter gets the same binding vLLM sets (one place per CPU), calls the op and the pow2 repack with 2 threads, and
the CPUs their threads ran on (each library's ``team_cpus_seen``, fed by ``sched_getcpu`` in ``codec/csrc/team.h``)
must be both bound CPUs: under the binding a thread can run only on its own place's CPU, so the report cannot
include a CPU no thread was bound to. It also checks there is one OpenMP runtime in the process (the libraries
share torch's libgomp; a second runtime would be a second pool of threads competing with torch's).
"""

import json
import os
import subprocess
import sys

import pytest

from vllm_moe_w8.op import native

SCRIPT = r"""
import json, os, sys
import numpy as np
import torch
from vllm_moe_w8.codec import cxx_build, repack_native
from vllm_moe_w8.op import cpu as cpu_moe, native

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
E, H, I, T, k = 8, 1024, 512, 64, 2  # 12 MB of routed codes: above the kernel's one-thread threshold
w13 = torch.randint(0, 0x70, (E, 2 * I, H), dtype=torch.uint8, generator=g)
w2 = torch.randint(0, 0x70, (E, H, I), dtype=torch.uint8, generator=g)
s13, s2 = torch.rand(E, 2 * I // 128, H // 128, generator=g), torch.rand(E, H // 128, I // 128, generator=g)
x = torch.randn(T, H, generator=g).bfloat16()
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
wts = torch.rand(T, k, generator=g)
report = {"affinity": sorted(os.sched_getaffinity(0))}
lib = native.load(sys.argv[1])
cxx_build.team_cpus(lib, reset=True)
for _ in range(20):  # a team thread that starts late may find no item, never runs on a CPU it is not bound to
    cpu_moe.fused_moe_native(x, wts, ids, w13, s13, w2, s2, 128, 128, "e4m3", isa=sys.argv[1])
report["op"] = sorted(cxx_build.team_cpus(lib))
codes = np.random.default_rng(0).integers(0, 256, (4096, 2048), dtype=np.uint8)
rlib = repack_native._load()
cxx_build.team_cpus(rlib, reset=True)
for _ in range(5):
    repack_native.pow2(codes, 128, 128)
report["repack"] = sorted(cxx_build.team_cpus(rlib))
report["libgomp"] = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})
print("REPORT" + json.dumps(report))
"""


def _two_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:2] if len(cpus) >= 2 else None


@pytest.mark.parametrize("isa", list(native.ISAS))
def test_threads_run_on_every_cpu_of_vllms_binding(isa):
    cpus = _two_cpus()
    if cpus is None:
        pytest.skip("needs 2 CPUs to bind two OpenMP places")
    if native.missing_flags(isa):
        pytest.skip(f"CPU lacks {native.missing_flags(isa)} for the {isa} variant")
    env = {**os.environ, "OMP_PLACES": ",".join("{%d}" % c for c in cpus), "OMP_PROC_BIND": "true",
           "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, isa], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    assert report["affinity"] == cpus[:1], f"the binding did not take: the calling thread may run on {report['affinity']}"
    assert report["op"] == cpus, f"the {isa} kernel's threads ran on {report['op']}, not on both bound CPUs {cpus}"
    assert report["repack"] == cpus, f"the pow2 repack's threads ran on {report['repack']}, not on {cpus}"
    assert len(report["libgomp"]) == 1, f"more than one OpenMP runtime in the process: {report['libgomp']}"
