"""Test/dev environment fix (installed by scripts/setup_cpu_env.sh, never part of the plugin).

PyPI's torchvision wheel is a CUDA build: its C extension cannot load beside CPU-only torch, and
``import torchvision`` then fails on its fake registrations for ``torchvision::nms``. vLLM's Qwen3.5
model code imports ``torchvision.transforms.v2`` (pure Python) unconditionally. This finder waits for
the first ``import torchvision``, removes itself, and defines the two operator schemas so that the
pure-Python parts import. Torch is not imported at interpreter start.
"""
import importlib.abc
import sys

_LIBRARY = []  # keeps the torch.library.Library alive


class _TorchvisionSchemaFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "DEF")
        for name in ("nms", "qnms"):
            try:
                lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:  # already defined (a real extension loaded): leave it alone
                pass
        _LIBRARY.append(lib)
        return None  # let the normal machinery import torchvision


sys.meta_path.insert(0, _TorchvisionSchemaFinder())
