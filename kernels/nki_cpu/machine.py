"""Memory of one NeuronCore-v3 program as the interpreter models it: storages, capacity, counters, the current program.

* A :class:`Storage` is the bytes behind tensors (:mod:`.tensor` builds the views) with a per-byte ``written`` mask:
  never-written bytes are garbage on the device; an engine computing on them reads AWS's simulator sentinels (NaN /
  4, counted in ``Stats.unwritten_reads``), DMA moves them as they are (the mask travels), and a kernel output returns
  them as ``0xFF`` bytes (:mod:`.runtime`).
* On-chip storage (SBUF/PSUM) has the partition dimension first, at most 128 partitions; a tile's logical layout is
  ``partition * row_bytes + byte in the partition``. Tiles the compiler places (``nl.ndarray`` without ``address``)
  get storage of their own and count against capacity over their live range, from allocation to last access (the
  compiler can reuse the space after; :meth:`Machine.check_capacity`, at the end of each program): SBUF 224 KiB per
  partition, PSUM 8 banks of 2 KiB, whole banks per tile. Tiles with an explicit ``address=(partition, byte)`` are
  views of the program's physical SBUF / PSUM (:data:`ADDRESS` rules), so two of them at one address alias.
* HBM: ``shared_hbm`` tensors a kernel allocates are one tensor for every program of the launch (matched by
  allocation order), ``private_hbm`` / ``hbm`` ones belong to the program that allocated them (:data:`PRIVATE`).
* PSUM storage carries a per-byte state since the tile was allocated (never written / written by another instruction /
  by a matmul) for ``nc_matmul``'s accumulate rules.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from . import dtypes as dt
from .rules import LANG, MIGRATION, TRN2, NkiValidationError, rule

PMAX = 128  # partitions
SBUF_BYTES_PER_PARTITION = 224 * 1024
PSUM_BANKS = 8
PSUM_BANK_BYTES = 2 * 1024
PSUM_BYTES_PER_PARTITION = PSUM_BANKS * PSUM_BANK_BYTES
ONCHIP = ("sbuf", "psum")
HBM = ("shared_hbm", "private_hbm")
BUFFERS = ONCHIP + HBM

PRIVATE = rule("MEM-PRIVATE-HBM", LANG, "private_hbm: HBM - Only visible to each individual kernel instance in the SPMD grid",
               "a private_hbm / hbm tensor belongs to the program that allocated it; another program cannot see it, "
               "and a grid of more than one program cannot return one as its output")
ADDRESS = rule("MEM-ADDRESS", MIGRATION, "The allocation for PSUM tensors must start at the beginning of each bank",
               "nl.ndarray(address=(partition, byte)) places the tile in the program's physical SBUF/PSUM (tiles at one "
               "address alias); a PSUM address must start a 2 KiB bank, and the tile must fit its partitions and bytes")
SBUF_SIZE = rule("MEM-SBUF-CAPACITY", TRN2, "NeuronCore-v3 SBUF capacity is **28MiB** (or, 128 partitions of 224KiB)",
                 "live compiler-placed SBUF tiles plus the bytes placed by address may not exceed 224 KiB per partition")
PSUM_SIZE = rule("MEM-PSUM-CAPACITY", MIGRATION, "Each partition is further divided into 8 PSUM banks, with each bank holding "
                 "up to 2KB worth of values", "a compiler-placed PSUM tile takes whole 2 KiB banks; at most 8 are live")


@dataclass
class Stats:
    """What one kernel run did. Counters are keyed by the instruction's shape; see cost.py."""

    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    dma_count: int = 0
    dma_runs: Counter = field(default_factory=Counter)  # contiguous HBM run bytes -> bytes moved
    matmuls: Counter = field(default_factory=Counter)  # (K, M, N, stationary dtype, moving dtype) -> count
    transposes: Counter = field(default_factory=Counter)  # (P, F, dtype) -> count (TensorE)
    engine_ops: Counter = field(default_factory=Counter)  # (engine, op, partitions, free elems) -> count
    peak_sbuf_bytes: int = 0  # per partition
    peak_psum_banks: int = 0
    # runtime-dependent features (dynamic.py; priced by cost_dynamic.py)
    indirect_dmas: Counter = field(default_factory=Counter)  # (scalar | vector, descriptors) -> DMAs
    register_loads: int = 0
    dynamic_loops: int = 0
    dynamic_iterations: int = 0
    hwdge_dmas: int = 0  # DMAs whose descriptors the hardware DGE writes (dge_mode=hwdge): no GpSimd time
    unwritten_reads: int = 0  # never-written elements an instruction computed on (garbage on the device)

    @property
    def matmul_count(self) -> int:
        return sum(self.matmuls.values())

    def engine_elements(self, engine: str) -> int:
        return sum(p * f * n for (e, _op, p, f), n in self.engine_ops.items() if e == engine)


