"""STUB (real-tree mode): replaces ``nki.language`` (Neuron-only). Empty on purpose: the read files touch ``nl.*`` only
inside NKI kernel bodies, which never run here, and an ``nki`` without ``nki.language.ndarray`` is what the project's
kernels (``kernels/nki_api.py``) recognise as "no real NKI", so they keep running in the project's interpreter."""
