"""The next turn's prefix computed while the user reads (``--prefill-ahead``; blueprint 0010,
"Ahead of the next turn"), through the official ``openai`` SDK against a real
``modeld serve --http`` on the generated Qwen3-family model (its template drops the reasoning of
the turns before the newest user message, so a user's turn after an agent's tool loop renders
that loop otherwise than the turn before did).

An answer without a tool call leaves its session a prefill of the conversation with that answer
as history; the user's next turn, sent at once, waits for it and computes only its own message.
The same turns on a daemon without it (the default) compute the re-rendered history in the
user's turn, and give the same greedy tokens and log-probabilities (the prefix computed ahead is
an ordinary warm prefix). A turn that ends in a tool call leaves nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_proc import serve_http, stop
from prometheus_client.parser import text_string_to_metric_families

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
        yield openai.OpenAI(base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0)
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def ahead(model: Path) -> Iterator[openai.OpenAI]:
    yield from _daemon(model, "--prefill-ahead")


@pytest.fixture
def plain(model: Path) -> Iterator[openai.OpenAI]:
    yield from _daemon(model)


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