class Storage:
    """The bytes of one tensor allocation. ``base`` and ``pitch``: where logical partition p starts in ``bytes``
    (``base + p * pitch``); ``row_bytes``: logical bytes per partition (on-chip) or the whole size (HBM)."""

    __slots__ = ("buffer", "bytes", "written", "mm", "base", "pitch", "row_bytes", "partitions", "name", "program",
                 "banks", "live_bytes", "machine", "free_base", "life")

    def __init__(self, buffer, nbytes_or_shape, name, machine=None, physical=None, base=0, pitch=0):
        self.buffer, self.name, self.machine = buffer, name, machine
        self.program = machine.program_id if machine is not None else None
        self.banks = self.live_bytes = 0
        self.life = None  # [allocation tick, last access tick] of a compiler-placed tile
        if buffer in ONCHIP:
            partitions, row_bytes = nbytes_or_shape
            self.partitions, self.row_bytes = int(partitions), int(row_bytes)
        else:
            self.partitions, self.row_bytes = 1, int(nbytes_or_shape)
        if physical is None:
            self.bytes = np.zeros(self.partitions * self.row_bytes, dtype=np.uint8)
            self.written = np.zeros(self.bytes.size, dtype=bool)
            self.base, self.pitch, self.free_base = 0, self.row_bytes, 0
        else:  # a view of the program's physical SBUF / PSUM (explicit address)
            self.bytes, self.written = physical
            self.base, self.pitch, self.free_base = int(base), int(pitch), int(base) % int(pitch)
        self.mm = np.zeros(self.partitions * self.row_bytes, dtype=np.uint8) if buffer == "psum" else None

    @property
    def onchip(self) -> bool:
        return self.buffer in ONCHIP


class Launch:
    """State shared by the programs of one launch: the shared HBM tensors (by allocation order)."""

    def __init__(self, n: int):
        self.num_programs = n
        self.grid_ndim = 1  # 0 when the kernel was called without a grid (nl.program_ndim)
        self.shared_hbm: list = []
        self.lock = threading.Lock()
        self.spmd = None  # runtime.Spmd for n > 1


class Machine:
    """One program (logical core) of a launch: its counters, live on-chip capacity, physical SBUF/PSUM for tiles
    placed by address, ScalarE's accumulator registers and its private HBM."""

    def __init__(self, program_id: int = 0, num_programs: int = 1, launch: Launch | None = None):
        self.stats = Stats()
        self.sbuf_bytes = 0
        self.psum_banks = 0
        self.program_id = program_id
        self.num_programs = num_programs
        self.launch = launch or Launch(num_programs)
        self.hbm_allocations = 0
        self.physical: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.manual_sbuf_end = 0  # highest byte per partition used by address-placed SBUF tiles
        self.reduce_regs = None  # ScalarE accumulators (activation reduce_cmd), 128 fp32 values once used
        self.tick = 0  # accesses so far (the order live ranges are measured in)
        self.lifetimes: list = []  # (buffer, bytes per partition | banks, [first, last] tick, name) per placed tile
        self.rng_state = None

    # --- compiler-placed tiles -----------------------------------------------------------------------------
    def allocate(self, s: Storage) -> None:
        """A compiler-placed tile: it is live from its allocation to its last access (:meth:`check_capacity`)."""
        self.tick += 1
        if s.buffer == "sbuf":
            SBUF_SIZE.check(s.row_bytes + self.manual_sbuf_end <= SBUF_BYTES_PER_PARTITION,
                            f"SBUF overflow allocating {s.name!r}: {s.row_bytes} B/partition (+ {self.manual_sbuf_end} B placed "
                            f"by address) exceeds {SBUF_BYTES_PER_PARTITION} B per partition")
            s.live_bytes = s.row_bytes
        elif s.buffer == "psum":
            s.banks = math.ceil(s.row_bytes / PSUM_BANK_BYTES)
            PSUM_SIZE.check(s.banks <= PSUM_BANKS, f"PSUM overflow allocating {s.name!r}: {s.banks} banks of 2 KiB/partition")
        s.life = [self.tick, self.tick]
        self.lifetimes.append((s.buffer, s.live_bytes or s.banks, s.life, s.name))

    def touch(self, s: Storage) -> None:
        self.tick += 1
        s.life[1] = self.tick

    def check_capacity(self) -> None:
        """The compiler places a tile for its live range (allocation to last access; it can reuse the space after):
        the tiles live at once may not exceed SBUF's 224 KiB (beside the bytes placed by address) or PSUM's 8 banks
        per partition. Sets ``Stats.peak_sbuf_bytes`` / ``peak_psum_banks``."""
        for buffer, limit, used, rule_ in (("sbuf", SBUF_BYTES_PER_PARTITION - self.manual_sbuf_end, self.manual_sbuf_end, SBUF_SIZE),
                                           ("psum", PSUM_BANKS, 0, PSUM_SIZE)):
            events = []
            for buf, amount, (start, end), name in self.lifetimes:
                if buf == buffer:
                    events += [(start, 0, amount, name), (end, 1, -amount, name)]
            live, peak, at, names = 0, 0, 0, {}
            for tick, _order, amount, name in sorted(events):
                live += amount
                if amount > 0:
                    names[name] = amount
                else:
                    names.pop(name, None)
                if live > peak:
                    peak, at = live, tick
                    if live > limit:
                        unit = "B per partition" if buffer == "sbuf" else "banks"
                        raise rule_.error(f"{buffer.upper()} overflow: tiles live together need {live} {unit} (limit {limit}"
                                          f"{' beside ' + str(used) + ' B placed by address' if used else ''}): "
                                          f"{', '.join(sorted(names))[:300]}")
            if buffer == "sbuf":
                self.stats.peak_sbuf_bytes = max(self.stats.peak_sbuf_bytes, peak + self.manual_sbuf_end)
            else:
                self.stats.peak_psum_banks = max(self.stats.peak_psum_banks, peak)

    # --- address-placed tiles ----------------------------------------------------------------------------
    def place(self, buffer: str, partitions: int, row_bytes: int, address, name: str) -> Storage:
        try:
            p0, b0 = (int(a) for a in address)
        except (TypeError, ValueError):
            raise ADDRESS.error(f"nl.ndarray {name!r}: address={address!r} must be (partition_offset, byte_offset)") from None
        pitch = SBUF_BYTES_PER_PARTITION if buffer == "sbuf" else PSUM_BYTES_PER_PARTITION
        ADDRESS.check(buffer in ONCHIP, f"nl.ndarray {name!r}: address= places on-chip tiles only (buffer {buffer})")
        ADDRESS.check(0 <= p0 and p0 + partitions <= PMAX, f"nl.ndarray {name!r}: partitions {p0}..{p0 + partitions} outside 0..{PMAX}")
        ADDRESS.check(0 <= b0 and b0 + row_bytes <= pitch,
                      f"nl.ndarray {name!r}: bytes {b0}..{b0 + row_bytes} per partition outside the {pitch} B of {buffer}")
        if buffer == "psum":
            ADDRESS.check(b0 % PSUM_BANK_BYTES == 0, f"PSUM tile {name!r} at byte {b0}: it must start a 2 KiB bank")
        if buffer not in self.physical:
            self.physical[buffer] = (np.zeros(PMAX * pitch, dtype=np.uint8), np.zeros(PMAX * pitch, dtype=bool))
        if buffer == "sbuf":
            self.manual_sbuf_end = max(self.manual_sbuf_end, b0 + row_bytes)
        return Storage(buffer, (partitions, row_bytes), name, None, self.physical[buffer], p0 * pitch + b0, pitch)


