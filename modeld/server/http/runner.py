"""Running a request's turn and answering it in its dialect's words, the same way for every API.

:meth:`Runner.answer` takes what a route parsed (:class:`~modeld.server.http.dialect.Asked`) and
its :class:`~modeld.server.http.dialect.Dialect`: it runs the turn on its conversation's session
(:mod:`modeld.server.http.conversations`) and answers with a stream or one JSON body, or ``n``
choices in one body where the dialect has an answer for them. A turn counts as running (a drain
waits for it) from here to its last byte; while the daemon drains a new one is refused
(:mod:`modeld.server.http.drain`). A client that goes away stops the decode; a failure in the
middle of a stream is written as the dialect's error event, never a broken stream.

Every request gets a record (:mod:`modeld.observe.records`, blueprint 0022), opened here with
its labels (the job: ``X-Modeld-Job``, else the agent's own session id; the client program; the
conversation key) and its bytes in, counted into by its session's turn, and finished here with
its finish, its error and its bytes out, after the last byte; its id (the turn's) is in the
``X-Modeld-Request`` header, a refusal's too (answered here, not by the route's error handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from modeld.contract import PrefillProgress
from modeld.errors import ModeldError, echo
from modeld.observe.records import MAX_LABEL_CHARS, Recording, Records, clean_label
from modeld.server.bridge import Bridge
from modeld.server.gateway import Gateway
from modeld.server.http.catalog import Catalog
from modeld.server.http.conversations import (
    Conversations,
    Event,
    Finished,
    Started,
    collect,
    collect_choices,
    first_event,
)
from modeld.server.http.diagnosis import prefix_header
from modeld.server.http.dialect import Asked, Dialect
from modeld.server.http.drain import Drain
from modeld.server.http.errors import ErrorStyle, HttpError, WindowExceededError, from_modeld, incident_id
from modeld.server.http.turn import Turn

__all__ = ["Runner", "error_response"]

log = logging.getLogger("modeld.http")

A = TypeVar("A", bound=Asked)

UNLOAD_POLLS = 40
UNLOAD_POLL_SECONDS = 0.05
"""How long an unload waits for the model's last turn to let go of it (2 s in all)."""


def error_response(
    error: HttpError, style: ErrorStyle, status: Callable[[HttpError], int] | None = None
) -> JSONResponse:
    """``error`` in an API's words (``style``), with the status it gives it (``status``:
    Anthropic's 529 for an overloaded daemon); a body with a ``request_id`` (Anthropic's) also
    carries it as the ``request-id`` header."""
    body = style(error)
    headers = error.headers()
    if isinstance(body.get("request_id"), str):
        headers["request-id"] = body["request_id"]
    return JSONResponse(body, status_code=status(error) if status else error.status, headers=headers)


