"""What a web page, a careless client or a fuzzer can send to the HTTP APIs, against a real
``modeld serve --http`` (memory backend).

A page in a browser can send a "simple" cross-site POST (``text/plain``, a form) with no
preflight, from an origin that may be ``null`` (sandboxed frames, ``file://``) or an
extension's: every route refuses any Origin that is not a loopback http(s) origin or allowed by
``--allow-origin``, and every POST that is not JSON. Bodies with a lone surrogate, deep nesting,
wrong types or junk bytes get the API's JSON 4xx, never a 5xx and never a traceback.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from daemon_proc import modeld, serve_http, stop
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"
POSTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/chat",
    "/api/generate",
    "/api/show",
]
GETS = [
    "/v1/models",
    "/api/tags",
    "/api/ps",
    "/api/version",
    "/",
    "/server_info",
    "/model_info",
    "/get_load",
    "/v1/loads",
    "/metrics",
]
GOOD = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 1, "store": False},
    "/v1/messages": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/api/chat": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "options": {"num_predict": 1},
    },
    "/api/generate": {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 1}},
    "/api/show": {"model": MODEL},
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    tmp = Path(tempfile.mkdtemp(prefix="mdx"))
    proc, record = serve_http(tmp, "--allow-origin", "https://app.example")
    try:
        yield record.http_endpoint
    finally:
        _, err = stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
        assert "Traceback" not in err, err[-3000:]


def test_every_route_refuses_web_origins_that_are_not_loopback(url: str) -> None:
    for origin in ("null", "file://", "https://evil.example", "chrome-extension://abcdef", "http://10.0.0.1"):
        for path in POSTS:
            r = httpx.post(url + path, json=GOOD[path], headers={"Origin": origin}, timeout=30)
            assert r.status_code == 403, (origin, path, r.status_code)
        for method, template in FUZZ_OTHERS:  # every other route, path parameters included
            if template == "/health":  # a liveness probe: no key, no origin, nothing to drive
                continue
            path = template.replace("{name:path}", "x").replace("{id}", "x")
            r = httpx.request(method, url + path, headers={"Origin": origin}, timeout=30)
            assert r.status_code == 403, (origin, method, path, r.status_code)
    for origin in ("http://localhost:3000", "http://127.0.0.1:9", "https://app.example"):
        for path in POSTS:
            r = httpx.post(url + path, json=GOOD[path], headers={"Origin": origin}, timeout=60)
            assert r.status_code == 200, (origin, path, r.text[:300])


def test_a_post_from_a_page_must_be_json(url: str) -> None:
    """text/plain, a form or no type at all: the "simple" requests a page can send unseen. A
    browser always sends Origin with them (here a loopback page's, which is allowed), so they
    are refused; the same bodies without Origin (curl -d, Ollama's documented examples, which
    send a form type) are not a page's and are read as JSON."""
    page = {"Origin": "http://localhost:3000"}
    for path in POSTS:
        data = json.dumps(GOOD[path])
        for kind in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            None,
        ):
            headers = {"Content-Type": kind} if kind else {}
            r = httpx.post(url + path, content=data, headers={**headers, **page}, timeout=30)
            assert r.status_code == 415, (path, kind, r.status_code)
        for kind in ("application/x-www-form-urlencoded", None):
            headers = {"Content-Type": kind} if kind else {}
            r = httpx.post(url + path, content=data, headers=headers, timeout=60)
            assert r.status_code == 200, (path, kind, r.text[:300])
        ok = httpx.post(
            url + path,
            content=data,
            headers={"Content-Type": "application/json; charset=utf-8", **page},
            timeout=60,
        )
        assert ok.status_code == 200, (path, ok.text[:300])


def test_a_lone_surrogate_is_a_clean_400_on_every_route(url: str) -> None:
    """Escaped, written as its three raw bytes (JSON decodes bytes with ``surrogatepass``), or
    in a UTF-16 body (JSON detects the encoding)."""
    lone = '{"messages": [{"content": "a\ud83d"}]}'
    for path in POSTS:
        for body in (
            b'{"model": "\\ud800"}',
            b'{"model": "x", "\\udfff": 1}',
            b'{"messages": [{"content": "a\\ud83d"}]}',
            lone.encode("utf-8", "surrogatepass"),
            lone.encode("utf-16", "surrogatepass"),
        ):
            r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code == 400, (path, body, r.status_code)
            assert "surrogate" in r.text


