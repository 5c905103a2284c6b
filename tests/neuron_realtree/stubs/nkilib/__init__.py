"""STUB package marker (real-tree mode): see the modules below it."""
