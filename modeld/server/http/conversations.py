"""The one conversation layer under every HTTP API: a turn in, its events out.

:class:`Conversations` runs a :class:`~modeld.server.http.turn.Turn` on its conversation's
warm session, through the one asyncio bridge (:mod:`modeld.server.bridge`): ``ensure_prefix``,
``prefill_suffix``, ``decode``. It yields :class:`Started` (which session, how much of the
prompt was reused and why), then :class:`Delta` events (answer text, reasoning, tool-call
pieces, logprobs) and one :class:`Finished` (the contract's finish reason, the complete calls,
:class:`TurnUsage`). Every API adapter shapes these same events, so warm mapping, tool-call
parsing, reasoning, usage accounting and errors are written once. Before anything is computed
the turn is checked against the window (:mod:`modeld.server.http.window`: a prompt that does not
fit is refused in each API's words, or truncated where the API truncates), and an output limit
beyond the window decodes until the window is full. A failure before
:class:`Started` raises :class:`~modeld.server.http.errors.HttpError` (the API answers with its
status); after it, the stream's :class:`Finished` carries ``error``.

Conversation affinity: a tool resends its whole conversation every turn. Reuse does not depend
on the session (the engine reuses the longest common token prefix of whatever is resident), but
one session per conversation makes a conversation one line in ``modeld explain-context`` with
its last turn's reuse and miss explanation, and keeps it on its own warm KV sequence: the table
of those sessions is :class:`~modeld.server.http.sessions.SessionTable`, which this class is.

It also remembers how the model wrote the arguments of the tool calls it returned (the last
:data:`REMEMBERED_CALLS` calls, by id: the JSON text in ``StreamChunk.tool_text`` that the
parser read them from; a client gets them re-serialized). When a client sends such a call back
unchanged, its arguments go to the template as the model wrote them, so a template that shows
arguments text as it is renders the call byte for byte and the next turn reuses every
generated token (``blueprints/0010``, ``0018``).

Ahead of the next turn (``prefill_ahead``, ``--prefill-ahead``, on by default; blueprint 0010): when a
chat turn's answer ends without a tool call, the next request is a user's, and it will carry this
conversation with the answer as history. Many templates render history otherwise once a later
user message exists (Qwen3, Qwen3.5, GLM 4.6, Kimi K2, Gemma 4 and gpt-oss drop the reasoning of
the turns before it), so that request would compute again everything from the first such turn.
The turn leaves its session a follow-up (:meth:`SessionTable.follow`): ``ensure_prefix`` of the
conversation through the answer, rendered as a user message follows it, while the user reads.
The answer goes in the form the client sends its earlier answers back (parts or a string, with
its reasoning or without). The next request reuses it (it waits for the follow-up if it comes
first); one that diverges from it reuses what they share, as from any warm context.

Usage (:class:`TurnUsage`), the same numbers on every API: ``prompt_tokens`` the turn's whole
prompt; ``cached_tokens`` those not computed this turn (reused from warm state: the KV, or a
snapshot restored from a tier); ``created_tokens`` the stable prefix's tokens computed this turn
(newly made reusable); ``uncached_tokens`` the rest of the prompt computed this turn (the
volatile suffix, and anything another session displaced).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, replace

from modeld.contract import (
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    ProgressCallback,
    StreamChunk,
    SuffixInput,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from modeld.decoding.harmony import HarmonySplitter
from modeld.decoding.reasoning import ReasoningSplitter, detect_reasoning, make_splitter
from modeld.decoding.tools import CallKey, call_key
from modeld.errors import (
    ModeldError,
    SessionClosedError,
    UnsupportedError,
    error_from_reason,
)
from modeld.observe.records import Recording
from modeld.server.bridge import Bridge, BridgedSession
from modeld.server.gateway import Gateway
from modeld.server.http.diagnosis import NO_DIVERGENCE, Diagnoses, Diagnosis, Divergence
from modeld.server.http.errors import HttpError, from_modeld, incident_id
from modeld.server.http.sessions import SessionTable
from modeld.server.http.turn import Message, Recall, Turn, chat_inputs, split_point, template_args_json
from modeld.server.http.window import Window

__all__ = [
    "AHEAD_FINISHES",
    "REMEMBERED_CALLS",
    "Collected",
    "Conversations",
    "Delta",
    "Event",
    "Finished",
    "Started",
    "TurnUsage",
    "collect",
    "collect_choices",
    "first_event",
    "next_prefix",
]

REMEMBERED_CALLS = 1024
"""Tool calls whose arguments text, as the model wrote it, is kept (by call id)."""

AHEAD_FINISHES = frozenset({"stop", "length", "stop_sequence"})
"""The finish reasons after which the next request is a user's (no tool call to answer, no
error): the turns whose next prefix is prefilled ahead."""

log = logging.getLogger("modeld.http")


@dataclass(frozen=True, slots=True)
class TurnUsage:
    """A turn's token counts (module docstring), the same on every API."""

    prompt_tokens: int
    cached_tokens: int
    created_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    drafted_tokens: int = 0  # speculation (blueprint 0021): drafted from the context, verified
    accepted_tokens: int = 0  # of those, the model's own choice
    draft_batches: int = 0
    forced_tokens: int = 0  # forced by a constraint, appended without a decode step

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens - self.created_tokens)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens computed this turn (created + uncached)."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class Started:
    """The decode started: which session serves the turn, and its prefix's reuse."""

    session_id: str
    status: PrefixStatus
    diverged_message: int | None  # the message (index) where the prefix diverged, when known
    info: ModelInfo
    usage: TurnUsage  # the prompt's counts (completion 0): what the final usage says of the prompt
    choices: int = 1  # the choices this turn's events carry (n, or 1 when they are decoded one by one)
    decoded: str = "together"  # how n > 1 choices are decoded: together, once (greedy), one by one
    why: str = ""  # why they are not decoded together
    diverged: Divergence = NO_DIVERGENCE  # where the prefix parted from what was warm (diagnosis.py)
    diagnosis: Diagnosis | None = None  # the comparison the request asked for (Turn.compare)
    omitted: tuple[str, ...] = ()  # the turn's content left out of the prompt (images...: "where: kind")


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of the output: answer text, reasoning, tool-call pieces, logprobs."""

    text: str = ""
    reasoning: str = ""
    calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    choice: int = 0  # whose piece (Turn.n > 1)


@dataclass(frozen=True, slots=True)
class Finished:
    """The turn ended. ``finish``: the contract's finish reason (``error`` with ``error`` set);
    ``calls``: the complete tool calls (the first only when the request said so)."""

    finish: str
    usage: TurnUsage
    calls: tuple[ToolCall, ...] = ()
    error: HttpError | None = None
    tool_text: str = ""
    stop_sequence: str = ""  # the stop string that ended the text (finish stop_sequence)
    choice: int = 0  # whose end (Turn.n > 1)


Event = Started | Delta | Finished


class Conversations(SessionTable):
    """The turn runner on the table of conversation sessions (thread-safe)."""

    def __init__(
        self,
        gateway: Gateway,
        bridge: Bridge,
        *,
        max_conversations: int,
        idle_seconds: float,
        tool_formats: Mapping[str, str] | None = None,
        fit_tool_results: bool = False,
        prefill_ahead: bool = True,
    ) -> None:
        super().__init__(gateway, bridge, max_conversations=max_conversations, idle_seconds=idle_seconds)
        self.prefill_ahead = prefill_ahead
        self.tool_formats = dict(tool_formats or {})  # model name -> its format (--tool-format)
        self._calls: OrderedDict[CallKey, str] = OrderedDict()
        self.diagnoses = Diagnoses()
        self.window = Window(fit_tool_results)

    def remember_calls(self, calls: tuple[ToolCall, ...], text: str) -> None:
        """The model wrote ``calls`` as ``text`` (``StreamChunk.tool_text``): keep each call's
        arguments as written there (found as the JSON object equal to its arguments), by the
        call's id, name and arguments (:func:`~modeld.decoding.tools.call_key`: families with
        ids of their own repeat them, Kimi's ``functions.NAME:0`` in every turn, so the id
        alone would recall another turn's call)."""
        for call in calls:
            written = written_arguments(text, call.arguments)
            if written is None or written == call.arguments:
                continue
            key = call_key([call])
            with self._lock:
                self._calls[key] = written
                self._calls.move_to_end(key)
                while len(self._calls) > REMEMBERED_CALLS:
                    self._calls.popitem(last=False)

    def recall(self, call: ToolCall) -> str:
        """The arguments of ``call`` as the model wrote them, when it is one this daemon returned
        and the client sent it back (its arguments equal as JSON); else as the client sent them."""
        with self._lock:
            written = self._calls.get(call_key([call]))
        return call.arguments if written is None else written

    # --- running a turn ---------------------------------------------------------------------

    async def run(
        self,
        turn: Turn,
        request: OpenSessionRequest,
        progress: ProgressCallback | None = None,
        recording: Recording | None = None,
        *,
        ahead: bool = True,
    ) -> AsyncGenerator[Event, None]:
        """Run ``turn`` on its conversation's session: Started, Deltas, Finished (``progress``
        hears how a long prefill goes, on the event loop). ``recording``: the request's record,
        which the session's turn counts into (blueprint 0022). ``ahead`` False: no turn follows
        on this model (Ollama's ``keep_alive: 0`` unloads it once answered), so nothing is
        computed ahead of one, whatever ``prefill_ahead`` says.

        Closing the iterator early (the client went away) cancels the decode within one token
        step, or interrupts the prefill it waits for."""
        try:
            async with self.session(turn.conversation(), request) as session:
                observed = session.hosted.session
                if recording is not None:
                    observed.record(recording)
                try:
                    async for event in self._run(turn, session, request, progress, recording, ahead):
                        yield event
                finally:
                    if recording is not None:  # once the engine is idle: a turn cut short lets go
                        session.when_idle(lambda: observed.turn.let_go(recording))
        except ModeldError as exc:
            raise from_modeld(exc, incident_id()) from None

    async def _count(self, turn: Turn, info: ModelInfo, request: OpenSessionRequest) -> int:
        """The turn's prompt in tokens on this model (rendered and tokenized; nothing computed)."""
        prefix, suffix = self.inputs(turn, info)
        return await self._bridge.call(self._gateway.count_tokens, request, prefix, suffix)

    def inputs(self, turn: Turn, info: ModelInfo) -> tuple[PrefixInput, SuffixInput | None]:
        """The turn as the contract's prefix and suffix (messages whole: the model's template
        renders them, tool calls in its own format)."""
        if not turn.chat:
            return PrefixInput(text=turn.prompt or ""), None
        return chat_inputs(
            turn.messages,
            split_point(turn.messages),
            turn.tools_json,
            f"http.{turn.api}",
            template_args_json(turn),
            self.recall,
        )

    def _format(self, turn: Turn) -> str:
        """The turn's tool-call format: its own, else the model's ``--tool-format`` ("": the
        one the engine recognises from the template)."""
        return turn.decode.tool_format or self.tool_formats.get(turn.model, "")

    async def _run(
        self,
        turn: Turn,
        session: BridgedSession,
        request: OpenSessionRequest,
        progress: ProgressCallback | None,
        recording: Recording | None = None,
        ahead: bool = True,
    ) -> AsyncIterator[Event]:
        info = session.info
        turn = await self.window.fitted(turn, info.effective_context, lambda t: self._count(t, info, request))
        prefix, suffix = self.inputs(turn, info)
        status = await session.ensure_prefix(prefix, progress)
        restored = 0
        suffix_tokens = 0
        kept = status.prefix_tokens
        if suffix is not None:
            after = await session.prefill_suffix(suffix, progress)
            restored, suffix_tokens = after.restored_tokens, after.suffix_tokens
            kept = after.prefix_tokens  # the template may have cut the prefix back (blueprint 0010)
        prompt = kept + suffix_tokens
        cached = max(0, min(status.reused_tokens, kept) - restored)
        usage = TurnUsage(prompt, cached, min(status.prefilled_tokens, prompt - cached), 0)
        self.window.measured(turn, prompt)
        where, diagnosis, fingerprint = self.diagnoses.of_prompt(turn, session.session_id, status, prompt)
        message = where.message
        if recording is not None and message is not None:
            recording.set(diverged_message=message)
        if status.reuse.diverged_at_token is not None:
            log.info(
                "%s: %s prefix (%s), reused %d of %d tokens; diverged at token %d, message %s",
                turn.conversation(),
                status.reuse.outcome,
                status.reuse.reason,
                status.reused_tokens,
                status.prefix_tokens,
                status.reuse.diverged_at_token,
                "?" if message is None else message,
            )
        started = Started(
            session.session_id,
            status,
            message,
            info,
            usage,
            choices=turn.n,
            diverged=where,
            diagnosis=diagnosis,
            omitted=turn.omitted_content,
        )
        if turn.max_tokens == 0:  # only the prompt: warm it, generate nothing
            yield started
            if turn.chat:
                self.diagnoses.record(turn.id, fingerprint)
            yield Finished("length", usage)
            return
        # An output limit beyond the window decodes until the window is full and stops there
        # ("length", each API's own reason), as llama-server does: never a 400 after the prefill.
        window = info.effective_context
        config = replace(
            turn.decode,
            max_tokens=min(turn.max_tokens or window, window),
            n=turn.n,
            tool_format=self._format(turn),
        )
        try:
            stream = await session.decode(config)
        except UnsupportedError as exc:
            if turn.n == 1 or exc.details.get("field") != "n":
                raise
            # The choices cannot be decoded together here: this stream decodes the first, the
            # caller the others, one after another (Started.why says why).
            started = replace(started, choices=1, decoded="one by one", why=exc.message)
            stream = await session.decode(replace(config, n=1))
        try:
            yield started
            fmt_reasoning = detect_reasoning(info.chat_template) if turn.chat else None
            splitters = [
                make_splitter(fmt_reasoning) if fmt_reasoning is not None else None
                for _ in range(started.choices)
            ]
            reasoning_tokens = [0] * started.choices
            # The answer's text and reasoning, kept only for a prefill ahead (the next turn's history).
            ahead = ahead and self.prefill_ahead and turn.chat and turn.n == 1 and started.choices == 1
            answer: list[str] = []
            thought_text: list[str] = []
            ended = 0
            async for chunk in stream:
                i = chunk.choice
                splitter = splitters[i]
                delta, thought = _delta(chunk, splitter)
                reasoning_tokens[i] += thought
                if ahead:
                    answer.append(delta.text)
                    thought_text.append(delta.reasoning)
                if delta.text or delta.reasoning or delta.calls or delta.logprobs:
                    yield delta
                if chunk.final:
                    if splitter is not None:
                        thinking, text = splitter.finish()
                        if thinking or text:
                            if ahead:
                                answer.append(text)
                                thought_text.append(thinking)
                            yield Delta(text=text, reasoning=thinking, choice=i)
                    finished = self._finished(turn, chunk, usage, reasoning_tokens[i])
                    if turn.chat and i == 0 and finished.error is None:
                        self.diagnoses.record(turn.id, fingerprint)
                    if ahead:
                        self._ahead(
                            turn, session, finished, "".join(answer), "".join(thought_text), recording
                        )
                    yield finished
                    ended += 1
                    if ended == started.choices:
                        return
        finally:
            await stream.aclose()

    def _ahead(
        self,
        turn: Turn,
        session: BridgedSession,
        finished: Finished,
        text: str,
        reasoning: str,
        recording: Recording | None,
    ) -> None:
        """Leave ``session`` the prefill of the next turn's prefix when the answer ends without a
        tool call (module docstring; the caller asks only for a one-choice chat turn with
        ``prefill_ahead`` on: choices decoded one by one would each re-prefill what it changed).
        Reported apart from the turns: the session's ``ahead`` (explain-context), and a request
        record of its own (finish ``ahead``, the turn's labels) when the turn has one."""
        if finished.finish not in AHEAD_FINISHES or finished.calls:
            return
        prefix = replace(next_prefix(turn, text, reasoning, self.recall), ahead=True)
        model = turn.model

        async def prefill(bridged: BridgedSession) -> None:
            metrics = self._gateway.metrics
            observed = bridged.hosted.session
            record = recording.follow_up() if recording is not None else None
            if record is not None:
                observed.record(record)
            try:
                status = await bridged.ensure_prefix(prefix)
            except ModeldError as exc:
                metrics.ahead.labels(metrics.label(model), "failed").inc()
                log.info("%s: no prefill ahead of the next turn: %s", turn.conversation(), exc.message)
                return
            finally:
                if record is not None:  # once the engine is idle (a cancelled prefill still runs)
                    bridged.when_idle(lambda: observed.turn.let_go(record))
                    record.finish()
            metrics.ahead.labels(metrics.label(model), "done").inc()
            metrics.ahead_tokens.labels(metrics.label(model)).inc(status.prefilled_tokens)
            log.info(
                "%s: prefilled %d tokens ahead of the next turn (%d of its %d-token prefix were warm)",
                turn.conversation(),
                status.prefilled_tokens,
                status.reused_tokens,
                status.prefix_tokens,
            )

        self.follow(session, prefill)

    def _finished(
        self, turn: Turn, chunk: StreamChunk, started: TurnUsage, reasoning_tokens: int
    ) -> Finished:
        usage = _usage(chunk.usage, started, reasoning_tokens)
        if chunk.finish_reason == "error":
            detail = chunk.error
            error = (
                error_from_reason(detail.reason, detail.message, {})
                if detail
                else SessionClosedError("failed")
            )
            return Finished("error", usage, error=from_modeld(error, incident_id()), choice=chunk.choice)
        calls = chunk.tool_calls + ((chunk.signal,) if chunk.signal is not None else ())
        if not turn.parallel_tool_calls:
            calls = calls[:1]
        if chunk.tool_calls and chunk.tool_text:
            self.remember_calls(chunk.tool_calls, chunk.tool_text)
        return Finished(
            chunk.finish_reason or "stop",
            usage,
            calls,
            tool_text=chunk.tool_text,
            stop_sequence=chunk.stop_sequence,
            choice=chunk.choice,
        )