_any_text = st.text(st.characters(blacklist_categories=()), max_size=12)  # lone surrogates too


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.integers() | _any_text,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_any_text, inner, max_size=4),
        max_leaves=12,
    ),
    st.sampled_from(["ascii", "utf-8", "utf-16", "utf-32"]),
)
@example(
    functools.reduce(lambda inner, _: [inner], range(128), "x"), "utf-8"
)  # a string past the depth limit
def test_the_body_check_refuses_exactly_what_checking_every_string_refuses(value: Any, encoding: str) -> None:
    """The fast path (no surrogate escape or bytes in a UTF-8 body: only the nesting is walked)
    refuses exactly what checking every string does, however the body is encoded."""
    from modeld.server.http.errors import HttpError
    from modeld.server.http.fields import check_body, check_strings

    text = json.dumps({"v": value}, ensure_ascii=encoding == "ascii")
    data = text.encode("utf-8" if encoding == "ascii" else encoding, "surrogatepass")
    body = json.loads(data)

    def refused(check: Any, *args: Any) -> bool:
        try:
            check(*args)
        except HttpError:
            return True
        return False

    assert refused(check_body, body, data) == refused(check_strings, body)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
_fields = st.sampled_from(
    [
        "model",
        "messages",
        "input",
        "prompt",
        "max_tokens",
        "tools",
        "tool_choice",
        "stream",
        "system",
        "options",
        "format",
        "response_format",
        "temperature",
        "stop",
        "n",
        "metadata",
        "thinking",
        "previous_response_id",
        "text",
    ]
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=st.sampled_from(POSTS),
    changes=st.dictionaries(_fields, _json, max_size=4),
    junk=st.booleans(),
    raw=st.binary(max_size=64),
)
def test_fuzzed_bodies_never_get_a_5xx(
    url: str, path: str, changes: dict[str, Any], junk: bool, raw: bytes
) -> None:
    if junk:
        content = raw
    else:
        try:
            content = json.dumps({**GOOD[path], **changes}, allow_nan=True).encode()
        except (ValueError, OverflowError):
            return
    r = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code < 500, (path, content[:300], r.status_code, r.text[:300])
    assert "Traceback" not in r.text


def _route_table() -> set[tuple[str, str]]:
    """Every (method, path template) the HTTP app serves, read from the app itself."""
    from starlette.routing import Route, WebSocketRoute

    from modeld.engine import Engine, Limits
    from modeld.server.gateway import Gateway
    from modeld.server.http.app import HttpService
    from modeld.server.http.models import ModelRegistry, default_model
    from modeld.server.http.routes import build_app
    from modeld.settings import HttpSettings

    engine = Engine(backends=("memory",))
    service = HttpService(
        Gateway(engine, Limits()),
        ModelRegistry("memory", fallback=default_model("memory")),
        HttpSettings(),
    )
    try:
        table = set()
        for route in build_app(service).routes:
            if isinstance(
                route, WebSocketRoute
            ):  # the Responses WebSocket: tests/http/test_responses_websocket.py
                continue
            assert isinstance(route, Route)
            for method in route.methods or ():
                if method != "HEAD":
                    table.add((method, route.path))
        return table
    finally:
        service.close()
        engine.shutdown()


def test_the_fuzz_covers_every_route() -> None:
    """A route added later is fuzzed too, or this fails: every (method, path) the app serves is
    one the fuzz below sends (unprefixed OpenAI paths and path parameters included)."""
    fuzzed = {("POST", p) for p in FUZZ_POSTS} | {(m, p) for m, p in FUZZ_OTHERS}
    assert _route_table() == fuzzed


FUZZ_POSTS = [*POSTS, "/chat/completions", "/completions", "/responses"]
"""POST routes the body fuzz sends (the /v1-less OpenAI paths are the same handlers)."""
FUZZ_OTHERS = [
    *(("GET", p) for p in GETS),
    ("GET", "/health"),
    ("GET", "/models"),
    ("GET", "/v1/models/{name:path}"),
    ("GET", "/models/{name:path}"),
    ("GET", "/v1/responses"),
    ("GET", "/responses"),
    ("GET", "/v1/responses/{id}"),
    ("DELETE", "/v1/responses/{id}"),
    ("GET", "/responses/{id}"),
    ("DELETE", "/responses/{id}"),
    ("GET", "/get_server_info"),
    ("GET", "/get_model_info"),
    ("GET", "/ui"),
    ("GET", "/ui/state"),
    ("GET", "/ui/events"),
    ("GET", "/ui/{name:path}"),
    ("GET", "/v1/requests"),
    ("GET", "/v1/requests/{id}"),
]

_junk_text = st.text(max_size=30) | st.sampled_from(["\ud800", "..", "%", "%00", "a/b", "x" * 5000, "\x00"])
_headers = st.dictionaries(
    st.sampled_from(
        [
            "accept",
            "authorization",
            "x-api-key",
            "anthropic-version",
            "anthropic-beta",
            "openai-organization",
            "x-modeld-conversation",
            "x-request-id",
            "content-encoding",
            "accept-encoding",
        ]
    ),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
    | st.sampled_from(["application/openmetrics-text; version=9.9", "text/*; q=x", "gzip", "Bearer "]),
    max_size=3,
)


