"""The decode loop: tokens from the engine become text chunks, stop conditions, usage.

:class:`EngineDecodeStream` reads a generate job's events (``engine/jobs.py``: never a worker
message) on the caller's own thread (no producer thread): each ``Sampled`` event is turned into UTF-8-safe text by
:class:`~modeld.engine.text.TextAssembler`, stop strings are cut, and the text goes through the
decode's :class:`~modeld.decoding.output.OutputProcessor` (tool calls parsed out of the text
into deltas, exit-tool signals, the repeated-line guard, the constraint's check); the final
chunk carries the finish reason, the calls and usage. The engine stops by itself at an
end-of-generation token, at ``max_tokens``, at the window, and when its constraint cannot go
on (it ends the job early: ``constraint_failed``); for a stop string, a processor stop
(``repeated_line``, ``signal``, ``malformed_tool_call``), a cancel, an interrupted session or a
timeout the stream sends a cancel message and reads on until the engine reports what its
sequence holds, so the warm-state cache always records the truth.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Self

from modeld.contract import (
    Closing,
    DecodeConfig,
    ErrorDetail,
    StreamChunk,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from modeld.decoding.output import DecodePlan, OutputProcessor
from modeld.engine.jobs import GenerateEnd, GenerateJob, RoomAsked, Sampled
from modeld.engine.text import TextAssembler
from modeld.errors import BusyError, EngineError, ModeldError, OperationTimeoutError

if TYPE_CHECKING:
    from modeld.backends.base import DecodeStats, Vocab

__all__ = ["ChoiceCall", "ChoicesStream", "DecodeRun", "EngineDecodeStream"]

_POLL = 0.25
"""How often a waiting stream checks for an interrupted session or a timeout."""

log = logging.getLogger("modeld.engine")


class DecodeRun:
    """What the session hands a stream: the running job and how to end the turn."""

    def __init__(
        self,
        *,
        call: GenerateJob | ChoiceCall,
        vocab: Vocab,
        config: DecodeConfig,
        plan: DecodePlan,
        requested: int,
        prompt: int,
        cached: int,
        prefill_ms: float,
        restore_ms: float,
        idle_seconds: float,
        deadline: float | None,
        interrupted: Callable[[], ErrorDetail | None],
        finish: Callable[[list[int], list[int], int | None, ModeldError | None], None],
        verify: Callable[[], ErrorDetail | None] | None = None,
        speculated: Callable[[DecodeStats], None] | None = None,
        ended: Callable[[str], None] | None = None,
        room: Callable[[int], int] | None = None,
        room_error: Callable[[], ModeldError | None] | None = None,
    ) -> None:
        self.call = call
        self.vocab = vocab
        self.config = config
        self.plan = plan
        self.requested = requested
        """How many tokens the generate job may sample (max_tokens, or less if the window is
        nearer): a job that ends sooner without an end-of-generation token met a dead end of
        its constraint."""
        self.prompt = prompt
        self.cached = cached
        self.prefill_ms = prefill_ms
        self.restore_ms = restore_ms
        self.idle_seconds = idle_seconds
        self.deadline = deadline
        self.interrupted = interrupted
        self.verify = verify
        """Whether the tokens can be trusted (the model file did not change under the decode):
        checked with ``interrupted`` at every step and once more when the engine finished; a
        problem ends the decode with that error, never with a normal finish."""
        self.finish = finish
        """Called once at the end with (emitted tokens, every sampled token, what the engine's
        sequence holds or None if unknown, the error that ended it or None)."""
        self.speculated = speculated
        """Called at the end with what speculation did (when the engine reported it)."""
        self.ended = ended
        """Called at the end, before ``finish``, with the finish reason (the warm context's next
        use depends on it: a turn ending in a tool call comes back soon)."""
        self.room = room
        """A job started with a cell limit (``Generate.cells``) reached it, its sequence holding
        the given number of tokens: called to make room (it may wait, as a turn waits for
        cells); returns the cells granted (-1: all it may still take), 0 when none can be had
        (the decode then ends ``busy``, saying why: ``room_error`` returns it)."""
        self.room_error = room_error


class _Stream(Closing):
    """What both decode streams do besides reading chunks: ``close`` cancels a running decode
    and reads on until the engine has stopped; a ``with`` block closes; a stream dropped while
    its job runs cancels the job."""

    _done: bool

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> StreamChunk:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def _job(self) -> GenerateJob | ChoiceCall:
        """The job a cancel stops."""
        raise NotImplementedError

    def close(self) -> None:
        """Cancel if still running and wait until the engine has stopped."""
        if self._done:
            return
        self.cancel()
        for _ in self:
            pass

    def __del__(self) -> None:
        if not self._done:
            self._job().cancel()


class EngineDecodeStream(_Stream):
    """A decode read as an iterator of chunks (see the module docstring)."""

    def __init__(self, run: DecodeRun, choice: int = 0) -> None:
        self._run = run
        self._choice = choice
        self._assembler = TextAssembler(run.config.stop)
        self._processor = OutputProcessor(run.config, run.plan)
        self._emitted: list[int] = []
        self._sampled: list[int] = []
        self._pending: list[int] = []
        self._pending_logprobs: list[TokenLogprob] = []
        self._deltas: list[ToolCallDelta] = []
        self._finish: str | None = None  # decided, not yet reported
        self._error: ErrorDetail | None = None
        self._canceled = False
        self._done = False
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._started_at = time.monotonic()

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        while True:
            chunk = self._step()
            if chunk is not None:
                return chunk

    def _step(self) -> StreamChunk | None:
        self._check()
        try:
            event = self._run.call.next_event(timeout=_POLL)
        except ModeldError as exc:
            return self._final(False, None, exc)
        if isinstance(event, Sampled):
            return self._tokens(event.tokens, event.logprobs)
        if isinstance(event, GenerateEnd):
            return self._final(event.canceled, event.resident, None, event.stats)
        if isinstance(event, RoomAsked):
            self._room(event.resident)
        return None

    def _room(self, resident: int) -> None:
        """The job paused at its cell limit: room for more (the engine waits meanwhile)."""
        run = self._run
        granted = run.room(resident) if run.room is not None else 0
        if granted == 0 and self._finish is None:
            error = run.room_error() if run.room_error is not None else None
            error = error or BusyError(
                f"the decode filled the KV cells it could have ({resident} tokens) and no more can be freed"
            )
            self._finish, self._error = "error", _detail(error)
        call = run.call
        if not isinstance(call, ChoiceCall):  # choices decoded together never pause for room
            call.grant(granted)

    def _check(self) -> None:
        """Stop the decode if its session was interrupted, its model file changed, it was
        canceled, or it ran past a timeout."""
        run = self._run
        now = time.monotonic()
        if self._finish is None:
            problem = run.interrupted() or (run.verify() if run.verify is not None else None)
            if problem is not None:
                self._stop("error", problem)
            elif self._canceled:
                self._stop("canceled")
            elif run.deadline is not None and now > run.deadline:
                self._stop(
                    "error",
                    _detail(
                        OperationTimeoutError(
                            "the decode ran past the operation timeout (operation_seconds): it was stopped",
                            timeout="operation_seconds",
                        )
                    ),
                )
            elif run.idle_seconds and now - (self._last_at or self._started_at) > run.idle_seconds:
                self._stop(
                    "error",
                    _detail(
                        OperationTimeoutError(
                            f"no token for {run.idle_seconds:.0f}s (idle_stream_seconds): the decode was stopped",
                            timeout="idle_stream_seconds",
                        )
                    ),
                )

    def _tokens(self, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()) -> StreamChunk | None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
        self._last_at = now
        out: list[str] = []
        for i, token in enumerate(tokens):
            self._sampled.append(token)
            if self._finish is not None:
                continue  # generated after a stop condition: not part of the answer
            if token in self._run.vocab.eog:
                self._finish = "stop"  # the engine ends the job by itself
                continue
            self._emitted.append(token)
            self._pending.append(token)
            if i < len(logprobs):
                self._pending_logprobs.append(self._named(logprobs[i]))
            text = self._assembler.feed(self._run.vocab.piece(token))
            if text:
                step = self._processor.feed(text)
                out.append(step.text)
                self._deltas.extend(step.deltas)
                if step.stop:
                    self._stop(step.stop)
                    continue
            if self._assembler.stopped:
                self._stop("stop_sequence")
            elif len(self._emitted) >= self._run.config.max_tokens:
                self._finish = "length"  # the engine stops at max_tokens by itself
        text = "".join(out)
        if text or self._deltas or (self._pending and self._assembler.stopped):
            chunk = StreamChunk(
                choice=self._choice,
                text=text,
                token_ids=tuple(self._pending),
                tool_call_deltas=tuple(self._deltas),
                logprobs=tuple(self._pending_logprobs),
            )
            self._pending, self._pending_logprobs, self._deltas = [], [], []
            return chunk
        return None

    def _named(self, lp: TokenLogprob) -> TokenLogprob:
        """The worker's log-probabilities with each token's text (the daemon has the vocabulary)."""
        piece = self._run.vocab.piece
        top = tuple(replace(t, text=piece_text(piece(t.token))) for t in lp.top)
        return replace(lp, text=piece_text(piece(lp.token)), top=top)

    def _stop(self, finish: str, error: ErrorDetail | None = None) -> None:
        if self._finish is None:
            self._finish = finish
            self._error = error
        self._run.call.cancel()

    def _final(
        self, canceled: bool, resident: int | None, exc: ModeldError | None, stats: DecodeStats | None = None
    ) -> StreamChunk:
        run = self._run
        self._done = True
        finish = self._finish
        error = self._error
        if exc is not None:
            finish, error = "error", _detail(exc)
        elif finish is None and canceled:
            finish = "canceled"
        elif finish is None and run.plan.constraint is not None and len(self._sampled) < run.requested:
            finish = "stop"  # the engine met a dead end of the constraint: the check decides
        elif finish is None:
            finish = "length"
        if finish != "error" and run.verify is not None and (problem := run.verify()) is not None:
            finish, error = "error", problem  # finished, but on a model file that changed meanwhile
        text = "" if finish == "error" and exc is not None else self._assembler.flush()
        step = self._processor.feed(text)
        result = self._processor.finish(step.stop or finish)
        if result.finish_reason == "malformed_tool_call":
            log.info("a decode ended with a malformed tool call: %s", self._processor.malformed_reason)
        if run.ended is not None:
            run.ended(result.finish_reason)
        run.finish(self._emitted, self._sampled, resident, exc)
        if stats is not None and run.speculated is not None:
            run.speculated(stats)
        decode_ms = (self._last_at - self._first_at) * 1000.0 if self._first_at and self._last_at else 0.0
        usage = Usage(
            prompt_tokens=run.prompt,
            cached_tokens=run.cached,
            completion_tokens=len(self._emitted),
            prefill_ms=run.prefill_ms,
            restore_ms=run.restore_ms,
            decode_ms=decode_ms,
            drafted_tokens=stats.drafted if stats else 0,
            accepted_tokens=stats.accepted if stats else 0,
            draft_batches=stats.verifies if stats else 0,
            forced_tokens=stats.forced if stats else 0,
        )
        chunk = StreamChunk(
            choice=self._choice,
            text=step.text + result.text,
            token_ids=tuple(self._pending),
            finish_reason=result.finish_reason,
            usage=usage,
            error=error,
            tool_call_deltas=(*self._deltas, *step.deltas, *result.deltas),
            tool_calls=result.tool_calls,
            signal=result.signal,
            tool_text=result.tool_text,
            stop_sequence=self._assembler.matched if result.finish_reason == "stop_sequence" else "",
            logprobs=tuple(self._pending_logprobs),
        )
        self._pending, self._pending_logprobs, self._deltas = [], [], []
        return chunk

    def cancel(self) -> None:
        """Stop the generation at its next token; the stream ends with a "canceled" chunk."""
        if not self._done:
            self._canceled = True
            self._run.call.cancel()

    def _job(self) -> GenerateJob | ChoiceCall:
        return self._run.call


def piece_text(piece: bytes) -> str:
    """A token's bytes as text: UTF-8, or ``bytes:\\xNN...`` when not whole UTF-8 (OpenAI's
    convention for log-probabilities)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def _detail(exc: ModeldError) -> ErrorDetail:
    return ErrorDetail(reason=exc.reason, message=exc.message)


