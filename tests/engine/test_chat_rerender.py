"""Templates that render earlier turns otherwise once more follow are served warm, never refused
(blueprint 0010): the whole conversation is rendered as the template renders it, and the
longest common token prefix with what is warm is reused.

On the in-process engine with the memory backend (one token per byte, so every count is
exact), rendering with family templates written in ``modeld/testmodels`` (a session's
``chat_template``), the conversation built as the HTTP layer builds it (``chat_inputs``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from modeld.contract import Config, DecodeConfig, OpenSessionRequest, Session, ToolCall
from modeld.engine import Engine
from modeld.engine.chat_env import TemplateRefusedError
from modeld.errors import InvalidArgumentError
from modeld.manifest import ContextManifest
from modeld.server.http.turn import Message, chat_inputs, split_point
from modeld.testmodels.families import family

TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
)
SYSTEM = Message("system", "You are a coding agent. Answer briefly.")
ASK = Message("user", "Why does main() crash?")
CALL = ToolCall("call00001", "read_file", json.dumps({"path": "main.py"}))


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine(backends=("memory",))
    yield e
    e.shutdown()


def open_family(engine: Engine, name: str) -> Session:
    return engine.open_session(
        OpenSessionRequest(
            type="memory",
            path="agent",
            config=Config(prompt_format="chat"),
            chat_template=family(name).template,
        )
    )


def turn(
    session: Session, messages: list[Message], tools: str = TOOLS, decode: int = 0
) -> tuple[int, int, int]:
    """One turn as the HTTP layer runs it: (reused prefix tokens, prefix tokens kept, prompt)."""
    prefix, suffix = chat_inputs(messages, split_point(messages), tools, "test")
    status = session.ensure_prefix(prefix)
    after = session.prefill_suffix(suffix)
    if decode:
        with session.decode(DecodeConfig(max_tokens=decode)) as stream:
            for _ in stream:
                pass
    return status.reused_tokens, after.prefix_tokens, after.prefix_tokens + after.suffix_tokens


def test_a_tools_template_that_refuses_a_system_message_alone_serves_a_first_turn(engine: Engine) -> None:
    """Llama 3.3 puts the tools in the first user message and refuses a conversation without
    one: the first turn's prefix is never rendered alone."""
    with open_family(engine, "llama3.3") as s:
        _reused, kept, prompt = turn(s, [SYSTEM, ASK])
        report = s.explain_context()
        assert report.resident_tokens == prompt and kept > 0
        # The prefix is the system turn and the first user turn's header: all of it is kept.
        assert kept == report.prefix_tokens


def test_a_reply_sent_back_with_its_reasoning_extends_the_warm_prompt(engine: Engine) -> None:
    """Turn 2 sends back turn 1's reply with its reasoning; Qwen3's template renders it without
    the <think> block once a later user turn follows, and the prefix (rendered so) extends
    turn 1's whole prompt: all of it is reused."""
    with open_family(engine, "qwen3") as s:
        _reused, _kept, first_prompt = turn(s, [SYSTEM, ASK], decode=0)
        reply = Message("assistant", "It divides by zero.", reasoning="Read main.py first.")
        reused, _kept, prompt = turn(s, [SYSTEM, ASK, reply, Message("user", "Fix it.")])
        assert reused == first_prompt  # the whole first prompt: its text did not change
        report = s.explain_context()
        assert report.resident_tokens == prompt
        assert report.last_reuse is not None and report.last_reuse.outcome == "warm"


def test_a_template_cut_names_the_message_and_keeps_the_prefix_up_to_there(engine: Engine) -> None:
    """A client sends a tool result and a new user message at once (Claude Code does: one user
    message with a tool_result and text). The prefix, rendered as the template renders it
    before a tool result, shows the call's reasoning (it follows the last user query); the
    whole conversation, with the new user query after it, does not. prefill_suffix keeps the
    resident prefix up to the reasoning, computes the rest, and says the template did it."""
    with open_family(engine, "qwen3") as s:
        turn(s, [SYSTEM, ASK])
        call = Message("assistant", "", (CALL,), reasoning="Read main.py first.")
        result = Message("tool", "def main(): return 1 / 0", tool_call_id=CALL.id)
        messages = [SYSTEM, ASK, call, result, Message("user", "Also check the tests.")]
        reused, kept, prompt = turn(s, messages)
        report = s.explain_context()
        assert report.resident_tokens == prompt and report.prefix_tokens == kept
        assert reused < kept  # turn 1's prompt, all of it: the cut falls after it, at the reasoning
        # The usage counts as cached what was reused and kept: what ensure_prefix computed past
        # the cut is not part of the prompt, and is not counted against it.
        with s.decode(DecodeConfig(max_tokens=1)) as stream:
            usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.prompt_tokens == prompt and usage.cached_tokens == min(reused, kept)
        assert report.last_reuse is not None
        words = report.last_reuse.message
        assert "the chat template renders the whole conversation otherwise than the prefix" in words
        assert "message 2 (assistant)" in words and "the template did it" in words


