"""Cache diagnosis on the wire (issue 33, item 9), with the official SDKs against a real
``modeld serve --http`` (the memory backend: one token per byte, so every count is exact).

Anthropic's ``diagnostics.previous_message_id`` (beta ``cache-diagnosis-2026-04-07``) and the
Responses API's ``prompt_cache_options.comparison_response_id`` name an earlier response; the
answer says where this request's prompt parted from that one's, and how many of its tokens that
costs. Every answer here is checked against explain-context (the engine's own reuse decision for
the turn, over gRPC) and against the ``X-Modeld-Prefix`` header every API now sends.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from daemon_proc import serve_http, stop

import runtime_client as rc

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"
BETA = "cache-diagnosis-2026-04-07"
SYSTEM = "You are a careful engineer. The repository is small and its tests are fast.\n"
TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}


class Daemon:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc, record = serve_http(tmp, "--model", f"{MODEL}={MODEL}", "--model", "other=other")
        self.url = record.http_endpoint
        self.anthropic = anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=60)
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def explain(self, session_id: str) -> Any:
        with rc.connect(data_dir=self.tmp) as client:
            return client.explain_context(session_id)

    def reports(self) -> float:
        """``modeld_context_reports_total``, summed over the models: explain-context reports built."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("modeld_context_reports_total")
        )

    def close(self) -> None:
        self.anthropic.close()
        self.openai.close()
        _, err = stop(self.proc)
        assert "Traceback" not in err, err[-3000:]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdcd"))
    d = Daemon(tmp)
    try:
        yield d
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def header(raw: Any) -> dict[str, str]:
    """``X-Modeld-Prefix`` as a dict."""
    text = raw.headers["x-modeld-prefix"]
    return dict(part.split("=", 1) for part in text.split("; "))


def prompt_tokens(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens)


class Claude:
    """One Anthropic conversation that asks for cache diagnosis every turn, as Claude Code does."""

    def __init__(self, daemon: Daemon, key: str) -> None:
        self.daemon = daemon
        self.key = key

    def ask(self, system: str, messages: list[dict[str, Any]], previous: str | None, **more: Any) -> Any:
        raw = self.daemon.anthropic.beta.messages.with_raw_response.create(
            model=more.pop("model", MODEL),
            max_tokens=4,
            system=system,
            messages=messages,  # type: ignore[arg-type]
            betas=[BETA],
            diagnostics={"previous_message_id": previous},
            extra_headers={"X-Modeld-Conversation": self.key},
            **more,
        )
        return raw, raw.parse()