class Runner:
    """Runs turns and answers them (``max_output_tokens``: the output limit of a request that
    sets none, ``modeld serve --max-output-tokens``; ``keepalive_seconds``: how long a stream
    may stay silent before it is kept alive, ``--keepalive-interval``)."""

    def __init__(
        self,
        gateway: Gateway,
        bridge: Bridge,
        catalog: Catalog,
        conversations: Conversations,
        drain: Drain,
        max_output_tokens: int = 0,
        keepalive_seconds: float = 0.0,
    ) -> None:
        self.gateway = gateway
        self.bridge = bridge
        self.catalog = catalog
        self.conversations = conversations
        self.drain = drain
        self.max_output_tokens = max_output_tokens
        self.keepalive_seconds = keepalive_seconds
        self.records: Records = gateway.records

    def budgeted(self, turn: Turn) -> Turn:
        """The turn with the daemon's output limit when it sets none."""
        if turn.max_tokens is None and self.max_output_tokens:
            return replace(turn, max_tokens=self.max_output_tokens)
        return turn

    async def answer(self, request: Request, dialect: Dialect[A], asked: A) -> Response:
        """Run the asked turn and answer it: ``n`` choices in one body (where the dialect has
        them), a stream, or one JSON body; its record is finished when the answer is."""
        recording = self._begin(request, dialect, asked)
        try:
            if asked.turn.n > 1 and dialect.choices is not None:
                response = await self._choices(dialect, asked, recording)
            else:
                response = await self._one(request, dialect, asked, recording)
        except HttpError as exc:
            return _refused(exc, exc.code, exc.message, dialect, recording)
        except ModeldError as exc:
            return _refused(from_modeld(exc, incident_id()), exc.reason, exc.message, dialect, recording)
        except asyncio.CancelledError:  # the client went away
            recording.finish(finish="canceled", error="canceled", status=499)
            raise
        except Exception:
            recording.finish(finish="error", error="internal", status=500)
            raise
        response.headers["X-Modeld-Request"] = recording.id
        if not isinstance(response, StreamingResponse):
            status = response.status_code
            recording.finish(
                status=status,
                bytes_out=len(response.body),
                **({"finish": "error"} if status >= 400 else {}),
            )
        return response

    def _begin(self, request: Request, dialect: Dialect[A], asked: A) -> Recording:
        """The request's record, opened with its labels (a bad ``X-Modeld-Job`` is refused)."""
        turn = asked.turn
        job = request.headers.get("x-modeld-job")
        if job is not None:
            try:
                job = clean_label(job, "X-Modeld-Job header")
            except ValueError as exc:
                raise HttpError(400, str(exc), code="invalid_value", param="X-Modeld-Job") from None
        else:  # the agent's own session (Claude Code's metadata, Codex's session_id header)
            job = _label(turn.keys.session or request.headers.get("session_id", ""))
        length = request.headers.get("content-length", "")
        return self.records.begin(
            dialect.name,
            external=True,
            rid=turn.id,
            model=turn.model[:MAX_LABEL_CHARS],
            job=job,
            agent=_label(request.headers.get("user-agent", "").split(" ", 1)[0][:64]),
            conversation=_label(turn.conversation()),
            bytes_in=int(length) if length.isdigit() else 0,
        )

    async def _one(self, request: Request, dialect: Dialect[A], asked: A, recording: Recording) -> Response:
        leave = (
            self.drain.enter()
        )  # before the check: a drain beginning now waits for this turn or refuses it
        handed = False  # to the stream, which leaves when it ends
        try:
            if self.drain.draining:
                leave()
                await self.drain.refuse()
            turn = self.budgeted(asked.turn)
            entry = self.catalog.entry(turn.model)
            progress = _Progress()
            events = _noting(
                self.conversations.run(
                    turn,
                    self.catalog.open_request(entry, turn, asked.keep_alive),
                    progress,
                    recording,
                    ahead=not asked.unload,
                ),
                recording,
            )
            task = asyncio.current_task()
            watcher = asyncio.create_task(_watch_disconnect(request, task))
            opening: asyncio.Task[Started] | None = None
            try:
                if turn.stream:
                    opening = asyncio.ensure_future(first_event(events))
                    response = await self._streamed(
                        dialect, asked, events, opening, progress, leave, recording
                    )
                    handed = True
                    return response
                started = await first_event(events)
                headers = {**_modeld_headers(started), **dialect.headers()}
                async with contextlib.aclosing(events):
                    done = await collect(started, events)
                if done.finished.error is not None:
                    return error_response(done.finished.error, dialect.error, dialect.status)
                return JSONResponse(dialect.complete(asked, done), headers=headers)
            except BaseException:
                if opening is not None and not handed:
                    await _cancelled(opening)
                if not handed:
                    await events.aclose()
                raise
            finally:
                watcher.cancel()
        finally:
            if not handed:
                leave()

    async def _streamed(
        self,
        dialect: Dialect[A],
        asked: A,
        events: AsyncGenerator[Event, None],
        opening: asyncio.Task[Started],
        progress: _Progress,
        leave: Callable[[], None],
        recording: Recording,
    ) -> Response:
        """A streamed answer. A turn that starts within the keep-alive interval is answered as
        before any byte (its failure with its own status); one still being prefilled then (or
        still loading its model) starts its stream at once, kept alive in its API's form until
        the answer comes, and a failure from there on is the API's error event. A prompt beyond
        the window is answered inside a stream where the API says so (Responses). The record is
        finished when the stream ends."""
        interval = self.keepalive_seconds
        await asyncio.wait({opening}, timeout=interval if interval > 0 else None)
        headers = {**dialect.headers(), "Cache-Control": "no-cache"}
        if opening.done():
            error = opening.exception()
            if isinstance(error, WindowExceededError) and dialect.overflow_in_stream:
                await events.aclose()
                leave()
                part = dialect.stream_error(asked, error)
                recording.finish(
                    finish="error",
                    error=error.code,
                    error_message=error.message[:300],
                    status=200,
                    bytes_out=len(part),
                )
                return StreamingResponse(iter([part]), media_type=dialect.media_type, headers=headers)
            started = opening.result()  # a failure before the stream: the API's status and body
            headers.update(_modeld_headers(started))
        late = not opening.done()  # the stream begins before its turn: modeld's headers come in it

        async def body() -> AsyncGenerator[bytes, None]:
            begun = await opening
            if late:
                yield dialect.late_headers(asked, _modeld_headers(begun))
            async for part in dialect.stream(asked, begun, events):
                yield part

        return StreamingResponse(
            _closing(
                _alive(body(), lambda: dialect.alive(asked, progress.latest), interval),
                events,
                lambda error: dialect.stream_error(asked, error),
                opening,
                done=leave,
                recording=recording,
            ),
            media_type=dialect.media_type,
            headers=headers,
        )

    async def _choices(self, dialect: Dialect[A], asked: A, recording: Recording) -> Response:
        """Run ``turn.n`` choices in the turn's conversation and answer them in one JSON body:
        decoded together from the prompt's KV where the engine can fork it, else (the backend
        decodes one choice at a time, or the KV pool has no room for the forks) the first, then
        the others one after another, each reusing the warm prompt; greedy choices are all the
        same, so they are decoded once (the answer says which, ``choices_note``)."""
        assert dialect.choices is not None
        turn = self.budgeted(asked.turn)
        entry = self.catalog.entry(turn.model)
        greedy = turn.decode.temperature <= 0
        first = turn.choice(0) if greedy else turn
        events = self.conversations.run(first, self.catalog.open_request(entry, first), recording=recording)
        async with contextlib.aclosing(events):
            started = await first_event(events)
            dones = await collect_choices(started, events)
        if greedy:  # no draw to differ by: every choice is the first, exactly
            why = "greedy decoding (temperature 0) gives every choice the same tokens"
            once = replace(dones[0], started=replace(started, decoded="once", why=why))
            dones = [once] * turn.n
        for index in range(len(dones), turn.n if dones[0].finished.error is None else 0):
            one = turn.choice(index)
            more = self.conversations.run(one, self.catalog.open_request(entry, one), recording=recording)
            async with contextlib.aclosing(more):
                dones.append(await collect(await first_event(more), more))
            if dones[-1].finished.error is not None:
                break
        for done in dones:
            if done.finished.error is not None:
                recording.set(error=done.finished.error.code, error_message=done.finished.error.message[:300])
                return error_response(done.finished.error, dialect.error, dialect.status)
        recording.set(finish=dones[0].finished.finish)
        return JSONResponse(dialect.choices(asked, dones), headers=_modeld_headers(started))

    async def unload(self, name: str) -> bool:
        """Unload the model served as ``name`` now (Ollama's ``keep_alive: 0``): its idle
        conversations are closed, then the model, once no session holds it (a turn still
        finishing is waited for, a few seconds at most). True when it was unloaded."""
        entry = self.catalog.entry(name)
        for _ in range(UNLOAD_POLLS):
            self.conversations.close_model(entry.name)
            if await self.bridge.call(self.gateway.unload, entry.path):
                return True
            await asyncio.sleep(UNLOAD_POLL_SECONDS)
        log.info("%s was not unloaded: a session still holds it", entry.name)
        return False

    async def load(self, turn: Turn) -> None:
        """Load the turn's model (count its prompt: nothing is computed or kept)."""
        await self.drain.refuse()
        entry = self.catalog.entry(turn.model)
        await self.bridge.call(self.gateway.tokenize, self.catalog.open_request(entry, turn), "")

    async def count_tokens(self, turn: Turn) -> int:
        """How many tokens the turn's prompt takes on its model (nothing is computed)."""
        entry = self.catalog.entry(turn.model)
        info = await self.catalog.describe(entry)
        if info is None:
            raise HttpError(500, f"the model {echo(turn.model)} could not be read", code="model_load_failed")
        prefix, suffix = self.conversations.inputs(turn, info)
        request = self.catalog.open_request(entry, turn)
        return await self.bridge.call(self.gateway.count_tokens, request, prefix, suffix)


