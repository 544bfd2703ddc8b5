"""A prefix prepared once is not prepared again: the model's memo of prepared prefixes, and the
suffix's token ranges counted on from the prefix's (``modeld/engine/prepare.py``).

Every agent run in one repository opens a new session with the same system prompt and tools; a
repeated request sends all of it again. Preparing a 16k-token prefix (render, tokenize, byte
ends, token ranges, hashes) cost about 6 ms of a 40-60 ms warm repeat; the memo answers it. It
must answer exactly what preparing would, never hand out what a session may change, and miss on
any input that preparing reads.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from modeld.backends.base import Vocab
from modeld.contract import Config, ModelInfo, OpenSessionRequest, Session
from modeld.engine import Engine
from modeld.engine.chat import ChatRenderer
from modeld.engine.prepare import PrefixMemo, identity_of, prepare_prefix, prepare_suffix
from modeld.server.http.turn import Message, chat_inputs, split_point
from modeld.settings import Limits
from modeld.testmodels.families import family

SYSTEM = Message("system", "You are a coding agent working in a repository. " * 16)  # ~800 tokens
TOOLS = json.dumps(
    [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
)


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine(backends=("memory",))
    yield e
    e.shutdown()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many messages each prefix actually rendered had, in order (a memo hit renders none)."""
    seen: list[int] = []
    real = ChatRenderer.render_prefix

    def spy(self: ChatRenderer, messages: list[Any], *args: Any, **kwargs: Any) -> str:
        seen.append(len(messages))
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(ChatRenderer, "render_prefix", spy)
    return seen


def chat_session(engine: Engine) -> Session:
    return engine.open_session(
        OpenSessionRequest(type="memory", path="agent", config=Config(prompt_format="chat"))
    )


def first_turn(session: Session, ask: str, tools: str = TOOLS, args: str = "") -> tuple[int, int]:
    """An agent's first request as the HTTP layer sends it: (prefix tokens, reused)."""
    messages = [SYSTEM, Message("user", ask)]
    prefix, suffix = chat_inputs(messages, split_point(messages), tools, "test", args)
    status = session.ensure_prefix(prefix)
    session.prefill_suffix(suffix)
    return status.prefix_tokens, status.reused_tokens


def test_a_new_session_with_a_prefix_seen_before_is_not_prepared_again(
    engine: Engine, counted: list[int]
) -> None:
    with chat_session(engine) as a:
        tokens, _ = first_turn(a, "What does calc.py do?")
    assert len(counted) == 1 and tokens >= PrefixMemo.MIN_TOKENS
    with chat_session(engine) as b:  # a second run of the agent, another task: the same prefix
        again, reused = first_turn(b, "Add a test for calc.py.")
    assert len(counted) == 1
    assert again == tokens and reused == tokens  # the same tokens, and served warm


