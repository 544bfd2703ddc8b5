"""Every model family's template, over every API, turn after turn, warm (issue 31).

The models are REPLY with each family's template and tokens (``modeld.testmodels.families``),
served by a real daemon on llama.cpp. Each family runs a 3-turn agent conversation over OpenAI
chat, OpenAI Responses and Anthropic Messages, each with the vendor's own SDK, and Ollama's
/api/chat as its SDK sends it (the SDK's models drop the ``modeld`` extension that says what was
reused; ``show`` goes through the SDK): a system
prompt with tools and a question; then the assistant's call (with its reasoning) and the tool's
result; then the assistant's answer and a new question. Checked on every turn:

* the request succeeds (2xx);
* the prompt has exactly the tokens of the whole conversation as the family's template renders
  it (``test_families_oracle.py`` holds that rendering to llama-server's ``/apply-template``);
* the turn reuses everything of the previous turn's prompt the template did not render
  otherwise (the longest common token prefix of the two renderings); it may reuse more, from
  another API's conversation that rendered the same prompt before it (reuse is by tokens, from
  every warm context of the model).

Gemma 3's template has no tools and refuses a tool result (its roles must alternate): its
conversation has no call, and a request with a tool result gets a 400 with the template's words.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from daemon_proc import modeld
from families_kit import (
    ANSWER,
    ARGS,
    ASK,
    CALL_ID,
    FIX,
    MAX_TOKENS,
    REASONING,
    RESULT,
    SYSTEM,
    TOOL,
    Clients,
    Vocab,
    chat_messages,
    conversation,
    render,
    serve_families,
)

from modeld.cache.reuse import common_prefix_len
from modeld.manifest import token_hash
from modeld.server.http.turn import Message as TurnMessage
from modeld.testmodels.families import FAMILIES, Family

pytestmark = [pytest.mark.wire, pytest.mark.llama]


def openai_chat(clients: Clients, fam: Family, turn: int) -> tuple[int, int]:
    client = clients.openai
    messages = chat_messages(fam, turn, SYSTEM)
    done = client.chat.completions.create(
        model=fam.name,
        messages=messages,
        tools=[{"type": "function", "function": TOOL}] if fam.tools else openai.NOT_GIVEN,  # type: ignore[list-item]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Modeld-Conversation": f"{fam.name}-chat"},
    )
    usage = done.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    clients.last_session = (done.model_extra or {})["modeld"]["session_id"]
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def openai_responses(clients: Clients, fam: Family, turn: int) -> tuple[int, int]:
    client = clients.openai
    items: list[Any] = [{"role": "user", "content": ASK}]
    if turn >= 2 and fam.tools:
        items += [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": REASONING}]},
            {
                "type": "function_call",
                "call_id": CALL_ID,
                "name": TOOL["name"],
                "arguments": json.dumps(ARGS),
            },
            {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT},
        ]
    elif turn >= 2:
        items += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    if turn >= 3:
        items += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    done = client.responses.create(
        model=fam.name,
        instructions=SYSTEM,
        input=items,
        tools=[{"type": "function", **TOOL, "strict": False}] if fam.tools else openai.NOT_GIVEN,  # type: ignore[list-item]
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,
        prompt_cache_key=f"{fam.name}-responses",
    )
    assert done.usage is not None
    return done.usage.input_tokens, done.usage.input_tokens_details.cached_tokens


def anthropic_messages(clients: Clients, fam: Family, turn: int) -> tuple[int, int]:
    client = clients.anthropic
    messages: list[Any] = [{"role": "user", "content": ASK}]
    if turn >= 2 and fam.tools:
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": REASONING, "signature": ""},
                    {"type": "tool_use", "id": CALL_ID, "name": TOOL["name"], "input": ARGS},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL_ID, "content": RESULT}]},
        ]
    elif turn >= 2:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    if turn >= 3:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    tools: Any = (
        [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
        if fam.tools
        else anthropic.NOT_GIVEN
    )
    done = client.messages.create(
        model=fam.name,
        system=SYSTEM,
        messages=messages,
        tools=tools,
        max_tokens=MAX_TOKENS,
        extra_headers={"X-Modeld-Conversation": f"{fam.name}-anthropic"},
    )
    u = done.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    return prompt, u.cache_read_input_tokens or 0


def ollama_chat(clients: Clients, fam: Family, turn: int) -> tuple[int, int]:
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    if turn >= 2 and fam.tools:
        messages += [
            {
                "role": "assistant",
                "content": "",
                "thinking": REASONING,
                "tool_calls": [{"function": {"name": TOOL["name"], "arguments": ARGS}}],
            },
            {"role": "tool", "tool_name": TOOL["name"], "content": RESULT},
        ]
    elif turn >= 2:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    if turn >= 3:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FIX}]
    # Over the wire as the SDK sends it: the SDK's models drop the ``modeld`` extension, which
    # holds the reused count (Ollama's prompt_eval_count is the whole prompt, cached included).
    body = {
        "model": fam.name,
        "messages": messages,
        "options": {"num_predict": MAX_TOKENS, "temperature": 0},
        "stream": False,
        **({"tools": [{"type": "function", "function": TOOL}]} if fam.tools else {}),
    }
    answer = httpx.post(f"{clients.url}/api/chat", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    done = answer.json()
    return done["prompt_eval_count"], done["modeld"]["cached_tokens"]


APIS: dict[str, Callable[[Clients, Family, int], tuple[int, int]]] = {
    "openai-chat": openai_chat,
    "responses": openai_responses,
    "anthropic": anthropic_messages,
    "ollama": ollama_chat,
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[Clients]:
    with serve_families() as clients:
        yield clients


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_a_three_turn_agent_conversation_is_warm_over_every_api(daemon: Clients, fam: Family) -> None:
    vocab = Vocab(fam)
    for api, run in APIS.items():
        renderings = [vocab.tokens(render(fam, conversation(fam, t, api))) for t in (1, 2, 3)]
        previous: list[int] | None = None
        for t in (1, 2, 3):
            prompt, cached = run(daemon, fam, t)
            expected = renderings[t - 1]
            assert prompt == len(expected), (
                f"{fam.name} over {api}, turn {t}: the prompt is not the template's rendering"
            )
            if previous is not None:
                kept = common_prefix_len(previous, expected)  # what the template did not render otherwise
                assert kept <= cached <= len(expected), f"{fam.name} over {api}, turn {t}: reuse"
            previous = expected
            if api == "openai-chat" and t == 3:  # token for token: the session's resident prompt
                assert_resident(daemon, expected)


def assert_resident(daemon: Clients, expected: list[int]) -> None:
    """The last chat turn's session holds exactly ``expected`` as its prompt: its prefix's and
    suffix's token hashes are those of the whole rendering tokenized whole, cut where it says."""
    shown = modeld("explain-context", daemon.last_session, "--json", data_dir=daemon.data_dir)
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    report = report.get("report", report)
    n = report["prefix_tokens"]
    assert report["prefix_tokens"] + report["suffix_tokens"] == len(expected)
    assert report["stable_token_hash"] == token_hash(expected[:n])
    assert report["volatile_token_hash"] == token_hash(expected[n:])