def _refused(
    error: HttpError, reason: str, message: str, dialect: Dialect[A], recording: Recording
) -> Response:
    """A refusal raised before the answer (an unknown model, a prompt beyond the window, a
    drain), answered here in the dialect's words rather than by the route's error handler, so
    that it carries its record's id and the record its bytes (``message``: the whole reason, for
    the record; the body may hide it behind an incident id)."""
    response = error_response(error, dialect.error, dialect.status)
    response.headers["X-Modeld-Request"] = recording.id
    recording.finish(
        finish="error",
        error=reason,
        error_message=message[:300],
        status=response.status_code,
        bytes_out=len(response.body),
    )
    return response


def _modeld_headers(started: Started) -> dict[str, str]:
    """modeld's own headers on every API's answer: the session, and how the prompt's prefix was
    reused (where it parted from what was warm: ``diagnosis.prefix_header``)."""
    return {
        "X-Modeld-Session": started.session_id,
        "X-Modeld-Prefix": prefix_header(started.status, started.diverged),
    }


class _Progress:
    """The latest progress of a turn's prefill (what a keep-alive says of it)."""

    def __init__(self) -> None:
        self.latest: PrefillProgress | None = None

    def __call__(self, step: PrefillProgress) -> None:
        self.latest = step


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has stopped (its exception, if any, is dropped)."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def _alive(
    parts: AsyncGenerator[bytes, None], alive: Callable[[], bytes], interval: float
) -> AsyncGenerator[bytes, None]:
    """``parts``, with ``alive()`` sent whenever they are silent for ``interval`` seconds (0:
    never): a long prefill, hidden thinking, a busy model. The next part keeps being awaited
    across keep-alives (never cancelled by them)."""
    if interval <= 0:
        async for part in parts:
            yield part
        return
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(parts))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield alive()
                continue
            finished, pending = pending, None
            try:
                part = finished.result()
            except StopAsyncIteration:
                return
            yield part
    finally:
        if pending is not None:
            await _cancelled(pending)
        await parts.aclose()


