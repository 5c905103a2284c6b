"""The programs of one launch (the cores of a Logical NeuronCore) and what they exchange: ``sendrecv`` and
``core_barrier`` (aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py``), rules ``SPMD-*``.

A grid ``[n]`` runs ``n`` programs, each on its own thread with its own SBUF/PSUM, deterministically: one program runs
at a time (the lowest-numbered one that can), and control passes only where a program waits for another (a
``sendrecv`` or ``core_barrier`` its peers have not reached). A program that waits for one that has finished, or
for one that waits too, is a deadlock: refused.
"""

from __future__ import annotations

import threading

import numpy as np

from . import machine
from .engines import tile
from .enums import coerce, dma_engine
from .rules import ISA, NkiValidationError, rule

SENDRECV = rule("SPMD-SENDRECV", ISA, "``src`` and ``dst`` tiles must both be in SBUF",
                "sendrecv: SBUF src and dst of one dtype and shape; send_to_rank / recv_from_rank programs of the launch "
                "(0 or 1 under LNC=2); the peer must send to this program; gpsimd_dma at most 1024 / 512 / 256 B per "
                "partition for 32 / 16 / 8-bit types")
BARRIER = rule("SPMD-BARRIER", ISA, "Currently only ``cores=(0, 1)`` is supported",
               "core_barrier: cores (0, 1) of an LNC=2 launch (grid [2]) on shared HBM data; every program reaches it")


_DMA_ENGINE = dma_engine


class Deadlock(NkiValidationError):
    """A program waits for a peer that will not come (reported after any other error of the launch)."""


class Spmd:
    """The cooperative scheduler of one launch's program threads."""

    def __init__(self, n: int):
        self.n, self.cv = n, threading.Condition()
        self.state = ["ready"] * n
        self.turn: int | None = 0
        self.meetings: dict = {}
        self.deadlock: str | None = None

    def _next(self) -> None:
        ready = [p for p in range(self.n) if self.state[p] == "ready"]
        self.turn = ready[0] if ready else None
        if not ready and "waiting" in self.state:
            waiting = [p for p in range(self.n) if self.state[p] == "waiting"]
            self.deadlock = (f"program(s) {waiting} wait at a sendrecv / core_barrier that no other program of the launch "
                             "will reach (deadlock)")
        self.cv.notify_all()

    def start(self, pid: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == pid or self.deadlock is not None)

    def finish(self, pid: int) -> None:
        with self.cv:
            self.state[pid] = "done"
            if self.turn == pid:
                self._next()

    def meet(self, pid: int, key, payload, participants: set) -> dict:
        """Deposit ``payload`` at meeting ``key``; returns every participant's payload once all have arrived."""
        with self.cv:
            m = self.meetings.setdefault(key, {})
            m[pid] = payload
            if set(m) >= participants:
                for q in participants:
                    if self.state[q] == "waiting":
                        self.state[q] = "ready"
                return dict(m)
            self.state[pid] = "waiting"
            self._next()
            self.cv.wait_for(lambda: (self.state[pid] == "ready" and self.turn == pid) or self.deadlock is not None)
            if self.deadlock is not None and not (self.state[pid] == "ready" and self.turn == pid):
                raise Deadlock(self.deadlock)
            return dict(self.meetings[key])


def _sequence(m: machine.Machine, key) -> int:
    counts = m.__dict__.setdefault("_meetings", {})
    counts[key] = counts.get(key, 0) + 1
    return counts[key]


def _meet(key, payload, participants) -> dict:
    m = machine.current()
    spmd = m.launch.spmd
    if spmd is None:  # a one-program launch
        return {m.program_id: payload}
    return spmd.meet(m.program_id, (key, _sequence(m, key)), payload, participants)


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None) -> None:
    """Send ``src`` to program ``send_to_rank``'s ``dst`` while receiving ``recv_from_rank``'s ``src`` into ours."""
    m = machine.current()
    SENDRECV.check(getattr(src, "buffer", None) == "sbuf" and getattr(dst, "buffer", None) == "sbuf",
                   f"sendrecv src {src!r} / dst {dst!r}: both must be SBUF tiles")
    src, dst = tile(src, "sendrecv src", ("sbuf",)), tile(dst, "sendrecv dst", ("sbuf",))
    SENDRECV.check(src.dtype is dst.dtype and src.shape == dst.shape,
                   f"sendrecv: src {src.shape} {src.dtype} and dst {dst.shape} {dst.dtype} must match")
    to, frm = int(send_to_rank), int(recv_from_rank)
    SENDRECV.check(0 <= to < m.num_programs and 0 <= frm < m.num_programs and max(to, frm) <= 1,
                   f"sendrecv ranks {to} / {frm}: programs of this grid [{m.num_programs}] (0 or 1 under LNC=2)")
    if coerce(_DMA_ENGINE, dma_engine) is _DMA_ENGINE.gpsimd_dma:
        limit = {4: 1024, 2: 512, 1: 256}[src.dtype.itemsize]
        SENDRECV.check(src.size // src.shape[0] * src.dtype.itemsize <= limit,
                       f"sendrecv(dma_engine=gpsimd_dma) of {src.shape} {src.dtype}: at most {limit} B per partition")
    payload = (np.array(src._np(src.storage.bytes, np.uint8, per_byte=True), copy=True),
               np.array(src.written_bytes(), copy=True), to)  # the bytes as they are now (the sender goes on)
    got = _meet(("sendrecv", int(pipe_id)), payload, {m.program_id, to, frm})
    raw, written, target = got[frm]
    SENDRECV.check(target == m.program_id, f"program {m.program_id} receives from {frm}, which sends to {target}")
    dst._np(dst.storage.bytes, np.uint8, per_byte=True)[...] = raw
    dst.written_bytes()[...] = written
    m.stats.dma_count += 1


def core_barrier(data, cores, engine="gpsimd", name=None) -> None:
    """Every core of ``cores`` waits here until all have arrived."""
    m = machine.current()
    BARRIER.check(tuple(int(c) for c in cores) == (0, 1) and m.num_programs == 2,
                  f"core_barrier(cores={cores!r}) in a grid [{m.num_programs}]: cores (0, 1) of an LNC=2 launch")
    BARRIER.check(getattr(data, "buffer", None) == "shared_hbm", f"core_barrier data {data!r}: shared HBM")
    _meet(("barrier",), None, {0, 1})
