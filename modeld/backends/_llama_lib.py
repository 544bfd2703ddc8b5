"""llama-cpp-python's ctypes bindings alone, the way a worker loads llama.cpp.

modeld calls llama.cpp through ``llama_cpp.llama_cpp`` (the ctypes bindings) and nothing else of
llama-cpp-python. Importing the package runs its ``__init__``, which also imports the high-level
API (``Llama``, its chat formats and caches: jinja2, diskcache, sqlite3 and more): 9 MiB of every
worker's RSS that nothing uses (measured: ``maxrss`` after numpy, 12 MiB for ``import
llama_cpp`` against 3 MiB for the bindings alone). :func:`load` imports the bindings under a
stand-in for the package that runs no ``__init__``, then takes the stand-in away, so a later
``import llama_cpp`` (a test, a program embedding modeld) gets the real package, which reuses
the loaded bindings. Where the package is imported already, its bindings are used as they are.

OpenMP is set up first (``_omp``): libgomp reads its environment once, when llama.cpp loads.
Use it as ``from modeld.backends._llama_lib import bindings as _llama``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from modeld.backends import _omp  # noqa: F401 - OpenMP settings before llama.cpp loads

__all__ = ["bindings", "load", "version"]


def load() -> ModuleType:
    """The module ``llama_cpp.llama_cpp`` (raises ImportError when llama-cpp-python is missing)."""
    loaded = sys.modules.get("llama_cpp.llama_cpp")
    if loaded is not None:
        return loaded
    if "llama_cpp" in sys.modules:
        return importlib.import_module("llama_cpp.llama_cpp")
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("No module named 'llama_cpp'")
    sys.modules["llama_cpp"] = importlib.util.module_from_spec(spec)  # its __init__ is not run
    try:
        return importlib.import_module("llama_cpp.llama_cpp")
    finally:
        del sys.modules["llama_cpp"]


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