def reply(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_anthropic_diagnostics_name_the_part_that_changed_exact_to_the_token(daemon: Daemon) -> None:
    claude = Claude(daemon, "diag-anthropic")
    first_messages = [{"role": "user", "content": "Why does test_lease fail?\n"}]
    raw, first = claude.ask(SYSTEM, first_messages, None, tools=[TOOL])
    assert first.diagnostics is None  # opted in, nothing to compare yet
    assert header(raw)["outcome"] in ("cold", "warm")

    # An appended turn: nothing changed inside the first request's prompt.
    grown = [
        *first_messages,
        {"role": "assistant", "content": reply(first)},
        {"role": "user", "content": "Fix it.\n"},
    ]
    raw, second = claude.ask(SYSTEM, grown, first.id, tools=[TOOL])
    assert second.diagnostics is None
    assert "diverged-token" not in header(raw)

    # The system prompt gains a timestamp in its middle: system_changed, exact to the token.
    stamped = SYSTEM.replace("The repository", "Now: 10:00:05. The repository")
    raw, third = claude.ask(stamped, grown, second.id, tools=[TOOL])
    reason = third.diagnostics.cache_miss_reason
    report = daemon.explain(raw.headers["x-modeld-session"])
    diverged = report.last_reuse.diverged_at_token
    assert diverged == int(header(raw)["diverged-token"]) and header(raw)["diverged-part"] == "system"
    assert diverged == 1 + len("<|im_start|>system\nYou are a careful engineer. ")  # BOS, then the bytes
    assert (reason.type, reason.cache_missed_input_tokens) == (
        "system_changed",
        prompt_tokens(second.usage) - diverged,
    )
    assert third.usage.cache_read_input_tokens == diverged

    # The tools change (a description edited): tools_changed, where the template put them.
    edited = {**TOOL, "description": "Read one file"}
    raw, fourth = claude.ask(stamped, grown, third.id, tools=[edited])
    reason = fourth.diagnostics.cache_miss_reason
    report = daemon.explain(raw.headers["x-modeld-session"])
    diverged = report.last_reuse.diverged_at_token
    assert (
        report.tools_token_start is not None and report.tools_token_start <= diverged < report.tools_token_end
    )
    assert (reason.type, reason.cache_missed_input_tokens) == (
        "tools_changed",
        prompt_tokens(third.usage) - diverged,
    )
    assert header(raw)["diverged-part"] == "tools"

    # An earlier message is edited: messages_changed, and the message is named in the header.
    edited_messages = [{"role": "user", "content": "Why does test_lock fail?\n"}, *grown[1:]]
    raw, fifth = claude.ask(stamped, edited_messages, fourth.id, tools=[edited])
    reason = fifth.diagnostics.cache_miss_reason
    report = daemon.explain(raw.headers["x-modeld-session"])
    diverged = report.last_reuse.diverged_at_token
    assert (reason.type, reason.cache_missed_input_tokens) == (
        "messages_changed",
        prompt_tokens(fourth.usage) - diverged,
    )
    assert header(raw)["diverged-part"] == "messages" and header(raw)["diverged-message"] == "1"


def test_anthropic_diagnostics_for_another_model_an_unknown_id_and_another_conversation(
    daemon: Daemon,
) -> None:
    claude = Claude(daemon, "diag-other")
    messages = [{"role": "user", "content": "Summarise the README.\n"}]
    _, first = claude.ask(SYSTEM, messages, None)
    _, moved = claude.ask(SYSTEM, messages, first.id, model="other")
    reason = moved.diagnostics.cache_miss_reason
    assert (reason.type, reason.cache_missed_input_tokens) == ("model_changed", prompt_tokens(first.usage))
    _, unknown = claude.ask(SYSTEM, messages, "msg_0123456789abcdef01234567")
    assert unknown.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    # Another conversation's message: the engine compared this prompt with this conversation's
    # own warm context, not with that message's request.
    _, elsewhere = Claude(daemon, "diag-elsewhere").ask(SYSTEM, messages, first.id)
    assert elsewhere.diagnostics.cache_miss_reason.type == "unavailable"


def test_anthropic_diagnostics_arrive_in_message_start_when_streaming(daemon: Daemon) -> None:
    claude = Claude(daemon, "diag-stream")
    messages = [{"role": "user", "content": "List the tests.\n"}]
    # A system prompt no other test's conversation shares beyond the template's head: the turn
    # then reuses this conversation's own state (wherever the pool moved it), never another
    # context sharing a longer start, which the diagnosis would rightly call unavailable.
    system = "Streaming. " + SYSTEM
    _, first = claude.ask(system, messages, None)
    with daemon.anthropic.beta.messages.stream(
        model=MODEL,
        max_tokens=4,
        system=system.replace("careful", "patient"),
        messages=messages,  # type: ignore[arg-type]
        betas=[BETA],
        diagnostics={"previous_message_id": first.id},
        extra_headers={"X-Modeld-Conversation": "diag-stream"},
    ) as stream:
        start = next(event for event in stream if event.type == "message_start")
        final = stream.get_final_message()
    reason = start.message.diagnostics.cache_miss_reason
    diverged = 1 + len("<|im_start|>system\nStreaming. You are a ")
    assert (reason.type, reason.cache_missed_input_tokens) == (
        "system_changed",
        prompt_tokens(first.usage) - diverged,
    )
    assert final.usage.cache_read_input_tokens == diverged


def test_responses_prompt_cache_diagnostics(daemon: Daemon) -> None:
    client = daemon.openai
    key = "diag-responses"
    tools = [{"type": "function", "name": "read_file", "parameters": TOOL["input_schema"]}]
    base: dict[str, Any] = {"model": MODEL, "max_output_tokens": 4, "prompt_cache_key": key, "store": False}
    items: list[Any] = [{"role": "user", "content": "Why does test_lease fail?\n"}]
    first = client.responses.create(instructions=SYSTEM, input=items, tools=tools, **base)  # type: ignore[arg-type]
    assert first.prompt_cache_diagnostics is None  # not asked

    items += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Fix it.\n"}]
    options = {"comparison_response_id": first.id}
    second = client.responses.create(
        instructions=SYSTEM,
        input=items,
        tools=tools,
        prompt_cache_options=options,
        **base,  # type: ignore[arg-type]
    )
    assert second.prompt_cache_diagnostics is not None and second.prompt_cache_diagnostics.type == "cache_hit"

    raw = client.responses.with_raw_response.create(
        instructions=SYSTEM.replace("small", "large"),
        input=items,
        tools=tools,
        prompt_cache_options={"comparison_response_id": second.id},
        **base,
    )
    third = raw.parse()
    report = daemon.explain(raw.headers["x-modeld-session"])
    diverged = report.last_reuse.diverged_at_token
    got = third.prompt_cache_diagnostics
    assert got is not None and got.type == "cache_miss"
    assert second.usage is not None and third.usage is not None
    assert (got.reason, got.cache_missed_tokens, got.comparison_reusable_tokens) == (
        "input_changed",
        second.usage.input_tokens - diverged,
        diverged,
    )
    assert third.usage.input_tokens_details.cached_tokens == diverged == int(header(raw)["diverged-token"])

    renamed = [{**tools[0], "description": "Read one file"}]
    fourth = client.responses.create(
        instructions=SYSTEM.replace("small", "large"),
        input=items,
        tools=renamed,  # type: ignore[arg-type]
        prompt_cache_options={"comparison_response_id": third.id},
        **base,
    )
    assert fourth.prompt_cache_diagnostics is not None
    assert (fourth.prompt_cache_diagnostics.type, fourth.prompt_cache_diagnostics.reason) == (
        "cache_miss",
        "tools_changed",
    )

    moved = client.responses.create(
        **{**base, "prompt_cache_key": "diag-responses-2"},
        instructions=SYSTEM,
        input=items,
        prompt_cache_options={"comparison_response_id": fourth.id},
    )
    assert moved.prompt_cache_diagnostics is not None
    assert (moved.prompt_cache_diagnostics.type, moved.prompt_cache_diagnostics.reason) == (
        "cache_miss",
        "prompt_cache_key_changed",
    )
    missing = client.responses.create(
        **base, input="hi\n", prompt_cache_options={"comparison_response_id": "resp_nothing"}
    )
    assert missing.prompt_cache_diagnostics is not None
    assert missing.prompt_cache_diagnostics.type == "comparison_response_not_found"


def test_responses_prewarm_computes_the_prompt_and_generates_nothing(daemon: Daemon) -> None:
    base: dict[str, Any] = {"model": MODEL, "prompt_cache_key": "diag-prewarm", "store": False}
    items = [{"role": "user", "content": "Read the plan.\n"}]
    warmed = daemon.openai.responses.create(
        instructions=SYSTEM,
        input=items,
        prompt_cache_options={"prewarm": True},
        **base,  # type: ignore[arg-type]
    )
    assert warmed.output == [] and warmed.usage is not None and warmed.usage.output_tokens == 0
    served = daemon.openai.responses.create(
        instructions=SYSTEM,
        input=items,
        max_output_tokens=4,
        prompt_cache_options={"comparison_response_id": warmed.id},
        **base,  # type: ignore[arg-type]
    )
    assert (
        served.usage is not None
        and served.usage.input_tokens_details.cached_tokens == warmed.usage.input_tokens
    )
    assert served.prompt_cache_diagnostics is not None and served.prompt_cache_diagnostics.type == "cache_hit"


def test_every_api_says_where_the_prefix_diverged_in_a_header(daemon: Daemon) -> None:
    """``X-Modeld-Prefix`` on chat completions, Ollama and the others: the engine's first
    differing token, its part and message, equal to explain-context's."""
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2}),
        ("/api/chat", {"model": MODEL, "stream": False, "options": {"num_predict": 2}}),
    ):
        headers = {"X-Modeld-Conversation": f"header{path}"}
        own = SYSTEM + f"Served at {path}.\n"  # a prompt no other conversation left warm
        for system in (own, own.replace("fast", "slow")):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi\n"}]
            answer = httpx.post(
                f"{daemon.url}{path}", json={**body, "messages": messages}, headers=headers, timeout=60
            )
            assert answer.status_code == 200, answer.text
        report = daemon.explain(answer.headers["x-modeld-session"])
        got = header(answer)
        assert int(got["diverged-token"]) == report.last_reuse.diverged_at_token
        assert (got["diverged-part"], got["diverged-segment"], got["diverged-message"]) == (
            "system",
            "system",
            "0",
        )
        assert (got["outcome"], got["reason"], got["reused"]) == (
            "partial",
            "diverged",
            got["diverged-token"],
        )


