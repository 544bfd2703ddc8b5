"""The shared HTTP layer, seen through every API: each API's sampler map takes its ranges from
the one sampler table (``modeld/decoding/samplers.py``), an image or an over-long id is refused
the same way whatever API carries it, a path no route serves is answered in the words of the API
that owns it, and the describe timeout the daemon is given is the one the HTTP API waits."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anthropic as anthropic_sdk
import httpx
import httpx2
import pytest

from modeld.contract import DecodeConfig, ModelInfo, OpenSessionRequest
from modeld.decoding.samplers import sampler
from modeld.engine import Engine, Limits
from modeld.server.gateway import Gateway
from modeld.server.http.anthropic import request as anthropic
from modeld.server.http.app import HttpService
from modeld.server.http.errors import HttpError
from modeld.server.http.models import ModelRegistry, default_model
from modeld.server.http.ollama import request as ollama
from modeld.server.http.openai import request as openai
from modeld.server.http.requests import SamplerMap
from modeld.server.http.responses import request as responses
from modeld.server.http.routes import build_app
from modeld.settings import HttpSettings

USER = {"role": "user", "content": "hi"}


def _openai(fields: Mapping[str, Any]) -> DecodeConfig:
    return openai.parse_chat({"model": "m", "messages": [USER], **fields}, {}, Limits()).turn.decode


def _anthropic(fields: Mapping[str, Any]) -> DecodeConfig:
    body = {"model": "m", "max_tokens": 1, "messages": [USER], **fields}
    return anthropic.parse_messages(body, {}, Limits()).turn.decode


def _responses(fields: Mapping[str, Any]) -> DecodeConfig:
    turn, _, _ = responses.parse_response_request({"model": "m", "input": "hi", **fields}, {}, None, Limits())
    return turn.decode


def _ollama(fields: Mapping[str, Any]) -> DecodeConfig:
    body = {"model": "m", "messages": [USER], "options": dict(fields)}
    return ollama.parse_chat(body, {}, Limits(), 0.0).turn.decode


APIS: list[tuple[str, Callable[[Mapping[str, Any]], DecodeConfig], SamplerMap, str]] = [
    ("openai", _openai, openai.SAMPLERS, ""),
    ("anthropic", _anthropic, anthropic.SAMPLERS, ""),
    ("responses", _responses, responses.SAMPLERS, ""),
    ("ollama", _ollama, ollama.SAMPLERS, "options."),
]


def _scalar_samplers() -> Iterator[Any]:
    for api, parse, fields_, where in APIS:
        for name, field in fields_.items():
            if sampler(field.sampler).kind in ("int", "float"):
                yield pytest.param(parse, name, field, where, id=f"{api}-{name}")


@pytest.mark.parametrize(("parse", "name", "field", "where"), list(_scalar_samplers()))
def test_every_api_reads_a_sampler_within_the_sampler_tables_range(
    parse: Callable[[Mapping[str, Any]], DecodeConfig], name: str, field: Any, where: str
) -> None:
    """The top of a sampler's range is the table's, or the API's own where its spec narrows it
    (OpenAI's temperature 2, Anthropic's 1): the top is taken, beyond it is a 400 naming the
    field; a value that means "unset" to the API leaves the sampler off."""
    row = sampler(field.sampler)
    top = row.high if field.high is None else field.high
    value = int(top) if row.kind == "int" else top
    assert getattr(parse({name: value}), row.name) == value
    beyond = value + 1 if row.kind == "int" else value * 1.5 + 0.5
    with pytest.raises(HttpError) as refused:
        parse({name: beyond})
    assert (refused.value.status, refused.value.param) == (400, where + name)
    if field.unset is not None:
        assert getattr(parse({name: field.unset}), row.name) == row.default
    elif row.low_open:
        with pytest.raises(HttpError) as low:
            parse({name: row.low})
        assert low.value.param == where + name and "must be in (" in low.value.message


def test_repeat_penalty_has_the_sampler_tables_range_on_every_api_that_takes_it() -> None:
    """It was 0-10 at the HTTP edge and (0, 100] in the engine: a penalty of 50 reached no engine,
    and 0 failed only after the turn started. Both APIs that take it now read the table's range."""
    assert _openai({"repeat_penalty": 50}).repeat_penalty == 50
    assert _ollama({"repeat_penalty": 50}).repeat_penalty == 50
    for parse, param in ((_openai, "repeat_penalty"), (_ollama, "options.repeat_penalty")):
        with pytest.raises(HttpError) as refused:
            parse({"repeat_penalty": 0})
        assert refused.value.param == param