def test_the_reason_of_a_divergence_names_the_templates_doing_or_the_clients() -> None:
    """``template_note``: an unchanged message rendered otherwise, last turn's reply rendered
    otherwise than the model wrote it, a reply the client replaced, or a change before it."""
    from dataclasses import replace

    from modeld.engine.prepare import template_note

    def manifest(messages: list[Message]) -> tuple[ContextManifest, bytes]:
        prefix, _suffix = chat_inputs(messages, len(messages), "", "t")
        assert prefix.manifest is not None
        segments = tuple(
            replace(
                seg, hash=prefix.text[seg.byte_start : seg.byte_end], token_start=10 * i, token_end=10 * i + 9
            )
            for i, seg in enumerate(prefix.manifest.segments)
        )
        return replace(prefix.manifest, segments=segments), prefix.text.encode()

    before, _ = manifest([SYSTEM, ASK])
    now, data = manifest([SYSTEM, ASK, Message("assistant", "It divides by zero.")])
    assert "is the same as last turn's" in template_note(before, now, 15, b"", data)
    said = template_note(before, now, 25, b"<think>x</think>It divides by zero.", data)
    assert "last turn's reply sent back" in said and "the template did it" in said
    assert "the client sent another" in template_note(before, now, 25, b"Something else.", data)
    edited, data = manifest([Message("system", "Other."), ASK, Message("assistant", "It divides by zero.")])
    assert template_note(before, edited, 15, b"", data) == ""


def test_an_unchanged_message_the_template_renders_otherwise_is_named(engine: Engine) -> None:
    """Turn 3 of a Mistral conversation: its tools move from before the first user message to
    before the new one, so the prefix diverges inside a message the client did not change."""
    with open_family(engine, "mistral-small") as s:
        turn(s, [SYSTEM, ASK])
        answer = Message("assistant", "It divides by zero.")
        reused, _kept, _prompt = turn(s, [SYSTEM, ASK, answer, Message("user", "Fix it.")])
        report = s.explain_context()
        assert report.last_reuse is not None and report.last_reuse.outcome == "partial"
        assert "message 1 (user) is the same as last turn's" in report.last_reuse.message
        assert "the template did it" in report.last_reuse.message
        assert reused > 0


def test_a_refusing_template_is_an_invalid_argument_with_its_own_words(engine: Engine) -> None:
    """Gemma 3 has no tool role: a tool result breaks its user/model alternation."""
    with open_family(engine, "gemma3") as s:
        turn(s, [SYSTEM, ASK], tools="")
        call = Message("assistant", "", (CALL,))
        result = Message("tool", "x", tool_call_id=CALL.id)
        with pytest.raises(InvalidArgumentError) as err:
            turn(s, [SYSTEM, ASK, call, result], tools="")
        assert isinstance(err.value, TemplateRefusedError)
        assert "Conversation roles must alternate" in err.value.message
        # The warm context is untouched: the same first turn is still a full hit.
        reused, kept, _prompt = turn(s, [SYSTEM, ASK], tools="")
        assert reused == kept


def test_only_what_follows_the_prefixs_last_control_token_is_tokenized_again() -> None:
    """The whole rendering is tokenized as a whole would be, but the long part already tokenized
    for the prefix, up to its last control token (where the engines split text first), is not
    tokenized again."""
    from itertools import accumulate

    from modeld.engine.prepare import ChatState, _tokenize_whole

    control = "<|x|>"
    seen: list[str] = []

    def tokenize(text: str, add_bos: bool) -> list[int]:  # one token per character, <|x|> one
        seen.append(text)
        out = [1] if add_bos else []
        for part in text.split(control):
            out += [ord(c) for c in part] + [1000]
        return out[:-1]

    prefix = f"{control}system\nS{control}{control}user\n"
    whole = prefix + f"hello{control}{control}assistant\n"
    tokens = tokenize(prefix, True)
    ends = [0, *accumulate(len(control) if t == 1000 else 1 for t in tokens[1:])]
    chat = ChatState([], None, {}, b"", True, prefix, tuple(ends))
    seen.clear()
    got, same = _tokenize_whole(whole, chat, tokens, frozenset({1, 1000}), tokenize)
    assert seen == ["user\nhello<|x|><|x|>assistant\n"]  # after the prefix's last control token
    assert got == tokenize(whole, True)
    assert same == 12 and got[:same] == tokens[:same]  # the prefix's tokens through <|x|> before "user"
    assert _tokenize_whole("other" + whole, chat, tokens, frozenset({1, 1000}), tokenize) == (
        tokenize("other" + whole, True),
        0,
    )  # a rendering that does not start with the prefix is tokenized whole
