"""One module of a package without the package's ``__init__``.

Two dependencies' packages import far more in their ``__init__`` than modeld uses of them:
``llama_cpp`` (modeld calls only its ctypes bindings, ``llama_cpp.llama_cpp``; the ``__init__``
adds the high-level ``Llama`` API: jinja2, diskcache, sqlite3) and ``gguf`` (modeld reads one
table, ``gguf.constants.GGML_QUANT_SIZES``; the ``__init__`` adds its reader and writer: numpy,
OpenBLAS, yaml). Measured: a worker's RSS 9 MiB lower with the bindings alone; the daemon's
``describe`` of a GGUF file loaded numpy, OpenBLAS and yaml for that table (80 ms of imports).

:func:`submodule` imports the module under a stand-in for its package that runs no
``__init__``, then takes the stand-in away, so a later ``import`` of the package (a test, a
program embedding modeld) gets the real one, which reuses the module already loaded. Where the
package is imported already, its module is used as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType

__all__ = ["submodule"]

_LOCK = threading.Lock()
"""One stand-in at a time: a second thread must never see it, nor have it taken away under it
(the daemon reads GGUF headers on several threads at once)."""


def submodule(package: str, name: str) -> ModuleType:
    """The module ``package.name``, its package's ``__init__`` not run (ImportError when missing)."""
    full = f"{package}.{name}"
    with _LOCK:
        loaded = sys.modules.get(full)
        if loaded is not None:
            return loaded
        if package in sys.modules:
            return importlib.import_module(full)
        spec = importlib.util.find_spec(package)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"No module named {package!r}")
        sys.modules[package] = importlib.util.module_from_spec(spec)  # its __init__ is not run
        try:
            return importlib.import_module(full)
        finally:
            del sys.modules[package]
