"""The OpenAI-compatible endpoint, driven by the official ``openai`` SDK against a real
``modeld serve --http`` process (the memory backend: one token per byte, so every count is
exact; one test runs the generated tiny llama model).

The scenarios are what coding tools do: list models, chat streamed and not, resend the whole
conversation next turn and read ``usage.prompt_tokens_details.cached_tokens``, pass tools, use
``/v1/completions`` for autocomplete, break their own prefix with a timestamp, go away in the
middle of a stream, and get OpenAI-shaped errors for what modeld cannot do.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from daemon_proc import MODELD, modeld, serve_http, stop
from prometheus_client.parser import text_string_to_metric_families

import runtime_client as rc
from modeld.lease import read_lease
from modeld.testmodels import TINY, ensure_model

pytestmark = pytest.mark.wire

SYSTEM = "You are a careful engineer. Answer briefly.\n"
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


def chatml(messages: list[dict[str, str]], tools: list[Any] | None = None, generation: bool = True) -> str:
    """The memory model's template (ChatML, tools in the system turn), written out as an oracle."""
    out = ""
    if tools:
        out += "<|im_start|>system\n"
        if messages[0]["role"] == "system":
            out += messages[0]["content"] + "\n"
        out += "# Tools\n" + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools) + "<|im_end|>\n"
    for i, m in enumerate(messages):
        if tools and i == 0 and m["role"] == "system":
            continue
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + ("<|im_start|>assistant\n" if generation else "")


def tokens(text: str) -> int:
    """Memory backend: one token per byte, plus BOS."""
    return len(text.encode()) + 1