def test_a_diverged_turn_is_diagnosed_without_asking_the_session_for_its_context(daemon: Daemon) -> None:
    """The engine's prefix status places the divergence (part, message, warm context): the
    turns below, diverged and compared, build no explain-context report (the daemon's own
    counter, which a client's explain-context moves)."""
    claude = Claude(daemon, "diag-no-explain")
    messages = [{"role": "user", "content": "Where is the lease written?\n"}]
    before = daemon.reports()
    _, first = claude.ask(SYSTEM, messages, None, tools=[TOOL])
    raw, second = claude.ask(SYSTEM.replace("small", "large"), messages, first.id, tools=[TOOL])
    edited = {**TOOL, "description": "Read one file"}
    raw_tools, third = claude.ask(SYSTEM.replace("small", "large"), messages, second.id, tools=[edited])
    httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM}, *messages],
        },
        headers={"X-Modeld-Conversation": "diag-no-explain-chat"},
        timeout=60,
    ).raise_for_status()
    assert daemon.reports() == before
    assert second.diagnostics.cache_miss_reason.type == "system_changed"
    assert third.diagnostics.cache_miss_reason.type == "tools_changed"
    assert header(raw)["diverged-part"] == "system" and header(raw_tools)["diverged-part"] == "tools"
    report = daemon.explain(raw_tools.headers["x-modeld-session"])
    assert daemon.reports() == before + 1  # the counter moves when someone does ask
    assert int(header(raw_tools)["diverged-token"]) == report.last_reuse.diverged_at_token
    assert report.last_prefix is not None and report.last_prefix.context_id == report.context_id
    assert report.last_prefix.diverged_part == "tools"
