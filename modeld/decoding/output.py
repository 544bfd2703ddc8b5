"""One decode's plan and output handling: the constraint to enforce, tool calls, signals, the guard.

What: :func:`plan_decode` resolves a :class:`~modeld.contract.DecodeConfig` against the model
(its chat template, the prefix's tools) into a :class:`DecodePlan`: the compiled constraint to
enforce (the caller's, or the one that forces a tool call), the tools, the exit tools and the
tool-call format. :class:`OutputProcessor` is fed the decode's text deltas (after stop strings)
and says what to emit and when to stop; :meth:`OutputProcessor.finish` gives the final chunk's
fields. The decode loop calls nothing else from :mod:`modeld.decoding`.

Finish reasons it decides (``modeld.contract.FINISH_REASONS``): ``repeated_line`` (the guard),
``signal`` (an exit tool was called; at once with ``stop_on_signal``), ``malformed_tool_call``
(its raw text becomes the text), ``tool_calls``, and ``constraint_failed`` when the model
stopped while the constraint was not complete (a check on the text, so it also covers
backends that enforce the grammar inside their own sampler, like OpenVINO).

What not: no tokens, no sampling, no engine state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from modeld.contract import TOOL_CHOICES, TOOL_FORMATS, Constraint, DecodeConfig, ToolCall, ToolCallDelta
from modeld.decoding.constraints import CompiledConstraint, compile_constraint
from modeld.decoding.formats import make_parser
from modeld.decoding.gbnf_match import ByteMatcher
from modeld.decoding.guard import RepeatedLineGuard
from modeld.decoding.reasoning import ReasoningFormat, ReasoningGate, detect_reasoning
from modeld.decoding.toolcalls import ParseStep, ToolCallParser
from modeld.decoding.tools import (
    DEFAULT_FORMAT,
    ToolSpec,
    detect_format,
    forced_call_constraint,
    parse_tools,
)
from modeld.errors import InvalidArgumentError

__all__ = ["DecodePlan", "OutputFinal", "OutputProcessor", "OutputStep", "plan_decode"]


@dataclass(frozen=True)
class DecodePlan:
    """What a decode enforces and parses. ``constraint`` is None for free text."""

    constraint: CompiledConstraint | None
    tools: tuple[ToolSpec, ...] = ()
    exit_tools: tuple[ToolSpec, ...] = ()
    tool_format: str = ""  # "" = no tool-call parsing
    forced: bool = False  # the constraint forces a tool call
    reasoning: ReasoningFormat | None = None  # the template's thinking markup
    opened: str = ""  # the opener of a thinking block the prompt ended inside ("" = none)

    def engine_config(self, config: DecodeConfig) -> DecodeConfig:
        """``config`` as the engine gets it: the constraint compiled to its GBNF (kind
        ``grammar``), which the worker parses once per digest (``runtime_constraint``)."""
        wanted = Constraint("grammar", self.constraint.gbnf) if self.constraint is not None else None
        return config if wanted == config.constraint else replace(config, constraint=wanted)


def plan_decode(
    config: DecodeConfig,
    *,
    prefix_tools_json: str = "",
    chat_template: str = "",
    model_format: str = "",
    prompt_tail: str = "",
    max_tools: int | None = None,
    max_constraint_bytes: int | None = None,
) -> DecodePlan:
    """Resolve and validate the decode's constraint and tools (``invalid_argument`` /
    ``unsupported`` / ``limit_exceeded`` before anything runs). Compiling is cached by digest.
    The tool-call format: the decode's ``tool_format``, else the model's (``model_format``, an
    override or what describe recognised), else recognised from ``chat_template``. The thinking
    markup comes from ``chat_template``; ``prompt_tail`` (the rendered prompt's last characters)
    says whether the prompt opened a thinking block. ``max_tools``, ``max_constraint_bytes``:
    the daemon's limits (None: unbounded)."""
    choice = config.tool_choice
    if not isinstance(choice, str) or not choice:
        raise InvalidArgumentError(
            "tool_choice must be auto, none, required or a tool's name", field="tool_choice"
        )
    if config.tool_format not in TOOL_FORMATS:
        raise InvalidArgumentError(
            f"tool_format must be one of {', '.join(repr(f) for f in TOOL_FORMATS)}, got {config.tool_format!r}",
            field="tool_format",
        )
    tools, exits = _tools(config.tools_json or prefix_tools_json, config.exit_tools_json, max_tools)
    every = [*tools, *exits]
    fmt = config.tool_format or model_format or detect_format(chat_template)
    reasoning = detect_reasoning(chat_template) if chat_template else None
    opened = reasoning.opened_by(prompt_tail) if reasoning is not None else ""
    if fmt == "none" or choice == "none" or not every:
        fmt = ""
    elif not fmt:
        fmt = DEFAULT_FORMAT
    forced = choice not in ("auto", "none")
    if forced and choice not in TOOL_CHOICES and choice not in {t.name for t in every}:
        forced_call_constraint(every, choice, fmt)  # raises the precise error
    if forced and config.constraint is not None:
        raise InvalidArgumentError(
            "a constraint and a forced tool_choice cannot be combined (forcing a call is a constraint)",
            field="tool_choice",
        )
    if forced and config.tool_format == "none":
        raise InvalidArgumentError(
            "tool_choice forces a call, but tool_format is 'none'", field="tool_choice"
        )
    compiled: CompiledConstraint | None = None
    if forced:
        after = reasoning.close + "\n\n" if reasoning is not None and opened else ""
        compiled = compile_constraint(
            _forced(config.tools_json or prefix_tools_json, config.exit_tools_json, choice, fmt, after),
            max_bytes=max_constraint_bytes,
        )
    elif config.constraint is not None:
        compiled = compile_constraint(config.constraint, max_bytes=max_constraint_bytes)
    return DecodePlan(compiled, tools, exits, fmt, forced, reasoning, opened)


@functools.lru_cache(maxsize=64)
def _tools(
    tools_json: str, exit_tools_json: str, limit: int | None
) -> tuple[tuple[ToolSpec, ...], tuple[ToolSpec, ...]]:
    """Parsed tools and exit tools (cached: the same definitions come every turn)."""
    tools = parse_tools(tools_json, field="tools_json", limit=limit)
    exits = parse_tools(exit_tools_json, field="exit_tools_json", exit=True, limit=limit)
    exit_names = {t.name for t in exits}
    # An exit tool also listed among the tools (so the template showed it) is an exit tool.
    return tuple(t for t in tools if t.name not in exit_names), tuple(exits)


@functools.lru_cache(maxsize=64)
def _forced(tools_json: str, exit_tools_json: str, choice: str, fmt: str, after: str) -> Constraint:
    """The forcing grammar, built once per tool set, choice and format (then compiled by digest).
    ``after``: the close of a thinking block the prompt opened (the call follows it at once)."""
    tools, exits = _tools(tools_json, exit_tools_json, None)  # counted by plan_decode already
    return forced_call_constraint([*tools, *exits], choice, fmt, after=after)


@dataclass
class OutputStep:
    """What to emit for one text delta. ``stop``: a finish reason that ends the decode now."""

    text: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)
    stop: str | None = None


