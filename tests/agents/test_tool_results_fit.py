"""``--fit-tool-results`` (issue 33): an Anthropic Messages prompt beyond the window has its tool
results cut, oldest first, until it fits, instead of the 400 that Claude Code can only answer
with a compaction request, which carries its tools and the same tool results and so is refused
too (measured with the real Claude Code: ``tests/agents/test_agent_loops.py``, blueprint 0019).

Driven by the ``anthropic`` SDK against a real ``modeld serve --http`` on the memory backend (one
token per byte, plus BOS: ``count_tokens`` of the cut conversation is the exact oracle) with a
600-token window: a tool result is cut to its first 600 // 4 = 150 characters.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from daemon_proc import serve_http, stop

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"
WINDOW = 600
KEEP = WINDOW // 4
BIG = "".join(f"line {i}\n" for i in range(100))  # 790 characters: alone past the window


def cut(text: str) -> str:
    """The text the model reads in place of a tool result cut to fit (the oracle)."""
    return (
        f"{text[:KEEP]}\n[modeld cut this tool result here: {len(text) - KEEP} of its {len(text)} "
        f"characters are left out, beyond the {WINDOW}-token context window]"
    )


def loop(result: str, *more: Any) -> list[Any]:
    """A Claude Code-shaped tool loop: the ask, the Read call, its result (and what follows)."""
    return [
        {"role": "user", "content": 'Read the file "notes.txt".'},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]},
        *more,
    ]


class Daemon:
    def __init__(self, tmp: Path, *flags: str) -> None:
        self.proc, record = serve_http(tmp, "--num-ctx", str(WINDOW), *flags)  # cutting is the default
        self.client = anthropic.Anthropic(
            base_url=record.http_endpoint, api_key="unused", max_retries=0, timeout=60
        )

    def count(self, messages: list[Any]) -> int:
        return self.client.messages.count_tokens(model=MODEL, messages=messages).input_tokens


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdfit"))
    d = Daemon(tmp)
    try:
        yield d
    finally:
        d.client.close()
        _, err = stop(d.proc)
        shutil.rmtree(tmp, ignore_errors=True)
        assert "Traceback" not in err, err[-3000:]


def prompt_of(message: Any) -> int:
    usage = message.usage
    return int(
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    )


def test_a_tool_result_past_the_window_is_cut_listed_and_answered(daemon: Daemon) -> None:
    assert daemon.count(loop(BIG)) > WINDOW  # without the cut: past the window
    expected = daemon.count(loop(cut(BIG)))  # count_tokens counts what it is sent, uncut
    for stream in (False, True):
        message: Any
        if stream:
            with daemon.client.messages.stream(model=MODEL, max_tokens=8, messages=loop(BIG)) as events:
                message = events.get_final_message()
        else:
            message = daemon.client.messages.create(model=MODEL, max_tokens=8, messages=loop(BIG))
        assert prompt_of(message) == expected, message.usage
        modeld = (message.model_extra or {})["modeld"]
        assert modeld["omitted_content"] == [f"tool_result toolu_1: cut to {KEEP} of {len(BIG)} characters"]


def test_the_next_turn_reuses_the_cut_conversation_whole(daemon: Daemon) -> None:
    """The cut is a function of the tool result and the window alone: the next turn cuts the same
    result the same way, so everything before its new messages is warm."""
    first = daemon.client.messages.create(
        model=MODEL, max_tokens=8, messages=loop(BIG), metadata={"user_id": "fit-warm"}
    )
    answer = {"role": "assistant", "content": [b.model_dump() for b in first.content] or "ok"}
    second = daemon.client.messages.create(
        model=MODEL, max_tokens=8, messages=loop(BIG, answer, {"role": "user", "content": "And?"}),
        metadata={"user_id": "fit-warm"},
    )  # fmt: skip
    assert (second.usage.cache_read_input_tokens or 0) >= prompt_of(first), (first.usage, second.usage)


def test_the_oldest_tool_results_go_first_and_whole_when_cutting_is_not_enough(daemon: Daemon) -> None:
    # An older result past twice the cut size and a newer short one: cutting the older is enough.
    older = BIG[:400]
    two = loop(older, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "z" * 10}]})  # fmt: skip
    assert daemon.count(two) + 8 > WINDOW
    message = daemon.client.messages.create(model=MODEL, max_tokens=8, messages=two)
    assert (message.model_extra or {})["modeld"]["omitted_content"] == [
        f"tool_result toolu_1: cut to {KEEP} of {len(older)} characters"
    ]
    # A conversation that cutting every result to its size does not fit: results are left out whole.
    many = [{"role": "user", "content": "x" * 200}, *loop(BIG)[1:]]
    message = daemon.client.messages.create(model=MODEL, max_tokens=8, messages=many)
    assert (message.model_extra or {})["modeld"]["omitted_content"] == [
        f"tool_result toolu_1: left out ({len(BIG)} characters)"
    ]


def test_a_prompt_that_fits_no_way_is_still_claude_codes_prompt_is_too_long(daemon: Daemon) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        daemon.client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": BIG}])
    assert refused.value.body["error"]["message"].startswith("prompt is too long: ")  # type: ignore[index]


def test_no_fit_tool_results_refuses_in_claude_codes_words_instead() -> None:
    """``--no-fit-tool-results``: the same tool loop past the window is refused, before any
    prefill, with the words Claude Code compacts on; nothing is cut."""
    tmp = Path(tempfile.mkdtemp(prefix="mdfit"))
    d = Daemon(tmp, "--no-fit-tool-results")
    try:
        with pytest.raises(anthropic.BadRequestError) as refused:
            d.client.messages.create(model=MODEL, max_tokens=8, messages=loop(BIG))
        assert refused.value.body["error"]["message"].startswith("prompt is too long: ")  # type: ignore[index]
    finally:
        d.client.close()
        _, err = stop(d.proc)
        shutil.rmtree(tmp, ignore_errors=True)
        assert "Traceback" not in err, err[-3000:]
