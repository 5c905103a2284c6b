"""STUB (real-tree mode): replaces ``nkilib.core.utils.tensor_view`` (used inside NKI kernels only)."""

from _placeholder import Placeholder

TensorView = Placeholder("nkilib.core.utils.tensor_view.TensorView")