def next_prefix(turn: Turn, text: str, reasoning: str, recall: Recall | None = None) -> PrefixInput:
    """The prefix of the request that follows ``turn`` when a user answers it: the turn's
    messages and its answer (``text``, ``reasoning``), rendered as a user message follows. The
    answer takes the form of the client's earlier answers: text parts if the last one came as
    parts, its reasoning if any earlier answer carried one (clients that drop reasoning drop
    it from every answer)."""
    earlier = [m for m in turn.messages if m.role == "assistant"]
    answer = Message(
        role="assistant",
        content=text,
        reasoning=reasoning if any(m.reasoning for m in earlier) else "",
        parts=(text,) if earlier and earlier[-1].parts and text else (),
    )
    messages = [*turn.messages, answer, Message(role="user", content="")]
    prefix, _ = chat_inputs(
        messages, len(messages) - 1, turn.tools_json, f"http.{turn.api}", template_args_json(turn), recall
    )
    return prefix


def _delta(chunk: StreamChunk, splitter: ReasoningSplitter | HarmonySplitter | None) -> tuple[Delta, int]:
    """A chunk as a Delta (answer and reasoning split), and how many of its tokens were reasoning
    (a chunk that carries the end of the thinking splits its tokens by characters)."""
    if splitter is None or not chunk.text:
        return Delta(
            text=chunk.text, calls=chunk.tool_call_deltas, logprobs=chunk.logprobs, choice=chunk.choice
        ), 0
    thinking, text = splitter.feed(chunk.text)
    n = len(chunk.token_ids)
    if not thinking:
        thought = 0
    elif not text and splitter.thinking:
        thought = n
    else:
        thought = round(n * len(thinking) / max(1, len(thinking) + len(text)))
    return Delta(
        text=text,
        reasoning=thinking,
        calls=chunk.tool_call_deltas,
        logprobs=chunk.logprobs,
        choice=chunk.choice,
    ), thought


