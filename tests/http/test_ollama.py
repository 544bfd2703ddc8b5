"""Ollama's API on modeld's port, driven by the official ``ollama`` Python client against a
real ``modeld serve --http`` (the memory backend: one token per byte).

What an editor integration configured for Ollama does: read the version, list models, show
one (its context window), chat streamed and not (NDJSON), pass tools and a JSON format, see
what is loaded (``/api/ps``), and resend its conversation to find it warm.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from daemon_proc import serve_http, stop

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"


class Daemon:
    def __init__(self, tmp: Path) -> None:
        self.proc, record = serve_http(tmp)
        self.url = record.http_endpoint
        self.client = ollama.Client(host=self.url, timeout=60)

    def close(self) -> None:
        self.client._client.close()  # the client keeps a connection pool and has no close()
        stop(self.proc)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdl"))
    d = Daemon(tmp)
    try:
        yield d
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_an_ollama_client_lists_shows_and_sees_what_is_loaded(daemon: Daemon) -> None:
    assert httpx.get(f"{daemon.url}/api/version", timeout=10).json()["version"]
    listed = daemon.client.list()
    assert [m.model for m in listed.models] == [MODEL]
    shown = daemon.client.show(f"{MODEL}:latest")
    assert shown.modelinfo is not None
    arch = shown.modelinfo["general.architecture"]
    assert shown.modelinfo[f"{arch}.context_length"] == 32768  # the memory model's window, as served
    assert "num_ctx 32768" in (shown.parameters or "")
    daemon.client.chat(
        model=MODEL, messages=[{"role": "user", "content": "load"}], options={"num_predict": 1}
    )
    loaded = daemon.client.ps()
    assert [m.model for m in loaded.models] == [MODEL]
    assert loaded.models[0].context_length == 32768


def test_chat_streamed_and_not_say_the_same_and_the_second_turn_is_warm(daemon: Daemon) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful engineer.\n"},
        {"role": "user", "content": "Why does test_lease fail?\n"},
    ]
    whole = daemon.client.chat(
        model=MODEL, messages=messages, stream=False, options={"num_predict": 12, "temperature": 0}
    )
    parts = list(
        daemon.client.chat(
            model=MODEL, messages=messages, stream=True, options={"num_predict": 12, "temperature": 0}
        )
    )
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count == 12 and whole.done_reason == "length"
    messages += [
        {"role": "assistant", "content": whole.message.content},
        {"role": "user", "content": "Fix it.\n"},
    ]
    body = {"model": MODEL, "messages": messages, "stream": False, "options": {"num_predict": 2}}
    second = httpx.post(f"{daemon.url}/api/chat", json=body, timeout=30).json()  # the client drops extensions
    extension = second["modeld"]
    assert extension["reuse"] == "warm" and extension["cached_tokens"] > 0
    # Ollama counts the whole prompt, cached tokens included: editors' context meters read it.
    assert second["prompt_eval_count"] == extension["prompt_tokens"]


def test_format_schema_and_tools(daemon: Daemon) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = daemon.client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Fine?"}],
        format=schema,
        options={"num_predict": 64},
    )
    assert isinstance(json.loads(answer.message.content or "")["ok"], bool)
    tool = {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    done = daemon.client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Read it."}],
        tools=[tool],
        options={"num_predict": 4},
    )
    assert done.done


def test_generate_raw_and_templated(daemon: Daemon) -> None:
    raw = daemon.client.generate(model=MODEL, prompt="def add(a, b):", raw=True, options={"num_predict": 5})
    assert raw.done and raw.eval_count == 5 and raw.prompt_eval_count is not None
    templated = daemon.client.generate(
        model=MODEL, prompt="hello", system="Be brief.", options={"num_predict": 3}
    )
    assert templated.done and templated.eval_count == 3
    preload = httpx.post(f"{daemon.url}/api/generate", json={"model": MODEL}, timeout=30).json()
    assert preload["done"] is True and preload["done_reason"] == "load"


def test_errors_are_ollama_shaped(daemon: Daemon) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        daemon.client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404 and "llama3" in missing.value.error
    with pytest.raises(ollama.ResponseError) as image:
        daemon.client.chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}])
    assert image.value.status_code == 400 and "images" in image.value.error


def test_think_reaches_the_template_as_enable_thinking_or_an_effort() -> None:
    """Ollama's ``think``: a boolean is the template's ``enable_thinking``, a level (gpt-oss)
    its ``reasoning_effort``; absent, the template's defaults (tests/models/test_families.py runs the
    rendering end to end)."""
    from modeld.server.http.ollama.request import parse_chat
    from modeld.settings import Limits

    def args(**extra: object) -> dict[str, object]:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        return dict(parse_chat(body, {}, Limits(), began=0.0).turn.template_args)

    assert args(think=False) == {"enable_thinking": False}
    assert args(think=True) == {"enable_thinking": True}
    assert args(think="high") == {"reasoning_effort": "high"}
    assert args() == {}
