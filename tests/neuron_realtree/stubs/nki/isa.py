"""STUB (real-tree mode): replaces ``nki.isa`` (Neuron-only). Empty on purpose (see ``nki/language.py``)."""
