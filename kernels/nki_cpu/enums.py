"""The enumerations of ``nki.isa`` as aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py`` declares them (same
members, same values): instructions compare their arguments against these members."""

from __future__ import annotations

import functools
from enum import Enum


class engine(Enum):  # noqa: N801
    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


class reduce_cmd(Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


@functools.total_ordering
class nc_version(Enum):  # noqa: N801  (ordered: nki-library compares get_nc_version() >= nc_version.gen3)
    gen2 = 2
    gen3 = 3
    gen4 = 4

    def __lt__(self, other):
        if not isinstance(other, nc_version):
            return NotImplemented
        return self.value < other.value


class dma_engine(Enum):  # noqa: N801
    dma = 1
    gpsimd_dma = 2


def coerce(enum_cls, value):
    """A member of ``enum_cls`` given the member or its value (nki-library passes e.g. ``dge_mode=3``); None and
    unknown values are returned as they are, for the caller to judge."""
    if value is None or isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except (ValueError, TypeError):
        return value


def engine_name(eng) -> str:
    """An engine argument (member, its value, its name, or None) as a name."""
    eng = coerce(engine, eng)
    if isinstance(eng, engine):
        return eng.name
    return "unknown" if eng is None else str(eng)
