"""The model names the HTTP endpoint serves: ``--model NAME=PATH``, ``--models-dir DIR``, or
the project's generated default models when none is registered: ``modeld-tiny`` (random
weights: real compute, garbage text that never ends by itself) and, on GGUF backends,
``modeld-reply`` (the same size, answering every chat turn briefly and ending it, which coding
agents need: ``modeld.testmodels.REPLY``).

A request's ``model`` field picks one by name; an unknown name is a 404. Clients see names
only, never paths: ``/v1/models`` lists names, and errors about a model name it. Paths are
resolved by the daemon when it starts (relative to its working directory) and checked to
exist, so a typo fails at ``serve``, not at the first request.

``--chat-template-file NAME=PATH`` renders the model served as NAME with the template in PATH
instead of its file's (llama-server's ``--chat-template-file``, per model): read once, when the
daemon starts (at most :data:`MAX_TEMPLATE_BYTES`), and sent with every session of that model
(``OpenSessionRequest.chat_template``).

``--alias PATTERN=MODEL`` (repeatable, first match wins) serves a name no model is registered
under that matches the glob PATTERN by MODEL, so an agent's default model names (Claude Code's
``claude-*``, Codex's ``gpt-*``) work with no client setting; the answer keeps the name the
client asked for, and ``/v1/models`` lists the patterns.

``--models-dir`` is read again when a name is not found (at most once a second), so a model
copied into the directory is served without a restart: GGUF files (``NAME.gguf``) for llama
and OpenVINO, IR directories (``NAME/openvino_model.xml``) for OpenVINO, any file for memory.
"""

from __future__ import annotations

import fnmatch
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL_NAME",
    "MAX_TEMPLATE_BYTES",
    "parse_template_option",
    "REPLY_MODEL_NAME",
    "MAX_NAME_CHARS",
    "ModelEntry",
    "ModelRegistry",
    "RegistryError",
    "default_model",
    "parse_alias",
]

DEFAULT_MODEL_NAME = "modeld-tiny"
REPLY_MODEL_NAME = "modeld-reply"
MAX_NAME_CHARS = 128
MAX_TEMPLATE_BYTES = 1 << 20
_RESCAN_SECONDS = 1.0


class RegistryError(ValueError):
    """A model registration the operator must fix (reported by ``serve``, exit 2)."""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    path: str
    created: int  # seconds since the epoch (the file's mtime), as /v1/models reports it
    chat_template: str = ""  # --chat-template-file's template ("": the model file's)
    template_file: str = ""  # where it was read from


def _check_name(name: str) -> str:
    if not name or len(name) > MAX_NAME_CHARS or any(c.isspace() or not c.isprintable() for c in name):
        raise RegistryError(
            f"model name {name[:MAX_NAME_CHARS]!r} must be 1-{MAX_NAME_CHARS} printable characters without spaces"
        )
    return name


def _created(path: Path) -> int:
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return int(time.time())


def parse_model_option(spec: str, backend: str) -> ModelEntry:
    """``NAME=PATH`` from the command line, with PATH resolved and checked."""
    name, sep, raw = spec.partition("=")
    if not sep or not raw:
        raise RegistryError(f"--model wants NAME=PATH, got {spec!r}")
    _check_name(name)
    path = Path(raw).expanduser()
    virtual = backend == "memory" and os.sep not in raw and not path.exists()
    if virtual:  # the memory backend's models are names
        return ModelEntry(name, raw, int(time.time()))
    if not path.exists():
        raise RegistryError(f"--model {name}={raw}: {raw} does not exist")
    return ModelEntry(name, str(path.resolve()), _created(path))