def test_every_input_preparing_reads_is_part_of_the_key(engine: Engine, counted: list[int]) -> None:
    other_tools = json.dumps(
        [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
    )
    with chat_session(engine) as s:
        first_turn(s, "q")
        first_turn(s, "q", tools=other_tools)
        first_turn(s, "q", args=json.dumps({"enable_thinking": False}))
        first_turn(s, "q")  # the first again: from the memo
    assert len(counted) == 3
    # Another template is another key: a session that brings its own renders again.
    own = engine.open_session(
        OpenSessionRequest(
            type="memory",
            path="agent",
            config=Config(prompt_format="chat"),
            chat_template=family("qwen3").template,
        )
    )
    with own:
        first_turn(own, "q")
    assert len(counted) == 4


def test_what_a_session_does_with_its_prefix_never_reaches_the_memo(
    engine: Engine, counted: list[int]
) -> None:
    """A hit is what preparing gives, and hands out copies: a session that changes its token
    lists leaves the next session's prefix as preparing it gives."""
    messages = [SYSTEM, Message("user", "q")]
    prefix, _suffix = chat_inputs(messages, split_point(messages), TOOLS, "test")
    with chat_session(engine) as s:
        prep = s._prepare  # type: ignore[attr-defined]
        first = prep.prefix(prefix)
        fresh = replace(prep, memo=None).prefix(prefix)
        assert len(counted) == 2 and first == fresh
        first.tokens.append(7)
        first.ends.clear()
        second = prep.prefix(prefix)
        assert second == fresh and len(counted) == 2  # from the memo
        second.tokens.pop()
        second.ends.append(1)
        assert prep.prefix(prefix) == fresh


def test_the_memo_is_bounded_by_tokens_and_drops_the_least_recently_used() -> None:
    memo = PrefixMemo()
    size = PrefixMemo.MAX_TOKENS // 3 + 1
    memo.put("a", "A", [5] * size, [1] * size)
    memo.put("b", "B", [5] * size, [1] * size)
    assert memo.get("a") == ("A", [5] * size, [1] * size)  # a is now the most recently used
    memo.put("c", "C", [5] * size, [1] * size)  # over the bound: b goes
    assert memo.get("b") is None and memo.get("a") is not None and memo.get("c") is not None
    memo.put("small", "S", [5], [1])
    assert memo.get("small") is None  # cheaper to prepare again than to keep


# --- the suffix's token ranges, counted on from the prefix's ------------------------------------

CONTROL = "<|x|>"
TEMPLATE = (
    "{% for m in messages %}" + CONTROL + "{{ m.role }}\n{{ m.content }}" + CONTROL + "{% endfor %}"
    "{% if add_generation_prompt %}" + CONTROL + "assistant\n{% endif %}"
)


def _tokenize(text: str, add_bos: bool) -> list[int]:
    """One token per character, the control string one token (1000); BOS is 1."""
    out = [1] if add_bos else []
    for part in text.split(CONTROL):
        out += [ord(c) for c in part] + [1000]
    return out[:-1]


def _info() -> ModelInfo:
    return ModelInfo(
        backend="memory", backend_version="1", path="toy", model_digest="d", model_max_context=1 << 16,
        effective_context=1 << 16, kv_bytes_per_token=0, free_bytes=0, weights_bytes=0, vocab_size=0x2800,
        tokenizer_digest="t", template_digest="tpl", chat_template=TEMPLATE, add_bos=True, device="cpu",
    )  # fmt: skip


def test_the_suffix_token_ranges_counted_from_the_prefix_equal_a_count_over_the_whole() -> None:
    """Where the whole rendering begins with the prefix's tokens (through its last control
    token), the suffix takes their byte ends from the prefix and counts on from there: every
    segment's token range is what counting over the whole rendering gives."""
    vocab = Vocab(
        tuple(b"" if t == 1 else CONTROL.encode() if t == 1000 else chr(t).encode() for t in range(0x2800)),
        frozenset(),
        1,
    )
    config = Config(prompt_format="chat")
    info = _info()
    identity = identity_of(info, config)
    renderer = ChatRenderer(TEMPLATE)
    messages = [
        Message("system", "Be brief. " * 20),
        Message("user", "héllo, wörld"),
        Message("assistant", "Hi ✓"),
        Message("user", "Fix calc.py"),
    ]
    prefix, suffix = chat_inputs(messages, split_point(messages), "", "test")
    common = {
        "identity": identity,
        "limits": Limits(),
        "window": 1 << 16,
        "vocab": vocab,
        "renderer": lambda: renderer,
        "tokenize": _tokenize,
    }
    first = prepare_prefix(prefix, config=config, info=info, **common)  # type: ignore[arg-type]
    args = {"current": first.manifest, "chat": first.chat, "prefix_tokens": first.tokens, **common}
    counted_on = prepare_suffix(suffix, specials=frozenset({1, 1000}), **args)  # type: ignore[arg-type]
    whole = prepare_suffix(suffix, specials=frozenset(), **args)  # type: ignore[arg-type]
    assert counted_on == whole
    ranges = [(s.token_start, s.token_end) for s in whole.manifest.segments]
    assert all(a is not None and b is not None and a < b for a, b in ranges)
    assert list(itertools.chain.from_iterable(ranges)) == sorted(itertools.chain.from_iterable(ranges))