@pytest.mark.parametrize(
    ("parse", "fields", "param"),
    [
        (
            _openai,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        (
            _responses,
            {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        (
            _anthropic,
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            _anthropic,
            {"system": [{"type": "document", "source": {}}]},
            "system[0].type",
        ),
    ],
)
def test_an_image_or_a_document_is_refused_by_name_in_every_api(
    parse: Callable[[Mapping[str, Any]], DecodeConfig], fields: Mapping[str, Any], param: str
) -> None:
    with pytest.raises(HttpError) as refused:
        parse(fields)
    assert (refused.value.code, refused.value.param) == ("unsupported_parameter", param)
    assert "read text only" in refused.value.message


LONG = "c" * 257


@pytest.mark.parametrize(
    ("parse", "fields", "param"),
    [
        (
            _openai,
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": LONG, "type": "function", "function": {"name": "f"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].id",
        ),
        (
            _responses,
            {"input": [{"type": "function_call_output", "call_id": LONG, "output": "ok"}]},
            "input[0].call_id",
        ),
        (
            _anthropic,
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": LONG, "name": "f", "input": {}}],
                    },
                ]
            },
            "messages.1.content.0.id",
        ),
        (
            _anthropic,
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": LONG}]}]},
            "messages.0.content.0.tool_use_id",
        ),
    ],
)
def test_an_id_is_checked_alike_in_every_api(
    parse: Callable[[Mapping[str, Any]], DecodeConfig], fields: Mapping[str, Any], param: str
) -> None:
    with pytest.raises(HttpError) as refused:
        parse(fields)
    assert (refused.value.code, refused.value.param) == ("invalid_value", param)
    assert refused.value.message.endswith("of at most 256 characters")


def _service(engine: Engine, **kwargs: Any) -> HttpService:
    registry = ModelRegistry("memory", fallback=default_model("memory"))
    return HttpService(Gateway(engine, Limits()), registry, HttpSettings(), **kwargs)


def _get(service: HttpService, path: str, method: str = "GET") -> httpx.Response:
    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.request(method, path, json={} if method == "POST" else None, timeout=60)

    return asyncio.run(ask())


def test_a_path_no_route_serves_is_answered_in_the_words_of_the_api_that_owns_it() -> None:
    engine = Engine(backends=("memory",))
    service = _service(engine)
    try:
        ollama_words = _get(service, "/api/nothing")
        assert (ollama_words.status_code, ollama_words.json()) == (404, {"error": "no such route"})
        anthropic_words = _get(service, "/v1/messages/nothing", "POST")
        assert anthropic_words.json() == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "no such route"},
            "request_id": anthropic_words.headers["request-id"],  # Anthropic's, in body and header
        }
        openai_words = _get(service, "/v1/nothing")
        assert openai_words.json()["error"]["code"] == "not_found"
        assert _get(service, "/api/chat").json() == {"error": "method not allowed"}
    finally:
        service.close()
        engine.shutdown()