def parse_template_option(spec: str) -> tuple[str, str, str]:
    """``NAME=PATH`` of ``--chat-template-file``: (name, path, the template's text), read and
    checked (UTF-8, at most :data:`MAX_TEMPLATE_BYTES`, not empty)."""
    name, sep, raw = spec.partition("=")
    if not sep or not raw:
        raise RegistryError(f"--chat-template-file wants NAME=PATH, got {spec!r}")
    _check_name(name)
    path = Path(raw).expanduser()
    try:
        with path.open("rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise RegistryError(f"--chat-template-file {name}={raw}: {exc.strerror or exc}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise RegistryError(f"--chat-template-file {name}={raw}: larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RegistryError(f"--chat-template-file {name}={raw}: not UTF-8 text") from None
    if not text.strip():
        raise RegistryError(f"--chat-template-file {name}={raw}: the file is empty")
    return name, str(path.resolve()), text


def parse_alias(spec: str) -> tuple[str, str]:
    """``PATTERN=MODEL`` from the command line (a glob pattern, a model name)."""
    pattern, sep, target = spec.partition("=")
    if not sep or not pattern or not target:
        raise RegistryError(f"--alias wants PATTERN=MODEL (e.g. 'claude-*=modeld-reply'), got {spec!r}")
    if len(pattern) > MAX_NAME_CHARS or any(c.isspace() or not c.isprintable() for c in pattern):
        raise RegistryError(
            f"--alias pattern {pattern[:MAX_NAME_CHARS]!r} must be 1-{MAX_NAME_CHARS} printable characters without spaces"
        )
    return pattern, _check_name(target)


def _scan(directory: Path, backend: str) -> dict[str, ModelEntry]:
    found: dict[str, ModelEntry] = {}
    try:
        children = sorted(directory.iterdir())
    except OSError:
        return found
    for child in children:
        if child.name.startswith("."):
            continue
        if child.is_file() and (backend == "memory" or child.suffix == ".gguf"):
            name = child.stem if child.suffix == ".gguf" else child.name
        elif backend == "openvino" and (child / "openvino_model.xml").is_file():
            name = child.name
        else:
            continue
        if len(name) <= MAX_NAME_CHARS and name not in found:
            found[name] = ModelEntry(name, str(child.resolve()), _created(child))
    return found


def default_models(backend: str) -> tuple[ModelEntry, ...]:
    """The models served when none is registered: the project's generated tiny model and, on
    GGUF backends, the tiny model that answers and ends its turns (what agents need)."""
    if backend == "memory":
        return (ModelEntry(DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, int(time.time())),)
    try:
        from modeld.testmodels import REPLY, TINY, ensure_model
    except ImportError as exc:
        raise RegistryError(
            f"no model is registered (--model NAME=PATH or --models-dir DIR) and the generated "
            f"default models need the models extra ({exc.name} is missing)"
        ) from None
    tiny, reply = ensure_model(TINY), ensure_model(REPLY)
    return (
        ModelEntry(DEFAULT_MODEL_NAME, str(tiny), _created(tiny)),
        ModelEntry(REPLY_MODEL_NAME, str(reply), _created(reply)),
    )


def default_model(backend: str) -> ModelEntry:
    """The first default model (``modeld-tiny``)."""
    return default_models(backend)[0]


class ModelRegistry:
    """Names to model files. Thread-safe; the directory is rescanned on a miss."""

    def __init__(
        self,
        backend: str,
        models: Mapping[str, ModelEntry] | None = None,
        models_dir: Path | None = None,
        fallback: ModelEntry | tuple[ModelEntry, ...] | None = None,
        templates: Mapping[str, tuple[str, str]] | None = None,
        *,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.backend = backend
        self._templates = dict(templates or {})  # name -> (file, template): --chat-template-file
        self._explicit = dict(models or {})
        self._dir = models_dir.resolve() if models_dir is not None else None
        self._scanned: dict[str, ModelEntry] = {}
        self._scanned_at = 0.0
        fallbacks = (fallback,) if isinstance(fallback, ModelEntry) else (fallback or ())
        self._fallback = {e.name: e for e in fallbacks}
        self._lock = threading.Lock()
        if self._dir is not None:
            if not self._dir.is_dir():
                raise RegistryError(f"--models-dir {models_dir} is not a directory")
            self._rescan(force=True)
        if not self._explicit and self._dir is None and not self._fallback:
            raise RegistryError("no model is registered")
        self.aliases = tuple(parse_alias(spec) for spec in aliases)
        for pattern, target in self.aliases:
            if self._get(target) is None:
                raise RegistryError(f"--alias {pattern}={target}: no model is registered as {target}")

    def _rescan(self, *, force: bool = False) -> None:
        if self._dir is None:
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._scanned_at < _RESCAN_SECONDS:
                return
            self._scanned_at = now
        scanned = _scan(self._dir, self.backend)
        with self._lock:
            self._scanned = scanned

    def entries(self) -> list[ModelEntry]:
        self._rescan()
        with self._lock:
            merged = {**self._scanned, **self._explicit}
        if not merged:
            merged = dict(self._fallback)
        return sorted((self._templated(e) for e in merged.values()), key=lambda e: e.name)

    def _templated(self, entry: ModelEntry) -> ModelEntry:
        found = self._templates.get(entry.name)
        if found is None:
            return entry
        return replace(entry, template_file=found[0], chat_template=found[1])

    def name_of(self, path: str) -> str | None:
        """The name a model file is served under (the first by name when several name it), or
        None when none does: what ``Gateway.named`` gives a request that names no model, so
        ``/v1/models``, ``/api/tags``, ``/api/show`` and gRPC's Describe and sessions agree."""
        real = os.path.realpath(path) if path else path
        for entry in self.entries():
            if entry.path == path or (os.sep in entry.path and os.path.realpath(entry.path) == real):
                return entry.name
        return None

    def get(self, name: str) -> ModelEntry | None:
        """The model registered as ``name``, else the target of the first alias whose pattern
        matches it (None: neither)."""
        entry = self._get(name)
        if entry is not None:
            return entry
        for pattern, target in self.aliases:
            if fnmatch.fnmatchcase(name, pattern):
                return self._get(target)
        return None

    def _get(self, name: str) -> ModelEntry | None:
        with self._lock:
            entry = self._explicit.get(name) or self._scanned.get(name)
        if entry is None:
            self._rescan()
            with self._lock:
                entry = self._explicit.get(name) or self._scanned.get(name)
                empty = not self._explicit and not self._scanned
        else:
            empty = False
        if entry is None and empty:
            entry = self._fallback.get(name)
        return self._templated(entry) if entry is not None else None