_LOCAL = threading.local()


def current() -> Machine:
    m = getattr(_LOCAL, "machine", None)
    if m is None:
        raise NkiValidationError("NKI operations run only inside a kernel launched by nki_cpu.simulate / nki_cpu.run")
    return m


def active() -> Machine | None:
    """This thread's running program, if a kernel is running."""
    return getattr(_LOCAL, "machine", None)


def enter(m: Machine | None) -> Machine | None:
    """Make ``m`` this thread's current program; returns the previous one."""
    prev = getattr(_LOCAL, "machine", None)
    _LOCAL.machine = m
    return prev


def storage_for(buffer: str, shape: tuple, dtype: dt.Dtype, name: str, address=None) -> Storage:
    """Storage for ``nl.ndarray(shape, dtype, buffer, address=...)``."""
    m = current()
    if buffer in ONCHIP:
        partitions = shape[0]
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        if address is not None:
            return m.place(buffer, partitions, row, address, name)
        s = Storage(buffer, (partitions, row), name, m)
        m.allocate(s)
        return s
    if address is not None:
        raise ADDRESS.error(f"nl.ndarray {name!r}: address= places on-chip tiles only, not {buffer}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if buffer == "private_hbm":
        return Storage(buffer, nbytes, name, m)
    launch = m.launch
    with launch.lock:
        index = m.hbm_allocations
        m.hbm_allocations += 1
        if index < len(launch.shared_hbm):
            s, shp, dty = launch.shared_hbm[index]
            if shp != shape or dty is not dtype:
                raise NkiValidationError(
                    f"program {m.program_id} allocates shared HBM tensor #{index} {name!r} as {shape} {dtype}, but another "
                    f"program allocated {shp} {dty}: the programs of one launch must allocate their shared outputs identically")
            return s
        s = Storage(buffer, nbytes, name, None)
        launch.shared_hbm.append((s, shape, dtype))
        return s


def input_storage(array: np.ndarray, name: str) -> Storage:
    """A kernel argument: shared HBM, every byte written."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    s = Storage("shared_hbm", raw.size, name, None)
    s.bytes[...] = raw
    s.written[...] = True
    return s
