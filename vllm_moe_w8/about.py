"""The package's identity: its version and the name of the quantization method it registers with vLLM.

A leaf (imports nothing), so every room can import it without importing the package's ``__init__``,
which lazily imports the vLLM glue to register it.
"""

__version__ = "0.1.0"

QUANTIZATION_NAME = "neuron-w8"
