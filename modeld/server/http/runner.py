"""Running a request's turn and answering it in its dialect's words, the same way for every API.

:meth:`Runner.answer` takes what a route parsed (:class:`~modeld.server.http.dialect.Asked`) and
its :class:`~modeld.server.http.dialect.Dialect`: it runs the turn on its conversation's session
(:mod:`modeld.server.http.conversations`) and answers with a stream or one JSON body, or ``n``
choices in one body where the dialect has an answer for them. A turn counts as running (a drain
waits for it) from here to its last byte; while the daemon drains a new one is refused
(:mod:`modeld.server.http.drain`). A client that goes away stops the decode; a failure in the
middle of a stream is written as the dialect's error event, never a broken stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from modeld.errors import ModeldError, echo
from modeld.server.bridge import Bridge
from modeld.server.gateway import Gateway
from modeld.server.http.catalog import Catalog
from modeld.server.http.conversations import Conversations, Event, collect, collect_choices, first_event
from modeld.server.http.dialect import Asked, Dialect
from modeld.server.http.drain import Drain
from modeld.server.http.errors import ErrorStyle, HttpError, from_modeld, incident_id
from modeld.server.http.turn import Turn

__all__ = ["Runner", "error_response"]

log = logging.getLogger("modeld.http")

A = TypeVar("A", bound=Asked)


def error_response(error: HttpError, style: ErrorStyle) -> JSONResponse:
    return JSONResponse(style(error), status_code=error.status, headers=error.headers())


class Runner:
    """Runs turns and answers them (``max_output_tokens``: the output limit of a request that
    sets none, ``modeld serve --max-output-tokens``)."""

    def __init__(
        self,
        gateway: Gateway,
        bridge: Bridge,
        catalog: Catalog,
        conversations: Conversations,
        drain: Drain,
        max_output_tokens: int = 0,
    ) -> None:
        self.gateway = gateway
        self.bridge = bridge
        self.catalog = catalog
        self.conversations = conversations
        self.drain = drain
        self.max_output_tokens = max_output_tokens

    def _budgeted(self, turn: Turn) -> Turn:
        if turn.max_tokens is None and self.max_output_tokens:
            return replace(turn, max_tokens=self.max_output_tokens)
        return turn

    async def answer(self, request: Request, dialect: Dialect[A], asked: A) -> Response:
        """Run the asked turn and answer it: ``n`` choices in one body (where the dialect has
        them), a stream, or one JSON body."""
        if asked.turn.n > 1 and dialect.choices is not None:
            return await self._choices(dialect, asked)
        return await self._one(request, dialect, asked)

    async def _one(self, request: Request, dialect: Dialect[A], asked: A) -> Response:
        leave = (
            self.drain.enter()
        )  # before the check: a drain beginning now waits for this turn or refuses it
        handed = False  # to the stream, which leaves when it ends
        try:
            if self.drain.draining:
                leave()
                await self.drain.refuse()
            turn = self._budgeted(asked.turn)
            entry = self.catalog.entry(turn.model)
            events = self.conversations.run(turn, self.catalog.open_request(entry, turn, asked.keep_alive))
            task = asyncio.current_task()
            watcher = asyncio.create_task(_watch_disconnect(request, task))
            try:
                started = await first_event(events)
                headers = {"X-Modeld-Session": started.session_id, **dialect.headers()}
                if turn.stream:
                    watcher.cancel()  # the streaming response watches for the disconnect from here on
                    headers["Cache-Control"] = "no-cache"
                    response = StreamingResponse(
                        _closing(
                            dialect.stream(asked, started, events),
                            events,
                            dialect.error,
                            ndjson=dialect.ndjson,
                            done=leave,
                        ),
                        media_type=dialect.media_type,
                        headers=headers,
                    )
                    handed = True
                    return response
                async with contextlib.aclosing(events):
                    done = await collect(started, events)
                if done.finished.error is not None:
                    return error_response(done.finished.error, dialect.error)
                return JSONResponse(dialect.complete(asked, done), headers=headers)
            except BaseException:
                await events.aclose()
                raise
            finally:
                watcher.cancel()
        finally:
            if not handed:
                leave()

    async def _choices(self, dialect: Dialect[A], asked: A) -> Response:
        """Run ``turn.n`` choices in the turn's conversation and answer them in one JSON body:
        decoded together from the prompt's KV where the engine can fork it, else (the backend
        decodes one choice at a time, or the KV pool has no room for the forks) the first, then
        the others one after another, each reusing the warm prompt; greedy choices are all the
        same, so they are decoded once (the answer says which, ``choices_note``)."""
        assert dialect.choices is not None
        turn = self._budgeted(asked.turn)
        entry = self.catalog.entry(turn.model)
        greedy = turn.decode.temperature <= 0
        first = turn.choice(0) if greedy else turn
        events = self.conversations.run(first, self.catalog.open_request(entry, first))
        async with contextlib.aclosing(events):
            started = await first_event(events)
            dones = await collect_choices(started, events)
        if greedy:  # no draw to differ by: every choice is the first, exactly
            why = "greedy decoding (temperature 0) gives every choice the same tokens"
            once = replace(dones[0], started=replace(started, decoded="once", why=why))
            dones = [once] * turn.n
        for index in range(len(dones), turn.n if dones[0].finished.error is None else 0):
            one = turn.choice(index)
            more = self.conversations.run(one, self.catalog.open_request(entry, one))
            async with contextlib.aclosing(more):
                dones.append(await collect(await first_event(more), more))
            if dones[-1].finished.error is not None:
                break
        for done in dones:
            if done.finished.error is not None:
                return error_response(done.finished.error, dialect.error)
        return JSONResponse(dialect.choices(asked, dones), headers={"X-Modeld-Session": started.session_id})

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


async def _closing(
    body: AsyncIterator[bytes],
    events: AsyncGenerator[Event, None],
    style: ErrorStyle,
    *,
    ndjson: bool,
    done: Callable[[], None],
) -> AsyncIterator[bytes]:
    """A streamed answer that always closes its turn (the client went away: the decode stops)
    and writes an unexpected failure as the API's error event instead of a broken stream."""

    def frame(error: HttpError) -> bytes:
        data = json.dumps(style(error)).encode()
        return data + b"\n" if ndjson else b"data: " + data + b"\n\n"

    try:
        async for part in body:
            yield part
    except (HttpError, ModeldError) as exc:
        yield frame(exc if isinstance(exc, HttpError) else from_modeld(exc, incident_id()))
    except Exception as exc:
        incident = incident_id()
        log.error("internal error while streaming (incident %s)", incident, exc_info=exc)
        yield frame(
            HttpError(500, f"internal error (incident {incident}; see the daemon's log)", code="internal")
        )
    finally:
        try:
            await events.aclose()
        finally:
            done()


async def _watch_disconnect(request: Request, task: asyncio.Task[Any] | None) -> None:
    """Cancel the request's task when the client disconnects before its answer is complete."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if task is not None:
                    task.cancel()
                return
