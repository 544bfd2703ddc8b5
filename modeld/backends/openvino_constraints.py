"""Constrained decoding and extra sampling parameters on OpenVINO GenAI (2026.4.1).

What: :func:`structured_output` maps a compiled constraint onto the
``GenerationConfig.structured_output_config`` of openvino-genai; :func:`apply_sampling` maps
the extra sampling fields of a :class:`~modeld.contract.DecodeConfig` onto a
``GenerationConfig``; :data:`SAMPLING` and :data:`CONSTRAINTS` are what the backend should
list in its :class:`~modeld.contract.Capabilities`.

Why the GBNF and not OpenVINO's own ``json_schema``/``regex`` fields: every backend then
enforces the same language (compact JSON, the same regex subset), and on the generated
random-weight TINY model OpenVINO's native ``json_schema`` (xgrammar, any whitespace allowed)
produced 0 of 5 parseable answers in 150 tokens (whitespace runs until the limit) while the
GBNF gave 5 of 5 valid ones. ``StructuredOutputConfig(grammar=...)`` takes GBNF text as is
(xgrammar's EBNF dialect).

What openvino-genai 2026.4.1 exposes (checked on the installed wheel):
``StructuredOutputConfig(json_schema | regex | grammar | structural_tags_config |
compound_grammar)``; ``GenerationConfig.presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logprobs`` (the number of top log-probabilities per token, read back
from the final result, not from the streamer: modeld does not list it). There is no logit
bias: ``logit_bias`` is refused as ``unsupported``.

What not: no generation loop (the backend owns it). OpenVINO enforces the grammar inside its
sampler, so the engine cannot see a dead end: the decode loop should run the constraint's byte
matcher over the output (``blueprints/0018``) and report ``constraint_failed`` if the model
stopped before the grammar was complete.
"""

from __future__ import annotations

from typing import Any

from modeld.contract import DecodeConfig
from modeld.decoding.constraints import CompiledConstraint
from modeld.errors import UnsupportedError

try:
    import openvino_genai as og
except ImportError as exc:  # pragma: no cover - the registry turns this into backend_unavailable
    raise ImportError(f"openvino-genai is not installed: {exc}") from exc

__all__ = ["CONSTRAINTS", "SAMPLING", "apply_sampling", "structured_output"]

CONSTRAINTS: tuple[str, ...] = (
    ("json", "json_schema", "regex", "grammar") if hasattr(og, "StructuredOutputConfig") else ()
)
SAMPLING: tuple[str, ...] = ("presence_penalty", "frequency_penalty")


def structured_output(compiled: CompiledConstraint) -> Any:
    """The ``StructuredOutputConfig`` that enforces ``compiled`` (its GBNF)."""
    if not CONSTRAINTS:
        raise UnsupportedError(
            f"openvino-genai {getattr(og, '__version__', '?')} has no structured output", field="constraint"
        )
    return og.StructuredOutputConfig(grammar=compiled.gbnf)


def apply_sampling(gen: Any, config: DecodeConfig, compiled: CompiledConstraint | None = None) -> Any:
    """Set the extra sampling fields (and the constraint, if any) on a ``GenerationConfig``."""
    if config.logit_bias:
        raise UnsupportedError("the OpenVINO backend cannot apply logit_bias", field="logit_bias")
    if config.presence_penalty:
        gen.presence_penalty = config.presence_penalty
    if config.frequency_penalty:
        gen.frequency_penalty = config.frequency_penalty
    if config.logprobs:
        raise UnsupportedError(
            "the OpenVINO backend cannot stream log-probabilities (its streamer sees token ids only)",
            field="logprobs",
        )
    if compiled is not None:
        gen.structured_output_config = structured_output(compiled)
    return gen