def test_a_template_that_refuses_a_conversation_answers_400_with_its_words(daemon: Clients) -> None:
    client = daemon.openai
    call = {
        "id": CALL_ID,
        "type": "function",
        "function": {"name": TOOL["name"], "arguments": json.dumps(ARGS)},
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="gemma3",
            messages=[
                {"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [call]},  # type: ignore[list-item]
                {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
            ],
            max_tokens=MAX_TOKENS,
        )
    assert err.value.status_code == 400
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in err.value.message
    with pytest.raises(anthropic.BadRequestError) as refused:  # Mistral wants call ids of 9 characters
        daemon.anthropic.messages.create(
            model="mistral-small",
            max_tokens=MAX_TOKENS,
            messages=[
                {"role": "user", "content": ASK},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": ARGS}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}],
                },
            ],
        )
    assert "Tool call IDs should be alphanumeric strings with length 9!" in refused.value.message


def test_every_api_names_the_template_a_model_renders_with(daemon: Clients) -> None:
    listed = {m.id: (m.model_extra or {})["modeld"]["chat_template"] for m in daemon.openai.models.list()}
    assert set(listed) == {f.name for f in FAMILIES}
    assert listed["qwen3"]["source"] == "model" and listed["qwen3"]["tool_format"] == "hermes"
    assert listed["qwen3"]["reasoning_format"] and not listed["qwen3-coder"]["reasoning_format"]
    assert listed["qwen3.5"]["reasoning_format"] == "think"  # whether a prompt opens it: read per prompt
    shown = daemon.ollama.show("qwen3")
    assert shown.modelinfo is not None and shown.modelinfo["modeld.chat_template.source"] == "model"
    assert "thinking" in (shown.capabilities or [])


def test_thinking_off_reaches_the_template_over_every_api(daemon: Clients) -> None:
    """Qwen3.5's generation prompt opens <think>; with thinking off it closes an empty one, so
    the turn spends no tokens thinking. Each API's own words for "off" reach the template."""
    fam = next(f for f in FAMILIES if f.name == "qwen3.5")
    vocab = Vocab(fam)
    messages = [TurnMessage("system", SYSTEM), TurnMessage("user", "Answer at once: 2 + 2?")]
    off = len(vocab.tokens(render(fam, messages, {"enable_thinking": False}, tools=False)))
    on = len(vocab.tokens(render(fam, messages, tools=False)))
    assert off > on  # "\n\n</think>\n\n" closes the block the prompt opened
    chat = daemon.openai.chat.completions.create(
        model=fam.name,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Answer at once: 2 + 2?"},
        ],
        max_tokens=1,
        reasoning_effort="none",
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == off
    kwargs = daemon.openai.chat.completions.create(
        model=fam.name,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Answer at once: 2 + 2?"},
        ],
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert kwargs.usage is not None and kwargs.usage.prompt_tokens == off
    responses = daemon.openai.responses.create(
        model=fam.name,
        instructions=SYSTEM,
        input="Answer at once: 2 + 2?",
        max_output_tokens=1,
        reasoning={"effort": "none"},  # type: ignore[typeddict-item]
        store=False,
    )
    assert responses.usage is not None and responses.usage.input_tokens == off
    message = daemon.anthropic.messages.create(
        model=fam.name,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Answer at once: 2 + 2?"}],
        max_tokens=1,
        thinking={"type": "disabled"},
    )
    u = message.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) == off
