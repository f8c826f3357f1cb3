"""What SGLang 0.5.23 needs faked to import on a CPU host, each named; nothing else is faked.

- ``torchvision``: its wheel cannot load beside CPU torch 2.13, and SGLang's model configs
  import ``torchvision.transforms`` at import time (for InternVL's image constants) though the
  HiCache code never uses it. ``install_torchvision_stub`` puts an import-only stand-in on
  ``sys.meta_path``, after importing transformers' image modules so that transformers still
  sees no torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``torchvision.*`` module: empty, every attribute an empty class."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def __getattr__(name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

        module.__dict__["__getattr__"] = __getattr__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_torchvision_stub() -> None:
    """Make ``import torchvision.transforms`` work without torchvision (see above)."""
    if any(isinstance(finder, _TorchvisionStub) for finder in sys.meta_path):
        return
    import transformers.image_processing_utils
    import transformers.image_utils  # noqa: F401

    sys.meta_path.append(_TorchvisionStub())
