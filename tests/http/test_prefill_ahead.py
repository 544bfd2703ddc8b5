"""The next turn's prefix computed while the user reads (``--prefill-ahead``, the default; blueprint 0010,
"Ahead of the next turn"), through the official ``openai`` SDK against a real
``modeld serve --http`` on the generated Qwen3-family model (its template drops the reasoning of
the turns before the newest user message, so a user's turn after an agent's tool loop renders
that loop otherwise than the turn before did).

An answer without a tool call leaves its session a prefill of the conversation with that answer
as history; the user's next turn, sent at once, waits for it and computes only its own message.
The same turns on a daemon without it (``--no-prefill-ahead``) compute the re-rendered history in the
user's turn, and give the same greedy tokens and log-probabilities (the prefix computed ahead is
an ordinary warm prefix). A turn that ends in a tool call leaves nothing. The prefill ahead is
reported apart from the turns: a request record of its own (finish ``ahead``, the turn's
conversation), which the records' sums and ``/metrics`` both count, and explain-context's
``ahead``, beside the last turn's own reuse.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from daemon_proc import modeld, serve_http, stop
from prometheus_client.parser import text_string_to_metric_families

import runtime_client as rc

pytestmark = [pytest.mark.wire, pytest.mark.llama]

families = pytest.importorskip("modeld.testmodels.families")
pytest.importorskip("llama_cpp")

SYSTEM = "You are a coding agent working in a Python repository. Read files before you answer. " * 8
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
LOOP: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Why does main() crash?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The traceback points at main.py; read it first.",
        "tool_calls": [
            {
                "id": "call00001",
                "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": "main.py"})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call00001", "content": "def main():\n    return 1 / 0\n"},
]


@pytest.fixture(scope="module")
def model() -> Path:
    return families.ensure_family_model("qwen3")


def _daemon(model: Path, *flags: str) -> Iterator[openai.OpenAI]:
    data = Path(tempfile.mkdtemp(prefix="mdahead-"))
    proc, record = serve_http(
        data, "--model", f"m={model}", "--num-ctx", "4096", *flags, backend="llama", timeout=180
    )
    try:
        client = openai.OpenAI(base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0)
        _DATA[id(client)] = data
        yield client
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


_DATA: dict[int, Path] = {}
"""A daemon's data directory by its client (explain-context goes over gRPC)."""


@pytest.fixture
def ahead(model: Path) -> Iterator[openai.OpenAI]:
    yield from _daemon(model)  # the default


@pytest.fixture
def plain(model: Path) -> Iterator[openai.OpenAI]:
    yield from _daemon(model, "--no-prefill-ahead")


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int = 4, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="m",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        user="the-conversation",
        **extra,
    )