class Daemon:
    def __init__(self, tmp: Path, *extra: str, backend: str = "memory", http: str = "127.0.0.1:0") -> None:
        self.tmp = tmp
        self.proc, record = serve_http(tmp, *extra, backend=backend, http=http)
        self.url = record.http_endpoint
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def grpc(self) -> rc.Client:
        return rc.connect(data_dir=self.tmp)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def close(self) -> str:
        self.client.close()
        _, err = stop(self.proc)
        return err


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdo"))
    # Without the prefill ahead (the default; tests/http/test_prefill_ahead.py): these tests read each
    # turn's own reuse and the session's state right after its answer, which a prefill ahead changes.
    d = Daemon(tmp, "--no-prefill-ahead")
    try:
        yield d
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def conversation(tag: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Why does {tag} fail?\n"}]


def test_models_list_names_the_generated_default_model(daemon: Daemon) -> None:
    models = daemon.client.models.list()
    assert [m.id for m in models] == ["modeld-tiny"]
    assert models.data[0].owned_by == "modeld"
    assert daemon.client.models.retrieve("modeld-tiny").id == "modeld-tiny"
    with pytest.raises(openai.NotFoundError) as err:
        daemon.client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_second_turn_reports_the_reused_prefix_as_cached_tokens(daemon: Daemon) -> None:
    """A tool resends its whole conversation; the second turn pays only for what changed, and
    cached_tokens equals what the engine reused (explain-context says the same)."""
    messages = conversation("test_lease")
    first = daemon.client.chat.completions.create(
        model="modeld-tiny", messages=messages, temperature=0, extra_headers={"X-Modeld-Conversation": "t1"}
    )
    reply = first.choices[0].message.content
    assert reply and first.choices[0].finish_reason == "stop"
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens == tokens(chatml(messages))
    assert first.usage.completion_tokens == len(reply.encode())
    assert first.usage.prompt_tokens_details.cached_tokens == first.model_extra["modeld"]["reused_tokens"]  # type: ignore[index]

    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Fix it.\n"}]
    second = daemon.client.chat.completions.create(
        model="modeld-tiny", messages=messages, temperature=0, extra_headers={"X-Modeld-Conversation": "t1"}
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # Resident after turn 1: BOS, the rendered first turn, the reply's tokens (EOS is not kept).
    reused = tokens(chatml(messages[:2])) + len(reply.encode())
    assert second.usage.prompt_tokens == tokens(chatml(messages))
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    assert second.model_extra is not None
    extension = second.model_extra["modeld"]
    assert extension["session_id"] == first.model_extra["modeld"]["session_id"]  # type: ignore[index]
    assert (extension["reuse"], extension["reused_tokens"]) == ("warm", reused)
    with daemon.grpc() as client:
        report = client.explain_context(extension["session_id"])
    assert report.last_prefix is not None and report.last_prefix.reused_tokens == reused
    assert report.model_name == "modeld-tiny"
    assert [(s.role, s.stable) for s in report.manifest.segments] == [  # type: ignore[union-attr]
        ("system", True),
        ("user", True),
        ("assistant", True),
        ("user", False),
    ]


def test_streamed_chat_equals_the_non_streamed_answer_and_ends_with_usage(daemon: Daemon) -> None:
    messages = conversation("test_stream")
    whole = daemon.client.chat.completions.create(model="modeld-tiny", messages=messages, temperature=0)
    stream = daemon.client.chat.completions.create(
        model="modeld-tiny",
        messages=messages,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == tokens(chatml(messages))
    assert usage.completion_tokens == len(text.encode())
    # The same request sent again reuses it all (ensure_prefix leaves the suffix the last turn
    # computed in place).
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens


def test_tools_are_rendered_by_the_models_template(daemon: Daemon) -> None:
    messages = conversation("test_tools")
    plain = daemon.client.chat.completions.create(model="modeld-tiny", messages=messages, max_tokens=1)
    with_tools = daemon.client.chat.completions.create(
        model="modeld-tiny", messages=messages, tools=[TOOL], tool_choice="auto", max_tokens=1
    )
    assert plain.usage is not None and with_tools.usage is not None
    assert with_tools.usage.prompt_tokens == tokens(chatml(messages, [TOOL]))
    assert with_tools.usage.prompt_tokens - plain.usage.prompt_tokens == len(
        ("\n# Tools\n" + json.dumps(TOOL) + "\n").encode()
    )
    # tool_choice none keeps the tools in the prompt (the warm prefix: every token reused) and
    # only forbids calls.
    kept = daemon.client.chat.completions.create(
        model="modeld-tiny", messages=messages, tools=[TOOL], tool_choice="none", max_tokens=1
    )
    assert kept.usage is not None and kept.usage.prompt_tokens == with_tools.usage.prompt_tokens
    assert kept.usage.prompt_tokens_details is not None
    assert kept.usage.prompt_tokens_details.cached_tokens == kept.usage.prompt_tokens
    assert not kept.choices[0].message.tool_calls


def test_completions_endpoint_serves_autocomplete_and_reuses_its_prompt(daemon: Daemon) -> None:
    prompt = "<PRE> def area(r):\n    return <SUF>\n<MID>"
    first = daemon.client.completions.create(model="modeld-tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert first.object == "text_completion"
    assert first.usage is not None and first.usage.prompt_tokens == tokens(prompt)
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    longer = prompt.replace("return ", "return 3.14 * ")
    stream = daemon.client.completions.create(
        model="modeld-tiny", prompt=longer, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == tokens(prompt[: prompt.index("return ") + 7])


def test_a_timestamp_in_the_system_prompt_is_named_as_the_miss(daemon: Daemon) -> None:
    """The prefix breaker users hit: the response and explain-context name the message (and the
    segment) where the prefix diverged."""
    headers = {"X-Modeld-Conversation": "clock"}
    turn = [{"role": "system", "content": "Now: 10:00:00\n" + SYSTEM}, {"role": "user", "content": "hi\n"}]
    daemon.client.chat.completions.create(
        model="modeld-tiny", messages=turn, max_tokens=2, extra_headers=headers
    )
    later = [{"role": "system", "content": "Now: 10:00:05\n" + SYSTEM}, {"role": "user", "content": "hi\n"}]
    second = daemon.client.chat.completions.create(
        model="modeld-tiny", messages=later, max_tokens=2, extra_headers=headers
    )
    extension = second.model_extra["modeld"]  # type: ignore[index]
    assert (extension["reuse"], extension["reason"]) == ("partial", "diverged")
    diverged = len(b"<|im_start|>system\nNow: 10:00:0") + 1  # after BOS and the shared bytes
    assert extension["diverged_at_token"] == diverged
    assert extension["diverged_at_message"] == 0
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == diverged
    listing = modeld("explain-context", extension["session_id"], data_dir=daemon.tmp)
    assert listing.returncode == 0, listing.stderr
    assert "PARTIAL (diverged)" in listing.stdout
    assert f"diverged at token {diverged}" in listing.stdout and "in segment 'system'" in listing.stdout


def test_a_conversation_keeps_its_session_and_others_get_their_own(daemon: Daemon) -> None:
    def session_of(key: str, user: str) -> str:
        done = daemon.client.chat.completions.create(
            model="modeld-tiny",
            messages=[{"role": "user", "content": user}],
            max_tokens=1,
            extra_headers={"X-Modeld-Conversation": key},
        )
        return str(done.model_extra["modeld"]["session_id"])  # type: ignore[index]

    a1, b1, a2 = session_of("a", "one\n"), session_of("b", "two\n"), session_of("a", "three\n")
    assert a1 == a2 != b1
    with daemon.grpc() as client:
        listed = {s.session_id: s for s in client.list_sessions()}
    assert a1 in listed and b1 in listed and listed[a1].attached


def test_a_turn_sent_while_the_engine_finishes_the_one_before_waits_for_its_conversations_session(
    daemon: Daemon,
) -> None:
    """An agent sends its next turn the moment the last one is over for it; the engine may still
    be finishing that one (here: a client that went away mid-decode, and the memory backend's
    one-second token step). The next turn waits for the conversation's session, not a session of
    its own that closes after it (the conversation then went on from the turn before)."""
    headers = {"X-Modeld-Conversation": "finishing"}
    messages = conversation("finishing")
    with httpx.stream(
        "POST",
        f"{daemon.url}/v1/chat/completions",
        json={
            "model": "modeld-tiny",
            "messages": messages,
            "max_tokens": 8,
            "delay_ms": 1000,
            "stream": True,
        },
        headers=headers,
        timeout=60,
    ) as slow:
        session = slow.headers["X-Modeld-Session"]
        next(line for line in slow.iter_lines() if line.startswith("data: "))  # decoding
    time.sleep(0.2)  # the daemon has seen the client go; the engine sleeps through its token step
    done = daemon.client.chat.completions.create(
        model="modeld-tiny",
        messages=[*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "and?\n"}],
        max_tokens=1,
        extra_headers=headers,
    )
    assert done.model_extra["modeld"]["session_id"] == session  # type: ignore[index]


def test_n_choices_are_decoded_from_the_same_prompt_and_reproducible_by_seed(daemon: Daemon) -> None:
    messages = conversation("choices")

    def ask(n: int, seed: int) -> Any:
        return daemon.client.chat.completions.create(
            model="modeld-tiny", messages=messages, n=n, seed=seed, temperature=1.0, max_tokens=48
        )

    three = ask(3, 5)
    assert [c.index for c in three.choices] == [0, 1, 2]
    note = {"n": 3, "decoded": "one by one", "why": "this backend decodes one choice at a time"}
    assert three.model_extra["timings"]["choices"] == note  # type: ignore[index]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) > 1  # each choice draws its own tokens
    assert texts == [c.message.content for c in ask(3, 5).choices]  # a seed makes them reproducible
    assert ask(1, 5).choices[0].message.content == texts[0]  # choice i is the request with seed + i
    assert ask(1, 6).choices[0].message.content == texts[1]
    usage = three.usage
    assert usage is not None and usage.prompt_tokens == tokens(chatml(messages))
    assert usage.completion_tokens == sum(len((t or "").encode()) for t in texts)


def test_openai_shaped_errors_name_the_field(daemon: Daemon) -> None:
    messages = conversation("errors")
    cases: list[tuple[dict[str, Any], type[openai.APIStatusError], str | None, str]] = [
        ({"model": "gpt-4o"}, openai.NotFoundError, "model", "model_not_found"),
        ({"n": 9}, openai.BadRequestError, "max_choices", "limit_exceeded"),
        ({"n": 2, "stream": True}, openai.BadRequestError, "n", "unsupported_parameter"),
        ({"max_tokens": -1}, openai.BadRequestError, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": 0}, openai.BadRequestError, "max_completion_tokens", "invalid_value"),
        ({"response_format": {"type": "xml"}}, openai.BadRequestError, "response_format", "invalid_value"),
        ({"tool_choice": "required"}, openai.BadRequestError, "tool_choice", "invalid_value"),
        ({"presence_penalty": 3}, openai.BadRequestError, "presence_penalty", "invalid_value"),
        ({"logit_bias": {"a": 1}}, openai.BadRequestError, "logit_bias", "invalid_value"),
        ({"extra_body": {"mirostat": 2}}, openai.BadRequestError, "extra.mirostat", "unsupported_parameter"),
        ({"extra_body": {"grammar": {"x": 1}}}, openai.BadRequestError, "grammar", "unsupported_parameter"),
        ({"temperature": 5}, openai.BadRequestError, "temperature", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            openai.BadRequestError,
            "messages[0].content[0].type",
            "unsupported_parameter",
        ),
    ]
    for fields, error, param, code in cases:
        request = {"model": "modeld-tiny", "messages": messages, **fields}
        with pytest.raises(error) as err:
            daemon.client.chat.completions.create(**request)
        body = err.value.body
        assert isinstance(body, dict), fields
        assert (body["param"], body["code"], body["type"]) == (param, code, "invalid_request_error"), fields
        assert body["message"], fields
    too_long = [{"role": "user", "content": "x" * 33000}]  # the memory model's window is 32768
    with pytest.raises(openai.BadRequestError) as err:
        daemon.client.chat.completions.create(model="modeld-tiny", messages=too_long)
    assert err.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    json_type = {"Content-Type": "application/json"}
    raw = httpx.post(f"{daemon.url}/v1/chat/completions", content=b"{not json", headers=json_type, timeout=10)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{daemon.url}/v1/nothing", timeout=10).json()["error"]["code"] == "not_found"


def test_extension_fields_reach_the_backend(daemon: Daemon) -> None:
    """An unknown scalar field goes to DecodeConfig.extra, where the backend accepts or refuses
    it by name: the memory backend knows delay_ms (and checks its value), not mirostat."""
    messages = conversation("extension")
    done = daemon.client.chat.completions.create(
        model="modeld-tiny", messages=messages, max_tokens=4, extra_body={"delay_ms": 1}
    )
    assert done.usage is not None and done.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as err:
        daemon.client.chat.completions.create(
            model="modeld-tiny", messages=messages, max_tokens=4, extra_body={"delay_ms": "soon"}
        )
    assert err.value.body["param"] == "extra.delay_ms"  # type: ignore[index]
    sampled = [
        daemon.client.chat.completions.create(
            model="modeld-tiny",
            messages=messages,
            max_tokens=12,
            temperature=0.9,
            seed=7,
            extra_body={"top_k": 5, "min_p": 0.01, "repeat_penalty": 1.1},
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # the samplers were applied with the seed: reproducible


def test_metrics_count_turns_and_parse_with_prometheus_client(daemon: Daemon) -> None:
    def value(metrics: dict[Any, float], name: str, **labels: str) -> float:
        return metrics.get((name, tuple(sorted({"model": "modeld-tiny", **labels}.items()))), 0.0)

    before = daemon.metrics()
    messages = conversation("metrics")
    done = daemon.client.chat.completions.create(model="modeld-tiny", messages=messages, max_tokens=3)
    after = daemon.metrics()
    # The prefix: the system turn as the template renders it once a user turn follows, through
    # that turn's header (blueprint 0010).
    prefix = tokens(chatml(messages[:1], generation=False) + "<|im_start|>user\n")
    extension = done.model_extra["modeld"]  # type: ignore[index]
    assert done.usage is not None
    assert (
        value(after, "modeld_prefix_cache_queries_total") - value(before, "modeld_prefix_cache_queries_total")
        == prefix
    )
    assert (
        value(after, "modeld_prefix_cache_hits_total", source="kv")
        - value(before, "modeld_prefix_cache_hits_total", source="kv")
        == extension["reused_tokens"]
    )
    assert (
        value(after, "modeld_generation_tokens_total") - value(before, "modeld_generation_tokens_total") == 3
    )
    assert value(after, "modeld_prompt_tokens_total") - value(before, "modeld_prompt_tokens_total") == (
        done.usage.prompt_tokens
    )
    assert (
        value(after, "modeld_requests_total", finish_reason="length")
        - value(before, "modeld_requests_total", finish_reason="length")
        == 1
    )
    assert (
        value(after, "modeld_time_to_first_token_seconds_count")
        - value(before, "modeld_time_to_first_token_seconds_count")
        == 1
    )
    assert after[("modeld_sessions_open", ())] >= 1
    assert after[("modeld_worker_restarts_total", ())] == 0  # not reported by this engine
    assert after[("modeld_queue_wait_seconds_count", ())] == 0
    with daemon.grpc() as client:  # the same registry over gRPC, for gRPC-only deployments
        families = {f.name for f in text_string_to_metric_families(client.metrics())}
    assert {"modeld_prefix_cache_queries", "modeld_prefix_cache_hits", "modeld_sessions_open"} <= families


def test_speculation_is_chosen_per_request_and_reported_in_timings_and_metrics(daemon: Daemon) -> None:
    """The ``speculation`` extension field (off / ngram; absent: the daemon's ``--speculation``,
    ngram by default); llama-server's ``timings`` names carry the counts, ``/metrics`` sums them.
    The memory model echoes the last line of the prompt, which the context already holds."""
    messages = [{"role": "user", "content": "Repeat after me:\nthe quick brown fox jumps over it\n"}]

    def ask(**extra: Any) -> tuple[str, dict[str, Any]]:
        done = daemon.client.chat.completions.create(
            model="modeld-tiny", messages=messages, max_tokens=40, extra_body=extra
        )
        return str(done.choices[0].message.content), done.model_extra["timings"]  # type: ignore[index]

    def counter(name: str) -> float:
        return daemon.metrics().get((name, (("model", "modeld-tiny"),)), 0.0)

    accepted_before = counter("modeld_spec_decode_num_accepted_tokens_total")
    text, timings = ask()
    assert timings["draft_n_accepted"] > 0 and timings["draft_n"] >= timings["draft_n_accepted"]
    assert timings["draft_batches"] >= 1 and timings["predicted_n"] == 40
    assert (
        counter("modeld_spec_decode_num_accepted_tokens_total") - accepted_before
        == timings["draft_n_accepted"]
    )
    plain, timings = ask(speculation="off")
    assert plain == text and timings["draft_n"] == 0
    stream = daemon.client.chat.completions.create(
        model="modeld-tiny",
        messages=messages,
        max_tokens=40,
        stream=True,
        extra_body={"speculation": "ngram"},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last.model_extra["timings"]["draft_n_accepted"] > 0  # type: ignore[index]
    for bad in ("eagle", 1, True):
        with pytest.raises(openai.BadRequestError) as err:
            ask(speculation=bad)
        assert (err.value.body["param"], err.value.body["code"]) == ("speculation", "invalid_value")  # type: ignore[index]


def test_a_client_that_goes_away_stops_the_generation(daemon: Daemon) -> None:
    def canceled() -> float:
        key = ("modeld_requests_total", (("finish_reason", "canceled"), ("model", "modeld-tiny")))
        return daemon.metrics().get(key, 0.0)

    before = canceled()
    with httpx.stream(
        "POST",
        f"{daemon.url}/v1/chat/completions",
        json={
            "model": "modeld-tiny",
            "messages": conversation("gone"),
            "stream": True,
            "max_tokens": 2000,
            "delay_ms": 50,
        },
        timeout=30,
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while canceled() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert canceled() == before + 1  # the engine stopped within a token step, not 2000 tokens later


def test_browser_requests_are_refused_on_an_open_loopback_port(daemon: Daemon) -> None:
    rebound = httpx.get(f"{daemon.url}/v1/models", headers={"Host": "attacker.example"}, timeout=10)
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden_host"
    cross = httpx.get(f"{daemon.url}/v1/models", headers={"Origin": "https://attacker.example"}, timeout=10)
    assert cross.status_code == 403 and cross.json()["error"]["code"] == "forbidden_origin"
    local = httpx.get(f"{daemon.url}/v1/models", headers={"Origin": "http://localhost:3000"}, timeout=10)
    assert local.status_code == 200
    assert httpx.get(f"{daemon.url}/health", timeout=10).json() == {"status": "ok"}


def test_health_says_ok_only_once_the_owner_record_names_the_daemon(tmp_path: Path) -> None:
    """A client that waits for ``/health`` to say 200 (the bench, a gateway's probe) may then
    find the daemon through its owner record: the gRPC endpoint is published by then. The HTTP
    listener is bound first, so ``/health`` says 503 "starting" in between. The daemon runs as on
    a fresh clone, every module compiled on its first import, which widens that window."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    data = tmp_path / "d"
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}
    argv = [
        MODELD,
        "--data-dir",
        str(data),
        "serve",
        "--backend",
        "memory",
        "--listen",
        f"unix:{data}/s.sock",
    ]
    proc = subprocess.Popen(
        [*argv, "--http", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            except httpx.TransportError:
                continue
            seen.append(health.status_code)
            if health.status_code == 200:
                record = read_lease(data)
                assert record is not None and record.state == "serving", record
                assert record.endpoint == f"unix:{data}/s.sock", record
                break
            assert health.json() == {"status": "unavailable", "reason": "starting"}
        assert seen and seen[-1] == 200, (seen, proc.poll())
    finally:
        stop(proc)


def test_remote_listening_requires_and_enforces_an_api_key(tmp_path: Path) -> None:
    refused = modeld(
        "serve", "--backend", "memory", "--http", "0.0.0.0:0", "--allow-remote", data_dir=tmp_path / "a"
    )
    assert refused.returncode == 2
    assert "an API key is required" in refused.stderr
    not_allowed = modeld("serve", "--backend", "memory", "--http", "0.0.0.0:0", data_dir=tmp_path / "b")
    assert not_allowed.returncode == 2 and "--allow-remote" in not_allowed.stderr

    tmp = Path(tempfile.mkdtemp(prefix="mdk"))
    d = Daemon(tmp, "--allow-remote", "--api-key", "s3cret-key", http="0.0.0.0:0")
    try:
        port = d.url.rsplit(":", 1)[1]
        base = f"http://127.0.0.1:{port}/v1"  # traffic stays on this machine
        anonymous = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            anonymous.models.list()
        assert err.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        keyed = openai.OpenAI(base_url=base, api_key="s3cret-key", max_retries=0)
        done = keyed.chat.completions.create(
            model="modeld-tiny", messages=conversation("remote"), max_tokens=2
        )
        assert done.usage is not None and done.usage.completion_tokens == 2
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_registered_models_are_served_by_name_and_never_by_path(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "alpha.bin").write_text("alpha weights\n")
    tmp = Path(tempfile.mkdtemp(prefix="mdm"))
    beta = tmp_path / "beta.bin"
    beta.write_text("beta weights\n")
    d = Daemon(tmp, "--models-dir", str(models), "--model", f"beta={beta}")
    try:
        assert [m.id for m in d.client.models.list()] == ["alpha.bin", "beta"]
        (models / "gamma.bin").write_text("gamma\n")  # copied in while serving
        time.sleep(1.1)
        done = d.client.chat.completions.create(model="gamma.bin", messages=conversation("dir"), max_tokens=1)
        assert done.model == "gamma.bin"
        with pytest.raises(openai.NotFoundError) as err:
            d.client.chat.completions.create(model=str(beta), messages=conversation("path"), max_tokens=1)
        assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
        listing = httpx.get(f"{d.url}/v1/models", timeout=10).text
        assert str(tmp_path) not in listing and "alpha.bin" in listing  # names, never paths
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.llama
@pytest.mark.slow
def test_the_generated_llama_model_serves_warm_turns() -> None:
    """The default model on the llama backend: the generated tiny GGUF with its real template."""
    tmp = Path(tempfile.mkdtemp(prefix="mdl"))
    d = Daemon(tmp, backend="llama")
    try:
        # One file, one name on every transport: gRPC's Describe of the file by its path (no
        # name given, before HTTP loaded it) names it as /v1/models, /api/tags and /api/show do.
        path = str(ensure_model(TINY))
        with d.grpc() as client:
            described = client.describe(rc.OpenSessionRequest(type="llama", path=path))
        assert described.model_name == "modeld-tiny"  # not the GGUF's general.name
        assert "modeld-tiny" in [m.id for m in d.client.models.list()]
        tags = httpx.get(f"{d.url}/api/tags", timeout=10).json()
        assert "modeld-tiny" in [m["name"] for m in tags["models"]]
        show = httpx.post(f"{d.url}/api/show", json={"model": "modeld-tiny"}, timeout=60).json()
        assert show["model_info"]["general.name"] == "modeld-tiny"
        # What it will take, before it loads: describe's footprint on every face, one figure.
        footprint = described.footprint
        assert footprint.total_bytes > footprint.weights_bytes > 0 and footprint.kv_bytes > 0
        listed = httpx.get(f"{d.url}/v1/models/modeld-tiny", timeout=10).json()["modeld"]["footprint"]
        for key in ("weights_bytes", "kv_bytes_per_token", "kv_bytes", "total_bytes", "max_window", "layout"):
            assert listed[key] == getattr(footprint, key) == show["model_info"][f"modeld.{key}"], key
        messages = conversation("test_llama")
        first = d.client.chat.completions.create(
            model="modeld-tiny", messages=messages, max_tokens=8, temperature=0
        )
        reply = first.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on.\n"}]
        stream = d.client.chat.completions.create(
            model="modeld-tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached is not None and cached > 0
        session_id = chunks[-1].model_extra["modeld"]["session_id"]  # type: ignore[index]
        with d.grpc() as client:
            report = client.explain_context(session_id)
        assert report.last_prefix is not None and cached == report.last_prefix.reused_tokens
        assert report.backend == "llama"
        # The same file opened over gRPC with default settings is the same runtime: one worker.
        with d.grpc() as client:
            [loaded] = client.status().models
            request = rc.OpenSessionRequest(
                type="llama", path=loaded.path, config=rc.Config(prompt_format="chat")
            )
            with client.open_session(request) as session:
                session.ensure_prefix(rc.PrefixInput(text="You review code.\n"))
                assert [m.path for m in client.status().models] == [loaded.path]
                assert session.explain_context().model_name == loaded.model_name == "modeld-tiny"
        # A lone user message: its template reads messages[0], so the prefix is never empty.
        alone = d.client.chat.completions.create(
            model="modeld-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert alone.usage is not None and alone.usage.completion_tokens == 2
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_request_sent_again_reuses_its_suffix_too(daemon: Daemon) -> None:
    """A retry, or a rerun whose first message is the same (Qwen Code's headless rerun re-sent an
    8.5k-token first message): the new user turn is still resident from the last turn, so it is
    reused, not recomputed; the answer is the same."""
    messages = [*conversation("suffix-again"), {"role": "user", "content": "and again? " * 40}]
    headers = {"X-Modeld-Conversation": "again"}
    answers = []
    for _ in range(2):
        done = daemon.client.chat.completions.create(
            model="modeld-tiny", messages=messages, max_tokens=6, extra_headers=headers
        )
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        answers.append((done.choices[0].message.content, done.usage.prompt_tokens_details.cached_tokens))
    prompt = tokens(chatml(messages))
    assert answers[0][1] < prompt and answers[1][1] == prompt
    assert answers[0][0] == answers[1][0]
    with daemon.grpc() as client:  # the session says so too
        session = client.open_session(
            rc.OpenSessionRequest(type="memory", path="tiny", config=rc.Config(num_ctx=4096))
        )
        prefix = session.ensure_prefix(rc.PrefixInput(text="p" * 100))
        session.prefill_suffix(rc.SuffixInput(text="s" * 50))
        list(session.decode(rc.DecodeConfig(max_tokens=2)))
        session.ensure_prefix(rc.PrefixInput(text="p" * 100))
        again = session.prefill_suffix(rc.SuffixInput(text="s" * 50))
        assert (prefix.prefilled_tokens, again.reused_tokens, again.restored_tokens) == (101, 50, 0)
        session.close()
