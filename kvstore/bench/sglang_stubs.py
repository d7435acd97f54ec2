"""Import stubs that let SGLang's HiCache modules import on a CPU-only machine
(the engine tests and `kvstore bench engines`; a real SGLang server needs none).

Only what cannot be installed in a working CPU form is stubbed:

* ``torchvision``: PyPI's wheel is a CUDA build that fails beside the CPU
  torch ("operator torchvision::nms does not exist"); SGLang imports it at
  module level for multimodal preprocessing, never on the HiCache path.
* ``triton``, when it is not installed (about 1 GB): ``sglang.srt.utils``
  imports it unconditionally; the HiCache storage path launches no kernel.

Call :func:`install` before the first ``import sglang``. A stub module
answers any attribute with another stub (classes for capitalised names),
so ``from torchvision.transforms import InterpolationMode`` and the like work.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

VERSIONS = {"torchvision": "0.28.0", "triton": "3.9.0"}
STUBBED: list[str] = []


class _StubMeta(type):
    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{cls.__module__}.{cls.__name__}.{attr}")


class _Stub(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        if full in sys.modules:
            return sys.modules[full]
        value: Any
        if attr[:1].isupper():
            value = _StubMeta(
                attr, (), {"__module__": self.__name__, "__init__": lambda s, *a, **k: None}
            )
        else:
            value = _Stub(full)
            sys.modules[full] = value
        setattr(self, attr, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator
        return lambda fn: fn


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = sys.modules.get(spec.name) or _Stub(spec.name)
        if "." not in spec.name:
            # transformers parses the version of a torchvision it finds.
            module.__version__ = VERSIONS.get(spec.name, "0.0.0")  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> Any:
        if fullname.split(".", 1)[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


def install(find: Callable[[str], Any] = importlib.util.find_spec) -> None:
    if "torchvision" not in STUBBED:
        STUBBED.append("torchvision")
    if "triton" not in STUBBED and "triton" not in sys.modules and find("triton") is None:
        STUBBED.append("triton")
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
