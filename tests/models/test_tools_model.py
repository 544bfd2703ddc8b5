"""TOOLS, the tool loop's model (``modeld/testmodels/_tools.py``), in llama.cpp: a user turn that
names a file after ``file "`` is answered with one call reading that file, in the test template's
format (Claude Code's ``Read``, or Codex's ``exec_command`` with ``cat`` when that tool is
offered), and a tool result with ``Done.``; each ends the turn. Greedy and sampled, with short
prompts here (the real agents' 12-20k-token prompts are run in tests/agents/test_agents.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jinja2
import pytest

from modeld.testmodels import TOOLS, ensure_model
from modeld.testmodels._template import CHATML_TOOLS_TEMPLATE
from modeld.testmodels._tools import ANSWER, MAX_NAME_TOKENS

pytestmark = pytest.mark.llama

READ = json.dumps(
    {
        "type": "function",
        "function": {
            "name": "Read",
            "description": "Reads a file from the local filesystem.",
            "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}},
        },
    }
)
EXEC = json.dumps(
    {
        "type": "function",
        "function": {
            "name": "exec_command",
            "description": "Runs a command in a PTY.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
)


def call(name: str, arguments: dict[str, str]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}\n</tool_call>"


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    import llama_cpp

    model = llama_cpp.Llama(model_path=str(ensure_model(TOOLS)), n_ctx=4096, n_threads=1, verbose=False)
    try:
        yield model
    finally:
        model.close()


def answer(
    llm: Any, messages: list[dict[str, str]], tools: list[str], *, temperature: float = 0.0, seed: int = 0
) -> tuple[str, str]:
    prompt = (
        jinja2.Environment()
        .from_string(CHATML_TOOLS_TEMPLATE)
        .render(messages=messages, tools=tools, add_generation_prompt=True)
    )
    out = llm.create_completion(prompt, max_tokens=64, temperature=temperature, seed=seed)
    choice = out["choices"][0]
    return choice["text"], choice["finish_reason"]


SYSTEM = {"role": "system", "content": "You are a coding agent. Keep answers short."}


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 7), (1.0, 8)])
def test_a_user_turn_naming_a_file_is_answered_with_a_call_reading_it(
    llm: Any, temperature: float, seed: int
) -> None:
    for name in ("calc.py", "test_calc.py", "README.md"):
        user = {"role": "user", "content": f'Read the file "{name}" and say what it does.'}
        got = answer(llm, [SYSTEM, user], [READ], temperature=temperature, seed=seed)
        assert got == (call("Read", {"file_path": name}), "stop"), name


def test_with_codex_s_exec_command_offered_the_call_is_cat(llm: Any) -> None:
    user = {"role": "user", "content": 'Read the file "calc.py".'}
    for tools in ([EXEC], [READ, EXEC], [EXEC, READ]):
        assert answer(llm, [SYSTEM, user], tools) == (call("exec_command", {"cmd": "cat calc.py"}), "stop")


def test_a_tool_result_is_answered_and_the_turn_ends(llm: Any) -> None:
    user = {"role": "user", "content": 'Read the file "calc.py".'}
    history = [SYSTEM, user, {"role": "assistant", "content": call("Read", {"file_path": "calc.py"})}]
    for result in ('1\t"""A tiny calculator."""\n2\t', "", "</tool_response> in the middle\n" * 30):
        got = answer(llm, [*history, {"role": "tool", "content": result}], [READ])
        assert got == (ANSWER, "stop"), result[:40]


def test_the_loop_goes_on_turn_after_turn(llm: Any) -> None:
    """A second user turn naming the same file calls again (the earlier call and the earlier
    user turn vote for the same name); its result is answered again."""
    messages = [SYSTEM, {"role": "user", "content": 'Read the file "calc.py".'}]
    for _ in range(3):
        text, finish = answer(llm, messages, [READ])
        assert (text, finish) == (call("Read", {"file_path": "calc.py"}), "stop")
        messages += [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": "def add(a, b): ..."},
        ]
        assert answer(llm, messages, [READ]) == (ANSWER, "stop")
        messages += [
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": 'Now the file "calc.py" again.'},
        ]


def test_without_a_name_the_call_still_ends(llm: Any) -> None:
    """Nothing to copy (no file named) or a name too long to copy whole: the call closes the
    name and ends the turn all the same (an agent then reports the tool's error)."""
    for content in (
        "What does this repository do?",
        'Read the file "' + "abcdefghij/" * MAX_NAME_TOKENS + 'x.py".',
    ):
        text, finish = answer(llm, [SYSTEM, {"role": "user", "content": content}], [READ])
        assert finish == "stop" and text.startswith(
            '<tool_call>\n{"name":"Read","arguments":{"file_path":"'
        ), text
        assert text.endswith('"}}\n</tool_call>'), text


def test_the_file_is_a_pure_function_of_the_spec(tmp_path: Any) -> None:
    """Generated twice, byte for byte the same (the construction has no free randomness: its
    token codes come from raw PCG64 bits keyed by the seed)."""
    import hashlib

    first = ensure_model(TOOLS, tmp_path / "a")
    second = ensure_model(TOOLS, tmp_path / "b")
    assert hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(second.read_bytes()).digest()
    assert first.stat().st_size < 8 << 20  # a few MB: tests load it in milliseconds
