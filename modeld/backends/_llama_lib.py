"""llama-cpp-python's ctypes bindings alone, the way a worker loads llama.cpp.

modeld calls llama.cpp through ``llama_cpp.llama_cpp`` (the ctypes bindings) and nothing else of
llama-cpp-python: they are loaded without the package's ``__init__`` (``_lean``), 9 MiB less of
every worker's RSS (measured: ``maxrss`` after numpy, 12 MiB for ``import llama_cpp`` against 3
MiB for the bindings alone).

OpenMP is set up first (``_omp``): libgomp reads its environment once, when llama.cpp loads.
Use it as ``from modeld.backends._llama_lib import bindings as _llama``.
"""

from __future__ import annotations

import importlib.metadata
from types import ModuleType
from typing import TYPE_CHECKING

from modeld.backends import _omp  # noqa: F401 - OpenMP settings before llama.cpp loads
from modeld.backends._lean import submodule

__all__ = ["bindings", "load", "version"]


def load() -> ModuleType:
    """The module ``llama_cpp.llama_cpp`` (raises ImportError when llama-cpp-python is missing)."""
    return submodule("llama_cpp", "llama_cpp")


def version() -> str:
    """llama-cpp-python's version (the package's ``__version__``, from its metadata)."""
    return importlib.metadata.version("llama_cpp_python")


if TYPE_CHECKING:
    import llama_cpp.llama_cpp as bindings
else:
    try:
        bindings = load()
    except ImportError as exc:  # pragma: no cover - the registry turns this into backend_unavailable
        raise ImportError(f"llama-cpp-python is not installed: {exc}") from exc
