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
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def long_prompt(api: str, lines: int = 160) -> str:
    """About 3000 tokens (two seconds of prefill here), different from the first byte for each
    API (no warm reuse); ``lines=640``: about 12k tokens, whose prefill reports its progress
    wherever the test runs (the engine reports a prefill's progress at its first step 0.5 s or
    more after it began: 3000 tokens of this 2-layer model can take less on a fast machine)."""
    return f"{api}: " + " ".join(
        f"line {i} of the {api} log says the build step {i * 7 % 13} passed." for i in range(lines)
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
        "messages": [{"role": "user", "content": long_prompt("chat", lines=640)}],
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


def test_modelds_headers_come_in_a_stream_that_began_before_its_turn(url: str) -> None:
    """Every stream here begins before its turn has started (a 20 ms interval), so its headers
    were sent before ``X-Modeld-Prefix`` (how the prompt's prefix was reused) and
    ``X-Modeld-Session`` were known: they come in the stream once known, before the answer, as
    SSE comments (read here through the SDKs' raw streams) and, in Ollama's NDJSON, an empty
    piece of the answer carrying ``modeld.headers``."""

    def noted(lines: list[str], first: str) -> dict[str, str]:
        notes = {
            k: v for k, _, v in (line[2:].partition(": ") for line in lines if line.startswith(": X-Modeld-"))
        }
        assert lines.index(f": X-Modeld-Prefix: {notes['X-Modeld-Prefix']}") < lines.index(first), lines[:8]
        return notes

    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": long_prompt("anthropic raw")}]
    with claude.messages.with_streaming_response.create(
        model=MODEL, max_tokens=64, stream=True, messages=messages
    ) as raw:
        assert "x-modeld-prefix" not in raw.headers
        notes = noted(list(raw.iter_lines()), "event: message_start")
    claude.close()
    # a new prompt: cold, or partial when the template's head is warm from an earlier test's
    assert re.fullmatch(r"reused=\d+; prefix=\d+; outcome=(cold|partial); .*", notes["X-Modeld-Prefix"])
    assert notes["X-Modeld-Session"]
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with chat.chat.completions.with_streaming_response.create(
        model=MODEL,
        max_tokens=64,
        stream=True,
        messages=[{"role": "user", "content": long_prompt("chat raw")}],
    ) as chat_raw:
        assert "x-modeld-prefix" not in chat_raw.headers
        lines = list(chat_raw.iter_lines())
    chat.close()
    assert noted(lines, next(line for line in lines if line.startswith("data: ")))[
        "X-Modeld-Prefix"
    ].startswith("reused=")
    body = {
        "model": MODEL,
        "stream": True,
        "think": False,
        "messages": [{"role": "user", "content": long_prompt("ollama raw")}],
        "options": {"num_predict": 64},
    }
    with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=300) as r:
        assert "x-modeld-prefix" not in r.headers
        parts = [json.loads(line) for line in r.iter_lines() if line]
    carrying = [i for i, p in enumerate(parts) if "headers" in p.get("modeld", {})]
    assert len(carrying) == 1 and not parts[carrying[0]]["done"], parts[:4]
    assert parts[carrying[0]]["modeld"]["headers"]["X-Modeld-Prefix"].startswith("reused=")
