"""STUB (real-tree mode): replaces aws-neuron/nki-library ``nkilib.core.moe.moe_cte.moe_cte`` (NKI kernels: need
Neuron hardware). Only the name the read files import: ``MoECTEImplementation``, its members placeholders."""

from _placeholder import Placeholder

MoECTEImplementation = Placeholder("nkilib.core.moe.moe_cte.moe_cte.MoECTEImplementation")