def test_the_describe_timeout_reaches_the_http_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--describe-timeout`` is the HTTP API's too (it used to keep its own 30 s): a model whose
    description hangs is listed without its window once the timeout given passes."""
    engine = Engine(backends=("memory",))
    release = threading.Event()
    real = engine.describe

    def hung(request: OpenSessionRequest) -> ModelInfo:
        release.wait(60)
        return real(request)

    monkeypatch.setattr(engine, "describe", hung)
    service = _service(engine, describe_seconds=0.5)
    try:
        began = time.monotonic()
        listed = _get(service, "/v1/models").json()["data"]
        assert time.monotonic() - began < 10
        assert [m["id"] for m in listed] == ["modeld-tiny"] and "context_length" not in listed[0]
        assert service.catalog.describe_seconds == 0.5
    finally:
        release.set()
        service.close()
        engine.shutdown()


def test_an_overloaded_daemon_is_anthropics_529_with_its_request_id() -> None:
    """A draining daemon's 503 is Anthropic's 529 ``overloaded_error`` on the Messages API (what
    Claude Code retries), the SDK's ``OverloadedError``; the error body carries the
    ``request_id`` the ``request-id`` header carries. Other APIs keep 503."""
    engine = Engine(backends=("memory",))
    service = _service(engine)

    async def ask() -> tuple[anthropic_sdk.APIStatusError, httpx2.Response]:
        transport = httpx2.ASGITransport(app=build_app(service))  # the SDK's own HTTP client
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = anthropic_sdk.AsyncAnthropic(
                base_url="http://127.0.0.1", api_key="x", http_client=http, max_retries=0
            )
            try:
                await client.messages.create(
                    model="modeld-tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
                )
            except anthropic_sdk.APIStatusError as exc:
                openai_words = await http.post(
                    "/v1/chat/completions",
                    json={"model": "modeld-tiny", "messages": [{"role": "user", "content": "hi"}]},
                )
                return exc, openai_words
        raise AssertionError("the draining daemon answered")

    try:
        service.drain.begin()
        service.drain.release()  # the warm state is saved: held turns get their 503
        error, other = asyncio.run(ask())
        assert isinstance(error, anthropic_sdk.OverloadedError) and error.status_code == 529
        body = error.body
        assert isinstance(body, dict) and body["error"]["type"] == "overloaded_error"
        assert body["request_id"] == error.response.headers["request-id"] == error.request_id
        assert error.response.headers["retry-after"]
        assert other.status_code == 503
    finally:
        service.close()
        engine.shutdown()


def test_a_turn_is_counted_against_the_window_only_near_it() -> None:
    """Counting a prompt costs about a warm turn's own preparation: a turn far from the window
    is not counted (its conversation's measured tokens per byte say so); one near it is, and one
    beyond it is refused with the numbers, or truncated oldest-first where the API truncates."""
    from modeld.contract import DecodeConfig as Decode
    from modeld.server.http.errors import WindowExceededError
    from modeld.server.http.turn import Keys, Message, Turn
    from modeld.server.http.window import Window

    counted: list[int] = []

    async def count(turn: Turn) -> int:  # one token per byte, as the memory backend counts
        tokens = sum(len(m.content) for m in turn.messages) + 8 * len(turn.messages)
        counted.append(tokens)
        return tokens

    def turn(*texts: str, truncate: bool = False, key: str = "c") -> Turn:
        messages = tuple(Message("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(texts))
        return Turn(
            api="t", model="m", decode=Decode(), keys=Keys(header=key), messages=messages, truncate=truncate
        )

    window = Window()
    small = turn("a" * 1000)
    assert asyncio.run(window.fitted(small, 100_000, count)) is small and counted == []  # far: not counted
    assert asyncio.run(window.fitted(small, 1200, count)) is small and counted == [1008]  # near: counted
    window.measured(small, 250)  # this conversation takes a token per 4 bytes
    assert asyncio.run(window.fitted(small, 1200, count)) is small and counted == [1008]  # now far
    with pytest.raises(WindowExceededError) as refused:
        asyncio.run(window.fitted(turn("a" * 2000, key="new"), 1200, count))
    assert (refused.value.prompt_tokens, refused.value.window) == (2008, 1200)
    long = turn("a" * 500, "b" * 500, "c" * 500, "d" * 100, truncate=True, key="ollama")
    kept = asyncio.run(window.fitted(long, 1200, count))
    assert [m.content[0] for m in kept.messages] == ["b", "c", "d"]  # the oldest left out, no more


def test_health_says_starting_until_the_daemon_announces_itself() -> None:
    """The daemon binds its HTTP listener before its gRPC server and owner record: until it
    announces itself, ``/health`` is 503 "starting" (a client that waits for a 200 then finds the
    gRPC endpoint in the owner record too)."""
    engine = Engine(backends=("memory",))
    service = _service(engine, starting=True)
    try:
        starting = _get(service, "/health")
        assert (starting.status_code, starting.json()) == (
            503,
            {"status": "unavailable", "reason": "starting"},
        )
        service.announce()
        assert _get(service, "/health").json() == {"status": "ok"}
    finally:
        service.close()
        engine.shutdown()