class ChoiceCall:
    """One choice of a generate job that decodes several (``DecodeConfig.n``), as the call its
    :class:`EngineDecodeStream` stops: a cancel stops this choice only. Its events are read by
    the :class:`ChoicesStream` that holds it, never here."""

    def __init__(self, call: GenerateJob, choice: int) -> None:
        self._call = call
        self._choice = choice

    def cancel(self) -> None:
        self._call.cancel_choice(self._choice)

    def next_event(self, timeout: float | None = None) -> None:
        raise EngineError("a choice's events are read by its ChoicesStream")


class ChoicesStream(_Stream):
    """A decode of ``n`` choices of one prompt, decoded together by one generate job (one batch
    per step, ``Generate.forks``), read as one iterator of chunks: each chunk names its choice
    (``StreamChunk.choice``), chunks come in the order the engine sampled their tokens, and
    every choice ends with its own final chunk (its finish reason, its calls, its usage). Each
    choice is an :class:`EngineDecodeStream` of its own (stop strings, tool calls, the guard,
    the constraint's check) whose stop cancels that choice alone; ``released`` runs once when the
    job ended, before the final chunks are handed out (the forks are given back)."""

    def __init__(
        self, call: GenerateJob, streams: list[EngineDecodeStream], released: Callable[[], None]
    ) -> None:
        self._call = call
        self._streams = streams
        self._released: Callable[[], None] | None = released
        self._ready: deque[StreamChunk] = deque()
        self._done = False

    def __next__(self) -> StreamChunk:
        while True:
            if self._ready:
                return self._ready.popleft()
            if self._done:
                raise StopIteration
            self._step()

    def _step(self) -> None:
        for stream in self._streams:
            stream._check()
        try:
            event = self._call.next_event(timeout=_POLL)
        except ModeldError as exc:
            failure = exc
            self._end(lambda s: s._final(False, None, failure))
            return
        if isinstance(event, Sampled):
            choices = event.choices or (0,) * len(event.tokens)
            for i, stream in enumerate(self._streams):
                mine = [k for k, c in enumerate(choices) if c == i]
                if not mine:
                    continue
                logprobs = tuple(event.logprobs[k] for k in mine if k < len(event.logprobs))
                chunk = stream._tokens(tuple(event.tokens[k] for k in mine), logprobs)
                if chunk is not None:
                    self._ready.append(chunk)
        elif isinstance(event, GenerateEnd):
            finished = event
            self._end(
                lambda s: s._final(
                    finished.canceled,
                    finished.resident if s._choice == 0 else None,
                    None,
                    finished.stats if s._choice == 0 else None,
                )
            )

    def _end(self, final: Callable[[EngineDecodeStream], StreamChunk]) -> None:
        """The job ended: give the forks back, then every choice's final chunk, in order."""
        self._done = True
        released, self._released = self._released, None
        try:
            if released is not None:
                released()
        finally:
            for stream in self._streams:
                self._ready.append(final(stream))

    def cancel(self) -> None:
        """Stop every choice at its next token; each ends with a "canceled" chunk."""
        if not self._done:
            for stream in self._streams:
                stream._canceled = True
            self._call.cancel()

    def _job(self) -> GenerateJob | ChoiceCall:
        return self._call
