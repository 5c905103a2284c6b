"""Where the kernels get ``nki`` / ``nl`` / ``nisa``: AWS's NKI when a real one is importable, else the
project's CPU interpreter (:mod:`vllm_moe_w8.kernels.nki_cpu`).

PyPI's ``nki`` is an empty placeholder, so "importable" is not enough: a real NKI has ``nki.language``
with ``ndarray`` and ``nki.isa`` with ``nc_matmul``. Set ``VLLM_MOE_W8_NKI=interpreter`` to force the
interpreter even where NKI is installed (to compare the two).
"""

from __future__ import annotations

import importlib
import os


def _real_nki():
    """(module, reason): the real ``nki`` or None with the reason it is not used."""
    if os.environ.get("VLLM_MOE_W8_NKI", "").lower() == "interpreter":
        return None, "VLLM_MOE_W8_NKI=interpreter"
    try:
        mod = importlib.import_module("nki")
        language = importlib.import_module("nki.language")
        isa = importlib.import_module("nki.isa")
    except ImportError as exc:
        return None, f"AWS nki is not importable ({exc})"
    if not (hasattr(language, "ndarray") and hasattr(isa, "nc_matmul") and hasattr(mod, "jit")):
        return None, "the installed 'nki' is a placeholder without nki.language.ndarray / nki.isa.nc_matmul"
    return mod, "AWS nki " + str(getattr(mod, "__version__", "(version unknown)"))


_REAL, REASON = _real_nki()
if _REAL is not None:
    nki = _REAL
    nl = importlib.import_module("nki.language")
    nisa = importlib.import_module("nki.isa")
    BACKEND = "nki"
else:
    from . import nki_cpu as nki  # noqa: F401  (provides jit / simulate / language / isa)

    nl = nki.language
    nisa = nki.isa
    BACKEND = "interpreter"


def simulate(kernel):
    """``simulate(kernel)(*numpy_arrays)``: AWS's ``nki.simulate`` when real NKI is present, else the interpreter."""
    return nki.simulate(kernel)