def _usage(usage: Usage | None, started: TurnUsage, reasoning_tokens: int) -> TurnUsage:
    """The final usage: the engine's counts (a displaced prefix restored during the decode is
    computed too), the stable prefix's computed tokens as when the decode started."""
    if usage is None:
        return started
    created = min(started.created_tokens, max(0, usage.prompt_tokens - usage.cached_tokens))
    return TurnUsage(
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        created_tokens=created,
        completion_tokens=usage.completion_tokens,
        reasoning_tokens=min(reasoning_tokens, usage.completion_tokens),
        prefill_ms=usage.prefill_ms,
        decode_ms=usage.decode_ms,
        drafted_tokens=usage.drafted_tokens,
        accepted_tokens=usage.accepted_tokens,
        draft_batches=usage.draft_batches,
        forced_tokens=usage.forced_tokens,
    )


def written_arguments(text: str, arguments: str) -> str | None:
    """The JSON object in ``text`` equal to ``arguments`` (JSON text), as written there."""
    try:
        wanted = json.loads(arguments)
    except ValueError:
        return None
    decoder = json.JSONDecoder()
    at = text.find("{")
    while at >= 0:
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            value, end = None, at + 1
        if value == wanted and isinstance(value, dict):
            return text[at:end]
        at = text.find("{", at + 1)
    return None