def _quote(value: str) -> str:
    from urllib.parse import quote

    return quote(value.encode("utf-8", "surrogatepass"), safe="")


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    route=st.sampled_from(FUZZ_OTHERS + [("POST", p) for p in FUZZ_POSTS]),
    param=_junk_text,
    query=st.dictionaries(st.text(max_size=8), _junk_text, max_size=3),
    headers=_headers,
    changes=st.dictionaries(_fields, _json, max_size=3),
)
def test_fuzzed_paths_queries_and_headers_on_every_route_never_get_a_5xx(
    url: str,
    route: tuple[str, str],
    param: str,
    query: dict[str, str],
    headers: dict[str, str],
    changes: dict[str, Any],
) -> None:
    """Path parameters (a lone surrogate percent-encoded, dots, NULs, 5000 characters), query
    strings and the headers the APIs read, on every route: a 4xx in the API's JSON shape or a
    success, never a 5xx or a traceback."""
    method, template = route
    headers = {k: v.strip() for k, v in headers.items() if v.strip()}  # what HTTP can carry
    path = template.replace("{name:path}", _quote(param)).replace("{id}", _quote(param) or "x")
    target = (
        url + path + ("?" + "&".join(f"{_quote(k)}={_quote(v)}" for k, v in query.items()) if query else "")
    )
    body: bytes | None = None
    if method == "POST":
        known = template if template in GOOD else "/v1" + template
        try:
            body = json.dumps({**GOOD[known], **changes}, allow_nan=True).encode()
        except (ValueError, OverflowError):
            return
        headers = {**headers, "content-type": "application/json"}
    if template == "/ui/events":  # a stream that never ends: its status and first event
        with httpx.stream(method, target, headers=headers, timeout=60) as streamed:
            if streamed.status_code == 200:
                assert next(streamed.iter_lines()).startswith("event: state")
            r = httpx.Response(
                streamed.status_code,
                headers=streamed.headers,
                content=b"" if streamed.status_code == 200 else streamed.read(),
            )
    else:
        r = httpx.request(method, target, content=body, headers=headers, timeout=60)
    assert r.status_code < 500 or (template == "/health" and r.status_code == 503), (
        method,
        path[:200],
        headers,
        r.status_code,
        r.text[:300],
    )
    assert "Traceback" not in r.text
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), (path[:200], r.text[:200])


def test_no_token_off_loopback_is_refused() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mdn"))
    try:
        done = modeld(
            "serve",
            "--backend",
            "memory",
            "--listen",
            "0.0.0.0:0",
            "--allow-remote",
            "--no-token",
            data_dir=tmp,
        )
        assert done.returncode == 2 and "--no-token" in done.stderr
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_request_bytes_in_flight_are_bounded() -> None:
    """Large bodies that arrive together beyond ``max_inflight_bytes`` get a 503 with
    Retry-After (they used to take the daemon to 768 MB); once the first is answered the next
    is served. In process, on the memory backend, with a slow decode holding the first."""
    import asyncio

    from modeld.engine import Engine, Limits
    from modeld.server.gateway import Gateway
    from modeld.server.http.app import HttpService
    from modeld.server.http.models import ModelRegistry, default_model
    from modeld.server.http.routes import build_app
    from modeld.settings import HttpSettings

    engine = Engine(backends=("memory",))
    service = HttpService(
        Gateway(engine, Limits()),
        ModelRegistry("memory", fallback=default_model("memory")),
        HttpSettings(max_inflight_bytes=3 << 20),
    )
    app = build_app(service)
    padding = {"note": "x" * (2 << 20)}  # metadata: accepted, never tokenized

    async def scenario() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            slow = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "metadata": padding,
                "max_tokens": 20,
                "delay_ms": 50,
            }
            first = asyncio.create_task(client.post("/v1/chat/completions", json=slow, timeout=60))
            await asyncio.sleep(0.5)  # the first is decoding, its 2 MiB still held
            second = await client.post("/v1/chat/completions", json={**slow, "max_tokens": 1}, timeout=60)
            done = await first
            third = await client.post("/v1/chat/completions", json={**slow, "max_tokens": 1}, timeout=60)
            assert second.headers.get("retry-after") == "1", second.text
            assert second.json()["error"]["param"] == "max_inflight_bytes"
            return [done.status_code, second.status_code, third.status_code]

    try:
        assert asyncio.run(scenario()) == [200, 503, 200]
    finally:
        service.close()
        engine.shutdown()
