"""Request records on a real daemon (memory backend): every API's turns and a gRPC session's,
with their job labels, as JSON (``/v1/requests``), over gRPC (``ListRequests``) and on the
command line (``modeld requests``, ``modeld top``); they survive a restart, and retention by age
removes them at the next one. Security: the page and the records need the API key (or the
page's cookie, which is not the key), an ``Origin: null`` page cannot read them, and prompt text
appears nowhere unless the daemon was started with ``--ui-show-prompts``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from daemon_proc import modeld, serve_http, stop

import runtime_client as rc
from modeld.contract import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.errors import InvalidArgumentError

pytestmark = pytest.mark.wire

SYSTEM = "You review patches for the storage layer. " * 30
MARKER = "ZEBRA-SECRET-7"


def _chat(
    url: str, job: str, system: str, question: str, key: str = "unused"
) -> tuple[str, dict[str, object]]:
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60, default_headers={"X-Modeld-Job": job}
    )
    raw = client.chat.completions.with_raw_response.create(
        model="modeld-tiny",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=6,
    )
    return raw.headers["x-modeld-request"], raw.parse().model_dump()


def test_records_of_every_transport_by_job_survive_a_restart_and_age_out(tmp_path: Path) -> None:
    data = tmp_path / "d"
    proc, record = serve_http(data, "--ui-show-prompts")
    url = record.http_endpoint
    try:
        first, _ = _chat(url, "suite-1", SYSTEM, "Why does fsync fail?")
        # The system prompt edited in its middle, beside the marker: a partial prefix.
        edited = SYSTEM[:600] + MARKER + SYSTEM[600:]
        second, body = _chat(url, "suite-1", edited, "Why does fsync fail?")
        assert body["modeld"]["reuse"] == "partial"  # type: ignore[index]
        claude = anthropic.Anthropic(
            base_url=url, api_key="unused", max_retries=0, default_headers={"X-Modeld-Job": "suite-2"}
        )
        claude.messages.create(
            model="modeld-tiny", max_tokens=4, messages=[{"role": "user", "content": "hello there"}]
        )
        refused = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            headers={"X-Modeld-Job": "suite-1"},
            timeout=30,
        )
        assert refused.status_code == 404
        long_job = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "modeld-tiny", "messages": [{"role": "user", "content": "x"}]},
            headers={"X-Modeld-Job": "j" * 300},
            timeout=30,
        )
        assert long_job.status_code == 400 and "X-Modeld-Job" in long_job.text

        with rc.connect(data_dir=data, job="grpc-job") as client:
            request = OpenSessionRequest(type="memory", path="notes")
            with client.open_session(request) as session:
                session.ensure_prefix(PrefixInput(text="A long stable prefix. " * 20))
                session.prefill_suffix(SuffixInput(text="now?"))
                with session.decode(DecodeConfig(max_tokens=4)) as stream:
                    list(stream)
                sid = session.session_id
            grpc_records = client.list_requests(job="grpc-job")
            assert [(r.api, r.session, r.finish, r.conversation) for r in grpc_records] == [
                ("grpc", sid, "length", f"grpc:{sid}")
            ]
            assert grpc_records[0].prefix_tokens > 0 and grpc_records[0].generated_tokens == 4
            assert client.request(second) is not None
            assert client.request("no-such-id") is None
            with pytest.raises(InvalidArgumentError, match="limit is 256"):
                client.list_requests(job="j" * 300)
        with rc.connect(data_dir=data, job="j" * 300) as client, pytest.raises(InvalidArgumentError):
            client.open_session(OpenSessionRequest(type="memory", path="notes"))

        async def over_asyncio() -> list[str]:
            async with rc.aconnect(data_dir=data, job="aio-job") as aclient:
                found = await aclient.list_requests(job="grpc-job")
                assert await aclient.request(found[0].id) == found[0]
                # The asyncio client labels its sessions' records as the blocking one does.
                session = await aclient.open_session(OpenSessionRequest(type="memory", path="notes"))
                async with session:
                    await session.ensure_prefix(PrefixInput(text="A long stable prefix. " * 20))
                    stream = await session.decode(DecodeConfig(max_tokens=2))
                    async for _ in stream:
                        pass
                labelled = await aclient.list_requests(job="aio-job")
                assert [(r.api, r.session, r.job) for r in labelled] == [
                    ("grpc", session.session_id, "aio-job")
                ]
                return [r.id for r in found]

        assert asyncio.run(over_asyncio()) == [r.id for r in grpc_records]

        listed = httpx.get(f"{url}/v1/requests", params={"job": "suite-1"}, timeout=30).json()["data"]
        # Each answer left the next turn's prefix computed ahead: a record of its own, its labels.
        aheads = [r for r in listed if r["finish"] == "ahead"]
        assert [(r["api"], r["job"], r["state"]) for r in aheads] == [("openai", "suite-1", "done")] * 2
        turns = [r for r in listed if r["finish"] != "ahead"]
        assert [r["id"] for r in turns[:2]] == [first, second]
        assert [r["finish"] for r in turns] == ["length", "length", "error"]
        assert turns[2]["error"] == "model_not_found" and turns[2]["status"] == 404
        assert turns[1]["outcome"] == "partial" and turns[1]["diverged_segment"] == "system"
        assert MARKER in turns[1]["excerpt"]  # --ui-show-prompts: the slice where it diverged
        assert all(r["bytes_in"] > 0 for r in turns) and turns[0]["bytes_out"] > 0
        recent = httpx.get(f"{url}/v1/requests", params={"job": "suite-1", "since": "1h"}, timeout=30).json()
        assert [r["id"] for r in recent["data"]] == [r["id"] for r in listed]
        future = httpx.get(f"{url}/v1/requests", params={"since": str(time.time() + 60)}, timeout=30).json()
        assert future["data"] == []
        one = httpx.get(f"{url}/v1/requests/{second}", timeout=30).json()
        assert one["id"] == second and one["job"] == "suite-1" and one["api"] == "openai"
        claude_record = httpx.get(f"{url}/v1/requests", params={"job": "suite-2"}, timeout=30).json()["data"]
        assert sorted((r["api"], r["finish"]) for r in claude_record) == [
            ("anthropic", "ahead"),
            ("anthropic", "length"),
        ]
        for bad, param in (({"limit": "0"}, "limit"), ({"bogus": "1"}, "bogus"), ({"job": "x" * 300}, "job")):
            answer = httpx.get(f"{url}/v1/requests", params=bad, timeout=30)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param
        assert httpx.get(f"{url}/v1/requests/nope", timeout=30).status_code == 404

        cli = modeld("requests", "--job", "suite-1", "--json", data_dir=data)
        assert cli.returncode == 0, cli.stderr
        assert [r["id"] for r in json.loads(cli.stdout)] == [r["id"] for r in listed]
        text = modeld("requests", second, data_dir=data)
        assert text.returncode == 0 and "job           suite-1" in text.stdout and "partial" in text.stdout
        top = modeld("top", "--once", data_dir=data)
        assert top.returncode == 0 and "RUNNING" in top.stdout and "modeld-tiny" in top.stdout
    finally:
        _, err = stop(proc)
        assert "Traceback" not in err, err[-3000:]

    # A restart reads them back.
    proc, record = serve_http(data)
    try:
        again = httpx.get(f"{record.http_endpoint}/v1/requests", params={"job": "suite-1"}, timeout=30).json()
        assert [r["id"] for r in again["data"]] == [r["id"] for r in listed]
        assert again["file"]["files"] >= 1
    finally:
        stop(proc)
    # Retention by age: the next start finds them older than a second and removes them.
    time.sleep(1.2)
    proc, record = serve_http(data, "--records-max-age", "1s")
    try:
        gone = httpx.get(f"{record.http_endpoint}/v1/requests", timeout=30).json()
        assert gone["data"] == [] and gone["file"]["files"] == 0
    finally:
        stop(proc)


def test_the_page_and_the_records_need_the_key_refuse_a_null_origin_and_never_show_prompts(
    tmp_path: Path,
) -> None:
    data = tmp_path / "d"
    key = "s3cret-page-key"
    proc, record = serve_http(data, "--api-key", key)
    url = record.http_endpoint
    auth = {"Authorization": f"Bearer {key}"}
    try:
        _chat(url, "secure", SYSTEM + MARKER, "first question", key=key)
        _, body = _chat(url, "secure", SYSTEM[:500] + MARKER + SYSTEM[500:], "second question", key=key)
        assert body["modeld"]["reuse"] == "partial"  # type: ignore[index]
        paths = ("/ui", "/ui/state", "/ui/page.js", "/v1/requests", "/v1/requests/x", "/ui/events")
        for path in paths:
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 401, path
            null = httpx.get(f"{url}{path}", headers={**auth, "Origin": "null"}, timeout=10)
            assert null.status_code == 403, path
            foreign = httpx.get(
                f"{url}{path}", headers={**auth, "Origin": "https://evil.example"}, timeout=10
            )
            assert foreign.status_code == 403, path
        page = httpx.get(f"{url}/ui", headers=auth, timeout=10)
        assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]

        # The page's own way in: the key once in the address, then a cookie that is not the key.
        assert httpx.get(f"{url}/ui", params={"token": "wrong"}, timeout=10).status_code == 401
        with httpx.Client(base_url=url, timeout=10) as browser:
            swap = browser.get("/ui", params={"token": key}, follow_redirects=False)
            assert swap.status_code == 303 and swap.headers["location"] == "/ui"
            cookie = swap.cookies["modeld_ui"]
            assert key not in cookie and "HttpOnly" in swap.headers["set-cookie"]
            assert "SameSite=strict" in swap.headers["set-cookie"]
            assert browser.get("/ui/state").status_code == 200
            assert browser.get("/v1/requests").status_code == 200
            # The cookie opens only the page's read-only routes, never an API.
            chat = browser.post("/v1/chat/completions", json={"model": "modeld-tiny", "messages": []})
            assert chat.status_code == 401

        # At most 16 live pages at once: the 17th is refused, and a page that closes frees its place.
        with contextlib.ExitStack() as pages, httpx.Client(base_url=url, headers=auth, timeout=30) as client:
            for _ in range(16):
                opened = pages.enter_context(client.stream("GET", "/ui/events"))
                assert opened.status_code == 200
            refused = client.get("/ui/events")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            assert refused.json()["error"]["code"] == "limit_exceeded"
        time.sleep(2.5)  # the closed pages' streams end at their next push
        with (
            httpx.Client(base_url=url, headers=auth, timeout=30) as client,
            client.stream("GET", "/ui/events") as again,
        ):
            assert again.status_code == 200

        state = httpx.get(f"{url}/ui/state", headers=auth, timeout=10)
        records = httpx.get(f"{url}/v1/requests", headers=auth, timeout=10)
        assert state.status_code == records.status_code == 200
        assert state.json()["show_prompts"] is False
        diverged = [r for r in records.json()["data"] if r["outcome"] == "partial"]
        assert diverged and diverged[0]["excerpt"] == "" and diverged[0]["diverged_at_token"] is not None
        files = "".join(p.read_text() for p in (data / "requests").glob("*.jsonl"))
        for text in (state.text, records.text, page.text, files):
            assert MARKER not in text and "storage layer" not in text
    finally:
        _, err = stop(proc)
        assert "Traceback" not in err, err[-3000:]


def _record_of_stream(url: str, path: str, body: dict[str, object], job: str) -> dict[str, object]:
    """Stream ``body`` to ``path`` to its end and return the request's finished record (the only
    one of ``job``)."""
    with httpx.stream("POST", f"{url}{path}", json=body, headers={"X-Modeld-Job": job}, timeout=60) as r:
        sent = sum(len(part) for part in r.iter_bytes())
    (found,) = httpx.get(f"{url}/v1/requests", params={"job": job}, timeout=30).json()["data"]
    # Every answer carries its record's id, a refusal raised before the answer too, and the
    # record counts the bytes sent (a refusal's body included).
    assert r.headers["x-modeld-request"] == found["id"]
    assert found["state"] == "done" and found["status"] == r.status_code
    assert found["bytes_out"] == sent > 0
    return found  # type: ignore[no-any-return]


@pytest.mark.parametrize("keepalive", ["10s", "1ms"])
def test_a_stream_that_fails_inside_is_recorded_as_its_error(tmp_path: Path, keepalive: str) -> None:
    """A prompt beyond the window, streamed: answered in the stream (Responses, Codex's channel;
    with a 10 s keep-alive before the stream begins, with 1 ms after keep-alives); Anthropic's is a
    400 before the stream, or its error event after pings; each record is done with the error, its
    status and the bytes sent."""
    proc, record = serve_http(tmp_path / "d", "--num-ctx", "600", "--keepalive-interval", keepalive)
    url = record.http_endpoint
    huge = "x" * 300_000  # counting it takes longer than 1 ms, whatever the machine
    try:
        responses = _record_of_stream(
            url, "/v1/responses", {"model": "modeld-tiny", "input": huge, "stream": True, "store": False}, "r"
        )
        assert (responses["api"], responses["finish"], responses["error"]) == (
            "responses",
            "error",
            "context_length_exceeded",
        )
        ask = {"model": "modeld-tiny", "max_tokens": 8, "stream": True}
        claude = _record_of_stream(
            url, "/v1/messages", {**ask, "messages": [{"role": "user", "content": huge}]}, "a"
        )
        assert (claude["api"], claude["finish"]) == ("anthropic", "error")
        assert claude["status"] == (200 if keepalive == "1ms" else 400)
        assert claude["error"] == "context_length_exceeded"
        assert "the model's window is 600 tokens" in str(claude["error_message"])
    finally:
        _, err = stop(proc)
        assert "Traceback" not in err, err[-3000:]


def test_a_refusal_before_the_answer_carries_its_record_and_its_bytes(tmp_path: Path) -> None:
    """An unknown model, not streamed, on each API (Anthropic's, OpenAI's and Ollama's words):
    the refusal names its record in ``X-Modeld-Request`` and the record has the status and the
    bytes of the body sent (blueprint 0022: they used to be missing and 0)."""
    proc, record = serve_http(tmp_path / "d")
    url = record.http_endpoint
    asks = {
        "/v1/messages": {"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/chat/completions": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        "/api/chat": {"model": "nope", "stream": False, "messages": [{"role": "user", "content": "hi"}]},
    }
    try:
        for i, (path, body) in enumerate(asks.items()):
            r = httpx.post(f"{url}{path}", json=body, headers={"X-Modeld-Job": f"refused{i}"}, timeout=30)
            assert r.status_code == 404, (path, r.status_code, r.text)
            (found,) = httpx.get(f"{url}/v1/requests", params={"job": f"refused{i}"}, timeout=30).json()[
                "data"
            ]
            assert r.headers["x-modeld-request"] == found["id"], path
            assert (found["status"], found["finish"], found["bytes_out"]) == (404, "error", len(r.content)), (
                found
            )
    finally:
        _, err = stop(proc)
        assert "Traceback" not in err, err[-3000:]