@dataclass
class OutputFinal:
    """The final chunk's fields (text still to emit, calls, signal, finish reason)."""

    text: str
    finish_reason: str
    tool_calls: tuple[ToolCall, ...] = ()
    signal: ToolCall | None = None
    deltas: list[ToolCallDelta] = field(default_factory=list)
    tool_text: str = ""  # the calls' raw text (StreamChunk.tool_text)


class OutputProcessor:
    """Per decode: tool-call parsing, signals, the repeated-line guard, the constraint check."""

    def __init__(self, config: DecodeConfig, plan: DecodePlan) -> None:
        self._plan = plan
        self._stop_on_signal = config.stop_on_signal
        self._guard = RepeatedLineGuard(config.repeated_line_min_chars, config.repeated_line_max)
        schemas = {t.name: t.parameters for t in (*plan.tools, *plan.exit_tools)}
        self._parser: ToolCallParser | None = (
            make_parser(plan.tool_format, schemas) if plan.tool_format else None
        )
        # Markup inside a thinking block is never a call (harmony's parser knows its channels).
        self._gate: ReasoningGate | None = (
            ReasoningGate(plan.reasoning)
            if self._parser is not None and plan.reasoning is not None and plan.tool_format != "harmony"
            else None
        )
        self._opener = plan.opened  # shown first: the prompt opened the thinking block
        self._verify: ByteMatcher | None = plan.constraint.byte_matcher() if plan.constraint else None
        self._known = {t.name for t in (*plan.tools, *plan.exit_tools)}
        self._exits = {t.name for t in plan.exit_tools}
        self._stopped: str | None = None
        self._signal: ToolCall | None = None
        self._malformed = ""

    def _shown(self, text: str) -> str:
        """``text`` after the opener of a thinking block the prompt opened (once): the output is
        then the assistant turn whole, its thinking marked as the model's own would be."""
        if self._opener:
            text, self._opener = self._opener + text, ""
        return text

    def _parse(self, text: str, *, final: bool = False, cut: bool = False) -> ParseStep:
        """The parser's step for ``text``, thinking passed through unparsed (the gate's pieces)."""
        parser = self._parser
        assert parser is not None
        if self._gate is None:
            return parser.finish(cut=cut) if final else parser.feed(text)
        out = ParseStep()
        for piece, thinking in self._gate.feed(text, final=final):
            if thinking:
                out.text += piece
                continue
            got = parser.feed(piece)
            out.text += got.text
            out.deltas += got.deltas
            out.completed += got.completed
            if got.malformed:
                out.malformed = got.malformed
                return out
        if final:
            got = parser.finish(cut=cut)
            out.text += got.text
            out.deltas += got.deltas
            out.completed += got.completed
            out.malformed = got.malformed
        return out

    def feed(self, text: str) -> OutputStep:
        step = OutputStep()
        if self._stopped is not None or not text:
            return step
        if self._verify is not None:
            self._verify.advance_bytes(text.encode("utf-8"))
        if self._guard.feed(text):
            step.stop = self._stopped = "repeated_line"
        text = self._shown(text)
        if self._parser is None:
            step.text = text
            return step
        parsed = self._parse(text)
        step.text, step.deltas = parsed.text, parsed.deltas
        if parsed.malformed:
            self._malformed = parsed.malformed
            step.stop = self._stopped = "malformed_tool_call"
            return step
        for call in parsed.completed:
            if self._known and call.name not in self._known:
                self._malformed = f"the model called {call.name!r}, which is not one of the tools"
                step.stop = self._stopped = "malformed_tool_call"
                return step
            if call.name in self._exits and self._signal is None:
                self._signal = call
                if self._stop_on_signal:
                    step.stop = self._stopped = "signal"
        return step

    def finish(self, finish_reason: str) -> OutputFinal:
        """``finish_reason``: why generation ended (stop, length, stop_sequence, canceled, error,
        or the ``stop`` of a step). Returns what the final chunk carries."""
        lead = self._shown("")  # nothing was generated: the opener still belongs to the turn
        final = self._finish(finish_reason)
        if lead:
            final.text = lead + final.text
        return final

    def _finish(self, finish_reason: str) -> OutputFinal:
        text = ""
        deltas: list[ToolCallDelta] = []
        calls: tuple[ToolCall, ...] = ()
        reason = finish_reason
        parser = self._parser
        if finish_reason in ("canceled", "error"):
            # Not the model's doing: keep the reason; what was held back is shown as it was.
            rest = self._parse("", final=True) if parser is not None and self._stopped is None else None
            held = (rest.text if rest else "") + (
                parser.raw if parser is not None and rest and rest.malformed else ""
            )
            return OutputFinal(held, finish_reason, tuple(parser.calls) if parser else (), self._signal, [])
        if parser is not None:
            if self._stopped is None:
                open_call = parser.open_call()
                rest = self._parse("", final=True, cut=finish_reason == "length")
                text, deltas = rest.text, rest.deltas
                if rest.malformed and finish_reason == "length":
                    # Cut off inside a call: the call as far as it got, still a call (its
                    # markup never becomes content); the finish reason stays length.
                    partial = parser.cut_off(open_call) if open_call else None
                    done = tuple(c for c in parser.calls if c.name not in self._exits)
                    if partial is None:
                        return OutputFinal(text, "length", done, self._signal, deltas, parser.raw)
                    call, more = partial
                    return OutputFinal(
                        text, "length", (*done, call), self._signal, [*deltas, *more], parser.raw
                    )
                elif rest.malformed:
                    self._malformed = rest.malformed
                    reason = "malformed_tool_call"
                else:
                    for call in rest.completed:
                        if self._known and call.name not in self._known:
                            self._malformed = f"the model called {call.name!r}, which is not one of the tools"
                            reason = "malformed_tool_call"
                        elif call.name in self._exits and self._signal is None:
                            self._signal = call
            if reason == "malformed_tool_call":
                return OutputFinal(text + parser.raw, reason)
            calls = tuple(c for c in parser.calls if c.name not in self._exits)
            if reason in ("stop", "stop_sequence", "signal") and self._signal is not None:
                return OutputFinal(text, "signal", calls, self._signal, deltas, parser.raw)
            if reason in ("stop", "stop_sequence") and calls:
                return OutputFinal(text, "tool_calls", calls, None, deltas, parser.raw)
        if reason == "stop" and self._verify is not None and not self._verify.accepting():
            reason = "constraint_failed"
        return OutputFinal(
            text, reason, calls, self._signal, deltas, parser.raw if parser is not None else ""
        )

    @property
    def malformed_reason(self) -> str:
        """Why a call was malformed (for logs and ``ErrorDetail``)."""
        return self._malformed
