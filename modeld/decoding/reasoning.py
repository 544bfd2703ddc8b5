"""Reasoning models' thinking, split from the answer as the output streams, family by family.

What: a model whose chat template has a reasoning format writes its thinking between markers
before its answer. :func:`detect_reasoning` reads the family from the template:

=================  ==========================================  ===============================
family             thinking                                    templates
=================  ==========================================  ===============================
``think``          ``<think>`` ... ``</think>``                Qwen3/3.5/3.6, QwQ, DeepSeek R1
                                                               and V3.1, GLM 4.5+, Kimi K2
                                                               Thinking, MiniMax M2, Nemotron,
                                                               LFM2.5, SmolLM3
``granite``        ``<think>`` ... ``</think>``, the answer    Granite 3.3
                   in ``<response>`` ... ``</response>``
``seed``           ``<seed:think>`` ... ``</seed:think>``      Seed-OSS
``magistral``      ``[THINK]`` ... ``[/THINK]``                Magistral, Ministral 3 reasoning
``command_r``      ``<|START_THINKING|>`` ... ``<|END_        Command R7B
                   THINKING|>``, the answer in ``<|START_
                   RESPONSE|>`` ... ``<|END_RESPONSE|>``
``gemma4``         ``<|channel>thought`` ... ``<channel|>``    Gemma 4
``harmony``        the ``analysis`` channel                    gpt-oss (:mod:`.harmony`)
=================  ==========================================  ===============================

Templates whose generation prompt opens the block themselves (Qwen3.5 with thinking on,
DeepSeek R1, GLM 4.7, MiniMax M2): the output then starts inside it and only the close marker
appears. Whether it did is read from the rendered prompt, not guessed from the template (a
template may open the block for one request and close it for the next: ``enable_thinking``):
:meth:`ReasoningFormat.opened_by` looks at the prompt's last characters, and the decode's
output then begins with the opener the prompt ended with (:class:`~modeld.decoding.output.
OutputProcessor`), so the text is always the assistant turn whole and the splitters here never
need to be told.

:class:`ReasoningSplitter` is fed the decoded text deltas and returns, per delta, the
reasoning and the answer text, never splitting a marker across the two. Each HTTP API shows the
reasoning its own way (Anthropic ``thinking`` blocks, Responses ``reasoning`` items, chat's
``reasoning_content``, Ollama's ``thinking``). :class:`ReasoningGate` is the same reading for
the tool-call parser: markup inside the thinking is never a call.

What not: no tokens and no engine state; a model without a reasoning format is never split
(its text passes through untouched, so nothing is held back).
"""

from __future__ import annotations

from dataclasses import dataclass

from modeld.decoding.harmony import HarmonySplitter

__all__ = [
    "REASONING_FORMATS",
    "ReasoningFormat",
    "ReasoningGate",
    "ReasoningSplitter",
    "detect_reasoning",
    "make_splitter",
]

OPEN = "<think>"
CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How a family marks thinking. ``wrappers``: markers around the answer, dropped from it."""

    name: str = "think"
    open: str = OPEN
    close: str = CLOSE
    wrappers: tuple[str, ...] = ()

    def opened_by(self, prompt_tail: str) -> str:
        """The opener the prompt ends with when its generation prompt opened the thinking block
        (the output then starts inside it), else "". Harmony never does."""
        if self.name == "harmony" or not self.open:
            return ""
        at = prompt_tail.rfind(self.open)
        if at < 0 or self.close in prompt_tail[at:] or prompt_tail[at + len(self.open) :].strip():
            return ""
        return prompt_tail[at:]


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat(),
        ReasoningFormat("granite", OPEN, CLOSE, ("<response>", "</response>")),
        ReasoningFormat("seed", "<seed:think>", "</seed:think>"),
        ReasoningFormat("magistral", "[THINK]", "[/THINK]"),
        ReasoningFormat(
            "command_r", "<|START_THINKING|>", "<|END_THINKING|>", ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
        ),
        ReasoningFormat("gemma4", "<|channel>thought", "<channel|>"),
        ReasoningFormat("harmony", "", ""),
    )
}


def detect_reasoning(chat_template: str) -> ReasoningFormat | None:
    """The template's reasoning family, or None (it has no thinking markup)."""
    t = chat_template
    if "<|channel|>" in t:
        return REASONING_FORMATS["harmony"]
    if "<seed:think>" in t:
        return REASONING_FORMATS["seed"]
    if "<|START_THINKING|>" in t:
        return REASONING_FORMATS["command_r"]
    if "<|channel>" in t and "<channel|>" in t:
        return REASONING_FORMATS["gemma4"]
    if "[THINK]" in t and "[/THINK]" in t:
        return REASONING_FORMATS["magistral"]
    if OPEN in t and CLOSE in t:
        granite = "<response>" in t and "<|start_of_role|>" in t  # Granite's own role markers
        return REASONING_FORMATS["granite" if granite else "think"]
    return None


