"""Alive streams (issue 33): a stream that would stay silent (a long prefill, hidden thinking)
is kept alive in each API's own form, at ``--keepalive-interval``, and the answer the vendor's
SDK reads is the same as without them.

A real ``modeld serve --http`` on the llama backend with the generated THINK model (it thinks,
then answers "Understood."; a prompt of 3000 tokens takes about two seconds to prefill here) and a 20 ms interval, so every stream begins before its turn has started and carries
keep-alives during the prefill: Anthropic's ``ping`` events (before ``message_start`` too, which
the SDK skips), SSE comments with the prefill's progress (chat completions), repeated
``response.in_progress`` events (Responses, each with its sequence number), empty NDJSON lines
(Ollama, with ``done: false``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from daemon_proc import serve_http, stop

from modeld.testmodels import THINK, ensure_model
from modeld.testmodels._reply import REPLY_TEXT

pytestmark = [pytest.mark.wire, pytest.mark.llama, pytest.mark.slow]

MODEL = "modeld-think"


def long_prompt(api: str) -> str:
    """About 3000 tokens (two seconds of prefill here, so its progress is reported), different
    from the first byte for each API (no warm reuse)."""
    return f"{api}: " + " ".join(
        f"line {i} of the {api} log says the build step {i * 7 % 13} passed." for i in range(160)
    )


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    tmp = Path(tempfile.mkdtemp(prefix="mdst"))
    proc, record = serve_http(
        tmp,
        "--model",
        f"{MODEL}={ensure_model(THINK)}",
        "--keepalive-interval",
        "20ms",
        backend="llama",
        timeout=300,
    )
    try:
        yield record.http_endpoint
    finally:
        _, err = stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
        assert "Traceback" not in err, err[-3000:]


def test_anthropic_pings_while_the_prompt_is_prefilled(url: str) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": long_prompt("anthropic")}],
    }
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=300) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    start = names.index("message_start")
    assert start > 0 and set(names[:start]) == {"ping"}, names  # kept alive before the answer began
    assert names[-1] == "message_stop"
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    body["messages"] = [{"role": "user", "content": long_prompt("anthropic sdk")}]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=body["messages"]) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "text", None)) for b in final.content] == [("text", REPLY_TEXT)]
    client.close()


def test_chat_completions_carry_the_prefills_progress_in_comments(url: str) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": long_prompt("chat")}],
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        lines = [line for line in r.iter_lines() if line]
    comments = [line for line in lines if line.startswith(":")]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data > 0 and all(line.startswith(":") for line in lines[:first_data]), lines[:5]
    assert any("prefill" in c for c in comments), comments[:5]  # how far the prefill got
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    streamed = client.chat.completions.create(
        model=MODEL,
        max_tokens=64,
        stream=True,
        messages=[{"role": "user", "content": long_prompt("chat sdk")}],
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == REPLY_TEXT
    client.close()


def test_responses_repeat_in_progress_with_their_sequence_numbers(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with client.responses.create(
        model=MODEL, input=long_prompt("responses"), max_output_tokens=64, stream=True, store=False
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds.count("response.in_progress") > 1, kinds[:8]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output_text == REPLY_TEXT
    client.close()


def test_ollama_sends_empty_lines_while_the_prompt_is_prefilled(url: str) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "think": False,
        "messages": [{"role": "user", "content": long_prompt("ollama")}],
        "options": {"num_predict": 64},
    }
    with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=300) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    empty = [line for line in lines if not line["done"] and line["message"]["content"] == ""]
    assert len(empty) > 1 and lines[-1]["done"] is True
    client = ollama.Client(host=url, timeout=300)
    parts = list(
        client.chat(
            model=MODEL,
            messages=[{"role": "user", "content": long_prompt("ollama sdk")}],
            think=False,
            stream=True,
            options={"num_predict": 64},
        )
    )
    assert "".join(p.message.content or "" for p in parts) == REPLY_TEXT and parts[-1].done
    client.close()
