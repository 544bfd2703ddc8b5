"""Compiling a :class:`~modeld.contract.Constraint` once: validation, GBNF, a cache by digest.

What: :func:`compile_constraint` checks a constraint (``invalid_argument`` with the position of
the error, ``unsupported`` for what cannot be enforced), turns it into GBNF text (one grammar
for every backend: see :mod:`modeld.decoding.gbnf`) and parses that into a :class:`Grammar`.
The result is cached by the constraint's digest (xxh3-128 of kind and value), so a tool-call
schema sent every turn is compiled once per process.

Backends use the result as follows (``blueprints/0018-constraints-and-tool-calls.md``):

* memory: ``compiled.byte_matcher()`` (exact, pure Python);
* llama.cpp: :mod:`modeld.backends.llama_constraints` (llguidance over ``compiled.gbnf``, or
  llama.cpp's grammar sampler);
* OpenVINO: :mod:`modeld.backends.openvino_constraints` (``StructuredOutputConfig``).

What not: no native imports, no sampling; a constraint's state during a decode lives in a
matcher owned by the decode, never here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from modeld.contract import CONSTRAINT_KINDS, Constraint, DecodeConfig
from modeld.decoding.gbnf import parse_gbnf
from modeld.decoding.gbnf_match import ByteMatcher, Grammar
from modeld.decoding.regex import regex_gbnf
from modeld.decoding.schema import json_object_gbnf, load_schema, schema_to_gbnf
from modeld.errors import InvalidArgumentError, LimitExceededError
from modeld.manifest import bytes_hash

__all__ = [
    "CompiledConstraint",
    "ConstraintFailed",
    "cache_info",
    "check_constraint",
    "compile_constraint",
    "constraint_digest",
    "runtime_constraint",
]

_CACHE_SIZE = 128


class ConstraintFailed(Exception):  # noqa: N818 - a control-flow signal, like Interrupted
    """Raised by a backend's decode when the constraint can no longer be satisfied (no token is
    allowed, or the chosen one was refused). The decode loop ends with ``constraint_failed``."""


_FIELD = "constraint.value"


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A validated constraint. ``gbnf`` is the grammar all backends enforce; ``schema`` the
    parsed JSON schema (``json_schema`` kind), so callers can validate a result if they wish."""

    kind: str
    value: str
    digest: str
    gbnf: str
    grammar: Grammar = field(repr=False)
    schema: Any = field(default=None, repr=False)

    def byte_matcher(self) -> ByteMatcher:
        """A fresh matcher over output bytes (one per decode; not thread-safe)."""
        return self.grammar.byte_matcher()


def constraint_digest(constraint: Constraint) -> str:
    return bytes_hash(f"modeld.constraint.v1\0{constraint.kind}\0{constraint.value}")


_cache: OrderedDict[str, CompiledConstraint] = OrderedDict()
_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0}


def cache_info() -> dict[str, int]:
    """Hits, misses and size of the compile cache (for status views and tests)."""
    with _lock:
        return {**_stats, "size": len(_cache)}


def runtime_constraint(config: DecodeConfig) -> CompiledConstraint | None:
    """What a runtime enforces for ``config`` (worker side): the daemon sends the compiled
    GBNF as ``Constraint("grammar", gbnf)`` (``DecodePlan.engine_config``); it is parsed once
    per digest in this process. No size limit here: the daemon made the text."""
    if config.constraint is None:
        return None
    return compile_constraint(config.constraint, max_bytes=None)


def check_constraint(constraint: object) -> None:
    """A :class:`~modeld.contract.Constraint` of a known kind, or ``invalid_argument``."""
    if not isinstance(constraint, Constraint):
        raise InvalidArgumentError("constraint must be a Constraint", field="constraint")
    if constraint.kind not in CONSTRAINT_KINDS:
        raise InvalidArgumentError(
            f"constraint.kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {constraint.kind!r}",
            field="constraint.kind",
        )


def compile_constraint(constraint: Constraint, *, max_bytes: int | None = None) -> CompiledConstraint:
    """Validate and compile (or fetch from the cache). Raises InvalidArgumentError,
    UnsupportedError or LimitExceededError; never anything else for bad input. ``max_bytes``:
    the largest constraint text (the daemon's ``Limits.max_constraint_bytes``; None: a text the
    daemon made itself)."""
    check_constraint(constraint)
    if not isinstance(constraint.value, str):
        raise InvalidArgumentError("constraint.value must be a string", field=_FIELD)
    size = len(constraint.value.encode("utf-8", errors="surrogatepass"))
    if max_bytes is not None and size > max_bytes:
        raise LimitExceededError(
            f"constraint.value is {size} bytes; the limit is {max_bytes} (modeld serve --max-constraint-bytes)",
            limit="max_constraint_bytes",
            value=size,
            maximum=max_bytes,
        )
    digest = constraint_digest(constraint)
    with _lock:
        hit = _cache.get(digest)
        if hit is not None:
            _cache.move_to_end(digest)
            _stats["hits"] += 1
            return hit
        _stats["misses"] += 1
    compiled = _compile(constraint, digest)
    with _lock:
        _cache[digest] = compiled
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return compiled


def _compile(constraint: Constraint, digest: str) -> CompiledConstraint:
    kind, value = constraint.kind, constraint.value
    schema: Any = None
    if kind == "json":
        if value:
            raise InvalidArgumentError(
                "constraint kind 'json' takes no value (use 'json_schema' for a schema)", field=_FIELD
            )
        text = json_object_gbnf()
    elif kind == "json_schema":
        schema = load_schema(value)
        text = schema_to_gbnf(schema)
    elif kind == "regex":
        text = regex_gbnf(value)
    else:
        if not value.strip():
            raise InvalidArgumentError("the grammar is empty", field=_FIELD)
        text = value
    grammar = parse_gbnf(text)
    return CompiledConstraint(
        kind=kind, value=value, digest=digest, gbnf=text, grammar=grammar, schema=schema
    )