def _tail(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningGate:
    """The reading both splitters share: text -> ordered ``(piece, thinking)`` pieces, the
    markers kept in the thinking pieces (the tool-call parser passes those through unparsed)."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._fmt = fmt
        self._state = "start"
        self._buf = ""

    @property
    def thinking(self) -> bool:
        return self._state in ("thinking", "start")

    @property
    def closed(self) -> bool:
        """A thinking block was closed (the answer follows it)."""
        return self._state == "after"

    def feed(self, text: str, *, final: bool = False) -> list[tuple[str, bool]]:
        self._buf += text
        out: list[tuple[str, bool]] = []
        fmt = self._fmt
        while self._buf:
            if self._state == "start":  # the answer may open with the marker (leading space allowed)
                stripped = self._buf.lstrip()
                if stripped.startswith(fmt.open):
                    lead = len(self._buf) - len(stripped) + len(fmt.open)
                    out.append((self._buf[:lead], True))
                    self._buf = self._buf[lead:]
                    self._state = "thinking"
                    continue
                if fmt.open.startswith(stripped) and not final:
                    break  # could still become the marker: wait
                self._state = "answer"
                continue
            if self._state == "thinking":
                at = self._buf.find(fmt.close)
                if at >= 0:
                    out.append((self._buf[: at + len(fmt.close)], True))
                    self._buf = self._buf[at + len(fmt.close) :]
                    self._state = "after"
                    continue
                keep = 0 if final else _tail(self._buf, fmt.close)
                out.append((self._buf[: len(self._buf) - keep], True))
                self._buf = self._buf[len(self._buf) - keep :]
                break
            out.append((self._buf, False))
            self._buf = ""
        return [(p, t) for p, t in out if p]


class ReasoningSplitter:
    """Per decode: feed text deltas, get ``(reasoning, answer)`` pieces back (markers and
    answer wrappers dropped; the newlines that follow either marker belong to it)."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._fmt = fmt
        self._gate = ReasoningGate(fmt)
        self._answered = False
        self._hold = ""
        self._fresh = False  # just after the open marker

    @property
    def thinking(self) -> bool:
        return self._gate.thinking

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._gate.feed(text), final=False)

    def finish(self) -> tuple[str, str]:
        """What is still held back when the output ends."""
        return self._split(self._gate.feed("", final=True), final=True)

    def _split(self, pieces: list[tuple[str, bool]], *, final: bool) -> tuple[str, str]:
        fmt = self._fmt
        reasoning = answer = ""
        for piece, thinking in pieces:
            if thinking:
                body = piece
                stripped = body.lstrip()
                if stripped.startswith(fmt.open):
                    body = stripped[len(fmt.open) :]
                    self._fresh = True
                if self._fresh:  # the newlines after the open marker belong to it
                    body = body.lstrip("\n")
                    self._fresh = not body
                reasoning += body.removesuffix(fmt.close)
            else:
                answer += piece
        if not fmt.wrappers and self._answered:
            return reasoning, answer
        text = self._hold + answer
        if not self._answered:
            if not text.strip("\n") and not final:
                self._hold = text  # the newlines after the close marker: not yet the answer
                return reasoning, ""
            text = text.lstrip("\n") if self._gate.closed else text
            self._answered = True
        for wrapper in fmt.wrappers:
            text = text.replace(wrapper, "")
        keep = 0 if final else max((_tail(text, w) for w in fmt.wrappers), default=0)
        self._hold = text[len(text) - keep :] if keep else ""
        return reasoning, text[: len(text) - keep]


def make_splitter(fmt: ReasoningFormat) -> ReasoningSplitter | HarmonySplitter:
    """The splitter of ``fmt``'s family (harmony has its own)."""
    return HarmonySplitter() if fmt.name == "harmony" else ReasoningSplitter(fmt)
