"""Backend registry. Native engines are imported lazily, only when asked for.

``load_backend("llama")`` imports llama-cpp-python on first use; if it is missing the caller
gets :class:`~modeld.errors.BackendUnavailableError` with the install command, never a silent
fallback to another backend.
"""

from __future__ import annotations

import importlib

from modeld.backends.base import Backend, Layout, LoadOptions, ModelRuntime, SyncStep, Vocab
from modeld.contract import BACKEND_TYPES
from modeld.errors import BackendUnavailableError, InvalidArgumentError

__all__ = ["Backend", "Layout", "LoadOptions", "ModelRuntime", "SyncStep", "Vocab", "load_backend"]

_MODULES: dict[str, tuple[str, str, str]] = {
    # name: (module, class, what to install)
    "memory": ("modeld.backends.memory", "MemoryBackend", ""),
    "llama": ("modeld.backends.llama", "LlamaBackend", "pip install 'modeld[llama]'"),
    "openvino": ("modeld.backends.openvino", "OpenVINOBackend", "pip install 'modeld[openvino]'"),
}


def load_backend(name: str) -> Backend:
    """The backend called ``name`` (one of ``memory``, ``llama``, ``openvino``)."""
    if name not in BACKEND_TYPES:
        raise InvalidArgumentError(
            f"unknown backend {name!r}; expected one of {', '.join(BACKEND_TYPES)}", field="type"
        )
    module_name, class_name, install = _MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the {name} backend is not available ({exc}); install it with: {install}",
            backend=name,
        ) from exc
    backend: Backend = getattr(module, class_name)()
    return backend