async def first_event(events: AsyncIterator[Event]) -> Started:
    """The turn's Started (its errors raise here, before an API answers anything)."""
    try:
        event = await anext(events)
    except StopAsyncIteration:
        raise HttpError(500, "the turn ended before it started", code="internal") from None
    assert isinstance(event, Started)
    return event


@dataclass(frozen=True, slots=True)
class Collected:
    """A whole turn, folded from its events (what a non-streamed answer is made of, so it
    always says what the stream said)."""

    started: Started
    text: str
    reasoning: str
    logprobs: tuple[TokenLogprob, ...]
    finished: Finished


async def collect(started: Started, events: AsyncIterator[Event]) -> Collected:
    return (await collect_choices(started, events))[0]


async def collect_choices(started: Started, events: AsyncIterator[Event]) -> list[Collected]:
    """Every choice the turn's events carry (``Started.choices``), folded, in order."""
    n = started.choices
    text: list[list[str]] = [[] for _ in range(n)]
    reasoning: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    done: dict[int, Collected] = {}
    async for event in events:
        if isinstance(event, Delta):
            i = event.choice
            text[i].append(event.text)
            reasoning[i].append(event.reasoning)
            logprobs[i].extend(event.logprobs)
        elif isinstance(event, Finished):
            i = event.choice
            done[i] = Collected(started, "".join(text[i]), "".join(reasoning[i]), tuple(logprobs[i]), event)
            if len(done) == n or event.error is not None:
                return [done[k] for k in sorted(done)] if event.error is None else [done[i]]
    raise HttpError(500, "the turn ended without a final event", code="internal")
