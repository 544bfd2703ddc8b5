"""The Responses API over a WebSocket (issue 33, item 10), driven by the official ``openai`` SDK
(``client.responses.connect()``) against a real ``modeld serve --http`` (the memory backend:
one token per byte, so every count is exact).

The socket is the warm session: a turn sends only its new input and ``previous_response_id``,
and reuses every token of the turn before; ``generate: false`` prewarms; errors are events and
the socket stays open; the upgrade is refused where HTTP must serve instead (426).
(Codex over the socket, with its bytes per turn against HTTP: tests/agents/test_agents.py.)
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from daemon_proc import serve_http, stop

pytestmark = [
    pytest.mark.wire,
    # openai 3.x opens its socket with websockets' connect() outside a with block, which websockets
    # 17.1 deprecates: the SDK's warning, not modeld's.
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]

MODEL = "modeld-tiny"
SYSTEM = "You are a careful engineer. Answer in one line.\n"
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


class Daemon:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        # Without the prefill ahead (the default; tests/http/test_prefill_ahead.py): these tests read each
        # turn's own reuse and the session's state right after its answer, which a prefill ahead changes.
        self.proc, record = serve_http(tmp, "--no-prefill-ahead")
        self.url = record.http_endpoint
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def close(self) -> None:
        self.client.close()
        _, err = stop(self.proc)
        assert "Traceback" not in err, err[-3000:]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdws"))
    d = Daemon(tmp)
    try:
        yield d
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def turn(connection: Any, **create: Any) -> tuple[list[str], Any]:
    """Send one response.create; the kinds of the events that answer it, and the last event."""
    connection.send({"type": "response.create", "model": MODEL, "store": False, **create})
    kinds = []
    for event in connection:
        kinds.append(event.type)
        if event.type in TERMINAL:
            return kinds, event
    raise AssertionError(f"the socket closed after {kinds}")


def test_the_socket_is_the_warm_session(daemon: Daemon) -> None:
    with daemon.client.responses.connect() as connection:
        kinds, first = turn(
            connection, instructions=SYSTEM, input="Why does test_lease fail?\n", max_output_tokens=4
        )
        assert (
            kinds[:2] == ["response.created", "response.in_progress"] and "response.output_item.done" in kinds
        )
        one = first.response
        # Only the new input and the previous response's id: the socket holds the conversation
        # (instructions are the request's own, never carried over: OpenAI's rule).
        _, second = turn(
            connection,
            instructions=SYSTEM,
            previous_response_id=one.id,
            input="Fix it.\n",
            max_output_tokens=4,
        )
        two = second.response
        assert two.previous_response_id == one.id
        assert two.modeld["session_id"] == one.modeld["session_id"]  # type: ignore[attr-defined]
        # The prompt and answer stayed warm; an answer cut off at max_output_tokens leaves its last
        # token unevaluated (blueprint 0019), so one less.
        resident = one.usage.input_tokens + one.usage.output_tokens - (one.status == "incomplete")
        assert two.usage.input_tokens_details.cached_tokens == resident
        assert (two.modeld["reuse"], two.modeld["reason"]) == ("warm", "extended")  # type: ignore[attr-defined]


def test_generate_false_prewarms_and_the_next_turn_reuses_it(daemon: Daemon) -> None:
    with daemon.client.responses.connect() as connection:
        _, warmed = turn(connection, instructions=SYSTEM, input="Read the plan.\n", generate=False)
        prewarm = warmed.response
        assert (warmed.type, prewarm.output, prewarm.usage.output_tokens) == ("response.completed", [], 0)
        _, served = turn(
            connection, instructions=SYSTEM, previous_response_id=prewarm.id, input=[], max_output_tokens=3
        )
        assert served.response.usage.input_tokens == prewarm.usage.input_tokens
        assert served.response.usage.input_tokens_details.cached_tokens == prewarm.usage.input_tokens


def test_errors_are_events_and_the_socket_stays_open(daemon: Daemon) -> None:
    with daemon.client.responses.connect() as connection:
        _, missing = turn(connection, previous_response_id="resp_nothing", input="hi\n")
        assert (missing.type, missing.status, missing.error.code) == (
            "error",
            400,
            "previous_response_not_found",
        )
        _, lanes = turn(connection, stream_id="lane-2", input="hi\n")
        assert (lanes.error.code, lanes.error.param) == ("unsupported_parameter", "stream_id")
        connection.send_raw("not json")  # type: ignore[attr-defined]
        bad = next(iter(connection))
        assert (bad.type, bad.error.code) == ("error", "invalid_json")
        _, ok = turn(connection, input="hi\n", max_output_tokens=2)
        assert ok.type in ("response.completed", "response.incomplete")


def test_a_stored_response_continues_on_another_socket(daemon: Daemon) -> None:
    with daemon.client.responses.connect() as connection:
        _, first = turn(
            connection, instructions=SYSTEM, input="Plan the release.\n", max_output_tokens=3, store=True
        )
    with daemon.client.responses.connect() as connection:
        _, second = turn(
            connection,
            instructions=SYSTEM,
            previous_response_id=first.response.id,
            input="Go on.\n",
            max_output_tokens=3,
        )
    assert second.type in ("response.completed", "response.incomplete")
    assert second.response.usage.input_tokens_details.cached_tokens > first.response.usage.input_tokens


def test_a_plain_get_and_a_refused_upgrade_answer_426_or_403(daemon: Daemon) -> None:
    plain = httpx.get(f"{daemon.url}/v1/responses", timeout=10)
    assert plain.status_code == 426 and plain.headers["upgrade"] == "websocket"
    assert plain.json()["error"]["code"] == "upgrade_required"
    # A page in a browser opens a WebSocket with its Origin: refused before the upgrade.
    with (
        pytest.raises(Exception) as refused,  # the websockets library's error, whichever the SDK lets through
        daemon.client.responses.connect(extra_headers={"Origin": "https://evil.example"}) as connection,
    ):
        turn(connection, input="hi\n")
    assert "403" in str(refused.value) or "1008" in str(refused.value), refused.value


def test_past_the_socket_limit_the_upgrade_is_426_and_http_serves(daemon: Daemon) -> None:
    """With MAX_SOCKETS open, one more upgrade is answered 426 (what makes Codex use HTTP);
    closing one makes room again."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from modeld.server.http.responses.websocket import MAX_SOCKETS

    url = daemon.url.replace("http://", "ws://") + "/v1/responses"
    held = [connect(url) for _ in range(MAX_SOCKETS)]
    try:
        with pytest.raises(InvalidStatus) as refused:
            connect(url)
        assert refused.value.response.status_code == 426
        assert b"upgrade_required" in refused.value.response.body
        answer = daemon.client.responses.create(model=MODEL, input="hi\n", max_output_tokens=2, store=False)
        assert answer.status in ("completed", "incomplete")
    finally:
        held.pop().close()
    try:
        with connect(url) as again:
            again.send(
                '{"type": "response.create", "model": "modeld-tiny", "input": "hi\\n", "max_output_tokens": 1}'
            )
            assert '"response.created"' in str(again.recv(timeout=60))
    finally:
        for socket in held:
            socket.close()
