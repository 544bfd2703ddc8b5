"""OpenAI's Responses API, driven by the official ``openai`` SDK (``client.responses``) against a
real ``modeld serve --http`` (the memory backend: one token per byte, so counts are exact).

What Codex CLI does: ``input`` items with developer and user messages, flat function tools
beside a namespace and a hosted tool, ``store: false`` with ``prompt_cache_key``, streamed
answers; and what goes beyond the peers: ``previous_response_id`` continuing a stored
conversation warm while sending only the new input.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from daemon_proc import serve_http, stop

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string", "minLength": 1, "maxLength": 16}},
        "required": ["command"],
        "additionalProperties": False,
    },
}
NAMESPACE = {
    "type": "namespace",
    "name": "mcp",
    "description": "tools of a server",
    "tools": [
        {"type": "function", "name": "mcp__lookup", "parameters": {"type": "object", "properties": {}}}
    ],
}


def tokens(text: str) -> int:
    return len(text.encode()) + 1


class Daemon:
    def __init__(self, tmp: Path) -> None:
        # Without the prefill ahead (the default; tests/http/test_prefill_ahead.py): these tests read each
        # turn's own reuse and the session's state right after its answer, which a prefill ahead changes.
        self.proc, record = serve_http(tmp, "--no-prefill-ahead")
        self.url = record.http_endpoint
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def close(self) -> None:
        self.client.close()
        stop(self.proc)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdr"))
    d = Daemon(tmp)
    try:
        yield d
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def total(usage: Any) -> int:
    return int(usage.input_tokens)


def test_a_response_and_its_stream_say_the_same(daemon: Daemon) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a prime."}]},
        ],
        "store": False,
        "prompt_cache_key": "same",
    }
    whole = daemon.client.responses.create(**request)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    with daemon.client.responses.stream(**request) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kind in kinds, kind
    assert streamed.output_text == whole.output_text
    assert streamed.usage is not None and whole.usage is not None
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    # The second identical request is warm: everything before the new user turn was reused.
    assert streamed.usage.input_tokens_details.cached_tokens > 0
    with httpx.stream(
        "POST", f"{daemon.url}/v1/responses", json={**request, "stream": True}, timeout=30
    ) as raw:
        datas = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert datas[-1]["type"] == "response.completed"
    cut = {**request, "stream": True, "max_output_tokens": 2}
    with httpx.stream("POST", f"{daemon.url}/v1/responses", json=cut, timeout=30) as raw:
        last = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")][-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_previous_response_id_continues_warm_with_only_the_new_input(daemon: Daemon) -> None:
    first = daemon.client.responses.create(
        model=MODEL, instructions="You are terse.", input="Why does test_lease fail?", max_output_tokens=10
    )
    assert first.usage is not None
    assert daemon.client.responses.retrieve(first.id).output_text == first.output_text
    second = daemon.client.responses.create(
        model=MODEL,
        instructions="You are terse.",
        previous_response_id=first.id,
        input="Fix it.",
        max_output_tokens=4,
    )
    assert second.usage is not None
    unevaluated = (
        1 if first.status == "incomplete" else 0
    )  # a reply cut off: its last token was never evaluated
    assert (
        second.usage.input_tokens_details.cached_tokens
        == first.usage.input_tokens + first.usage.output_tokens - unevaluated
    )
    assert second.model_extra is not None and second.model_extra["modeld"]["reuse"] == "warm"
    assert second.previous_response_id == first.id
    deleted = httpx.delete(f"{daemon.url}/v1/responses/{first.id}", timeout=10)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        daemon.client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as refused:  # OpenAI's 400 for an unknown previous response
        daemon.client.responses.create(model=MODEL, previous_response_id=first.id, input="again")
    assert refused.value.code == "previous_response_not_found"
    assert refused.value.param == "previous_response_id"


def test_store_false_keeps_nothing(daemon: Daemon) -> None:
    done = daemon.client.responses.create(model=MODEL, input="hello", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        daemon.client.responses.retrieve(done.id)


def test_tools_flat_namespaced_and_hosted(daemon: Daemon) -> None:
    """Function tools are flat, a namespace is flattened, a hosted tool is left out and named;
    a forced call comes back as a function_call item and its output continues warm."""
    tools: list[Any] = [SHELL, NAMESPACE, {"type": "web_search", "external_web_access": False}]
    first = daemon.client.responses.create(
        model=MODEL,
        input="List the files.",
        tools=tools,
        tool_choice={"type": "function", "name": "shell"},
        parallel_tool_calls=True,
        store=False,
        prompt_cache_key="tools-conv",
        max_output_tokens=200,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "shell"
    assert isinstance(json.loads(calls[0].arguments), dict)
    assert first.model_extra is not None and first.model_extra["modeld"]["omitted_tools"] == ["web_search"]
    second = daemon.client.responses.create(
        model=MODEL,
        input=[
            {"type": "message", "role": "user", "content": "List the files."},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "shell",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "setup.py"},
        ],
        tools=tools,
        store=False,
        prompt_cache_key="tools-conv",
        max_output_tokens=4,
    )
    assert first.usage is not None and second.usage is not None
    assert (
        second.usage.input_tokens_details.cached_tokens
        == first.usage.input_tokens + first.usage.output_tokens
    )


def test_text_format_json_schema_is_enforced(daemon: Daemon) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    done = daemon.client.responses.create(
        model=MODEL,
        input="Is it fine?",
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
        max_output_tokens=64,
    )
    assert isinstance(json.loads(done.output_text)["ok"], bool)


def test_refused_and_unknown_fields_name_themselves(daemon: Daemon) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        daemon.client.responses.create(model=MODEL, input="x", extra_body={"prompt": {"id": "p"}})
    assert err.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        daemon.client.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "x"}])  # type: ignore[list-item]
    assert "input[0]" in err.value.body["param"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        daemon.client.responses.create(model="gpt-5", input="x")


def test_a_stored_conversation_keeps_every_field_its_template_reads(tmp_path: Path) -> None:
    """A response continued by ``previous_response_id`` renders its history from the store: the
    store keeps what the template is given (a result's call id and name, content parts), so the
    history renders as it rendered when it was new."""
    from modeld.contract import ToolCall
    from modeld.server.http.responses.store import ResponseStore, Stored
    from modeld.server.http.turn import Message

    history = (
        Message("user", "ab", parts=("a", "b")),
        Message("assistant", "", (ToolCall("call00001", "read_file", '{"path": "x"}'),), "why"),
        Message("tool", "x = 1", tool_call_id="call00001", name="read_file"),
    )
    store = ResponseStore(tmp_path)
    assert store.put(Stored("resp_" + "0" * 24, {"id": "r"}, history, "conv", time.time()))
    got = store.get("resp_" + "0" * 24)
    assert got is not None and got.history == history