def _computed(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    return int(reply.usage.prompt_tokens - (details.cached_tokens if details else 0))


def _answer(reply: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    choice = reply.choices[0]
    return [
        (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in choice.logprobs.content
    ]


def _ahead_counts(client: openai.OpenAI) -> dict[str, float]:
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "modeld_prefills_ahead_total":
                out[sample.labels["outcome"]] = sample.value
            if sample.name == "modeld_prefill_ahead_tokens_total":
                out["tokens"] = sample.value
    return out


def _two_turns(client: openai.OpenAI) -> tuple[Any, Any]:
    """The loop's answer (no tools offered: it ends without a call), then at once the user's turn."""
    first = _ask(client, LOOP)
    assert first.choices[0].finish_reason in ("stop", "length")
    assert not first.choices[0].message.tool_calls
    answer = {"role": "assistant", "content": first.choices[0].message.content or ""}
    second = _ask(client, [*LOOP, answer, {"role": "user", "content": "Fix it."}])
    return first, second


def test_the_users_turn_computes_only_its_message_and_answers_as_without(
    ahead: openai.OpenAI, plain: openai.OpenAI
) -> None:
    first, second = _two_turns(ahead)
    first_plain, second_plain = _two_turns(plain)
    assert _answer(first) == _answer(first_plain)
    assert second.usage.prompt_tokens == second_plain.usage.prompt_tokens
    # Without: the user's turn computes from the tool call on (the template dropped its
    # reasoning). With: the prefix was computed while the user read; only the new message is left.
    computed, computed_plain = _computed(second), _computed(second_plain)
    assert computed_plain >= computed + 40, (computed, computed_plain)
    assert computed <= 16, computed  # "<|im_start|>user\nFix it.<|im_end|>\n<|im_start|>assistant\n"
    assert _answer(second) == _answer(second_plain)  # the same greedy tokens and logprobs
    counts = _ahead_counts(ahead)
    assert counts.get("done", 0) >= 1 and counts.get("failed", 0) == 0, counts
    assert counts["tokens"] >= computed_plain - computed, counts
    assert _ahead_counts(plain) == {}


def test_a_turn_that_ends_in_a_tool_call_leaves_nothing_ahead(ahead: openai.OpenAI) -> None:
    for _ in range(2):  # the second waits for whatever the first left its session
        reply = _ask(
            ahead,
            LOOP[:2],
            max_tokens=96,
            tools=[READ_FILE],
            tool_choice={"type": "function", "function": {"name": "read_file"}},
        )
        assert reply.choices[0].message.tool_calls, reply.choices[0]
    assert _ahead_counts(ahead) == {}


def _metric(client: openai.OpenAI, name: str) -> float:
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def test_the_prefill_ahead_is_reported_apart_from_the_turns(ahead: openai.OpenAI) -> None:
    first, second = _two_turns(ahead)
    base = str(ahead.base_url).removesuffix("/v1/").removesuffix("/v1")
    # Both turns ended without a tool call, so each left a prefill ahead: wait for the second's.
    records: list[dict[str, Any]] = []
    for _ in range(600):
        records = httpx.get(f"{base}/v1/requests", params={"limit": 100}, timeout=30).json()["data"]
        if sum(r["finish"] == "ahead" for r in records) == 2 and all(r["state"] == "done" for r in records):
            break
        time.sleep(0.1)
    records.sort(key=lambda r: r["started_at"])
    turns = [r for r in records if r["finish"] != "ahead"]
    aheads = [r for r in records if r["finish"] == "ahead"]
    assert [r["finish"] for r in records] == [
        first.choices[0].finish_reason,
        "ahead",
        second.choices[0].finish_reason,
        "ahead",
    ], records
    assert len(aheads) == 2 and all(r["state"] == "done" and not r["error"] for r in aheads), aheads
    # Each carries the turn's labels and only the prefill's counts: no prompt, no decode.
    for r in aheads:
        assert r["api"] == "openai" and r["conversation"] == turns[1]["conversation"], r
        assert r["model"] == "m" and r["prefilled_tokens"] > 0 and r["decodes"] == 0, r
        assert r["prompt_tokens"] == 0 and r["generated_tokens"] == 0, r
        assert r["prefix_tokens"] == r["reused_tokens"] + r["prefilled_tokens"], r
    # One truth: the records, the work ahead included, sum to /metrics.
    assert sum(r["prefilled_tokens"] for r in records) == _metric(
        ahead, "modeld_prompt_tokens_prefilled_total"
    )
    assert sum(r["prefilled_tokens"] for r in aheads) == _ahead_counts(ahead)["tokens"]
    # The user's turn computed only its message: the first answer's prefill ahead did the rest.
    assert turns[1]["prefilled_tokens"] == _computed(second), turns[1]
    # explain-context: the last turn's own reuse, and beside it the prefix computed ahead.
    ext = (second.model_extra or {})["modeld"]
    with rc.connect(data_dir=_DATA[id(ahead)]) as client:
        report = client.explain_context(ext["session_id"])
    assert report.last_prefix is not None and report.last_reuse is not None
    assert report.last_reuse.outcome == ext["reuse"] and report.last_reuse.reason == ext["reason"]
    assert report.last_prefix.reused_tokens == ext["reused_tokens"]
    assert report.last_prefix.prefilled_tokens == ext["prefilled_tokens"]
    assert report.ahead is not None
    assert report.ahead.prefilled_tokens == aheads[1]["prefilled_tokens"]
    assert report.ahead.prefix_tokens == report.prefix_tokens > second.usage.prompt_tokens
    text = modeld("explain-context", ext["session_id"], data_dir=_DATA[id(ahead)]).stdout
    assert f"last ensure_prefix: {ext['reuse'].upper()}" in text, text
    assert (
        f"last prefix computed ahead of a turn: {report.ahead.prefix_tokens} tokens, "
        f"{report.ahead.reused_tokens} of them warm, {report.ahead.prefilled_tokens} computed" in text
    ), text
