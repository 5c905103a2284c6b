"""STUB (real-tree mode): replaces ``nkilib.core.router_topk.router_topk`` (an NKI kernel: needs Neuron hardware)."""

from _placeholder import Placeholder

router_topk = Placeholder("nkilib.core.router_topk.router_topk.router_topk")