async def _closing(
    body: AsyncGenerator[bytes, None],
    events: AsyncGenerator[Event, None],
    failed: Callable[[HttpError], bytes],
    opening: asyncio.Task[Started],
    *,
    done: Callable[[], None],
    recording: Recording,
) -> AsyncIterator[bytes]:
    """A streamed answer that always closes its turn (the client went away: the decode stops)
    and writes a failure as the API's error event (``failed``) instead of a broken stream; its
    record is finished with the bytes sent."""

    def frame(error: HttpError) -> bytes:
        recording.set(finish="error", error=error.code, error_message=error.message[:300])
        return failed(error)

    sent = 0
    ended = False
    try:
        async for part in body:
            sent += len(part)
            yield part
        ended = True
    except (HttpError, ModeldError) as exc:
        part = frame(exc if isinstance(exc, HttpError) else from_modeld(exc, incident_id()))
        sent += len(part)
        yield part
        ended = True
    except Exception as exc:
        incident = incident_id()
        log.error("internal error while streaming (incident %s)", incident, exc_info=exc)
        part = frame(
            HttpError(500, f"internal error (incident {incident}; see the daemon's log)", code="internal")
        )
        sent += len(part)
        yield part
        ended = True
    finally:
        try:
            await body.aclose()  # stops what still waits for the turn's next event
            if not opening.done():
                await _cancelled(opening)
            await events.aclose()
        finally:
            if ended:
                recording.finish(status=200, bytes_out=sent)
            else:  # the client went away
                recording.finish(status=200, bytes_out=sent, finish="canceled", error="canceled")
            done()


async def _noting(events: AsyncGenerator[Event, None], recording: Recording) -> AsyncGenerator[Event, None]:
    """The turn's events, their finish (and error) noted in its record."""
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished) and event.choice == 0:
                if event.error is not None:
                    recording.set(
                        finish="error", error=event.error.code, error_message=event.error.message[:300]
                    )
                else:
                    recording.set(finish=event.finish)
            yield event


def _label(text: str) -> str:
    """A label derived from what a client sent (not named by it as one): printable, bounded."""
    return "".join(ch for ch in text if ch.isprintable())[:MAX_LABEL_CHARS]


async def _watch_disconnect(request: Request, task: asyncio.Task[Any] | None) -> None:
    """Cancel the request's task when the client disconnects before its answer is complete."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if task is not None:
                    task.cancel()
                return
