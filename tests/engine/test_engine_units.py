"""Unit tests of the engine's pure pieces: text assembly, reuse planning, errors, sampling."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modeld.backends.base import Vocab
from modeld.backends.memory import sample
from modeld.cache.reuse import Candidate, Loss, classify, common_prefix_len
from modeld.contract import DecodeConfig
from modeld.engine.chat import _common_start
from modeld.engine.prepare import byte_ends
from modeld.engine.text import TextAssembler
from modeld.errors import (
    ERRORS_BY_REASON,
    ContextOverflowError,
    InternalError,
    ModeldError,
    error_from_reason,
)
from modeld.manifest import ContextManifest
from modeld.wire.status import from_status, to_status

# --- text assembly ----------------------------------------------------------------------------


@given(st.text(max_size=60), st.lists(st.integers(min_value=1, max_value=5), max_size=30))
def test_deltas_never_split_a_character_and_add_up(text: str, cuts: list[int]) -> None:
    data = text.encode("utf-8")
    assembler = TextAssembler()
    out, pos = [], 0
    for n in cuts:
        out.append(assembler.feed(data[pos : pos + n]))
        pos += n
    out.append(assembler.feed(data[pos:]))
    out.append(assembler.flush())
    assert "".join(out) == text


@given(st.text(alphabet="ab✓é ", max_size=40), st.text(alphabet="ab✓é ", min_size=1, max_size=4))
def test_stop_string_output_is_the_text_before_its_first_occurrence(text: str, stop: str) -> None:
    assembler = TextAssembler([stop])
    out = []
    for byte in text.encode("utf-8"):
        out.append(assembler.feed(bytes([byte])))
        if assembler.stopped:
            break
    out.append(assembler.flush())
    joined = "".join(out)
    if stop in text:
        assert assembler.stopped
        assert joined == text[: text.index(stop)]
    else:
        assert joined == text


def test_invalid_utf8_becomes_a_replacement_character() -> None:
    assembler = TextAssembler()
    assert assembler.feed(b"ok \xff!") + assembler.flush() == "ok \ufffd!"


def test_a_character_cut_by_the_end_of_generation_is_dropped() -> None:
    assembler = TextAssembler()
    assert assembler.feed("ok ✓".encode()[:-1]) + assembler.flush() == "ok "


# --- reuse planning ---------------------------------------------------------------------------

M = ContextManifest(backend="memory", runtime_digest="r", add_bos=True)


@given(st.lists(st.integers(0, 3), max_size=600), st.lists(st.integers(0, 3), max_size=600))
def test_common_prefix_len_matches_the_naive_definition(a: list[int], b: list[int]) -> None:
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix_len(a, b) == naive


@given(st.text(alphabet="ab\u00e9", max_size=40), st.text(alphabet="ab\u00e9", max_size=40))
def test_the_common_start_of_two_renderings_matches_the_naive_definition(a: str, b: str) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert _common_start(a, b) == a[:n] and _common_start(a + b, a) == a


@given(st.lists(st.integers(min_value=-3, max_value=6), max_size=30))
def test_byte_ends_count_each_piece_once_and_nothing_for_a_token_outside_the_vocabulary(
    tokens: list[int],
) -> None:
    vocab = Vocab((b"", b"a", b"bc", "\u00e9".encode(), b"<|im_start|>"), frozenset(), 0)
    naive, at = [], 0
    for t in tokens:
        at += len(vocab.piece(t))
        naive.append(at)
    assert byte_ends(vocab, tokens, added_bos=False) == naive
    assert vocab.lengths == (0, 1, 2, 2, 12)


def test_keeping_the_whole_candidate_prefix_is_warm_and_less_is_partial() -> None:
    own = Candidate("kv", "c1", prefix_tokens=4)
    warm = classify(wanted=6, keep=4, candidate=own, manifest=M)
    assert (warm.outcome, warm.reason, warm.tier, warm.context) == ("warm", "extended", "kv", "c1")
    assert classify(wanted=4, keep=4, candidate=own, manifest=M).reason == "full_match"
    partial = classify(wanted=6, keep=2, candidate=own, manifest=M)
    assert (partial.outcome, partial.reason, partial.diverged_at_token) == ("partial", "diverged", 2)


def test_a_restored_snapshot_is_warm_and_names_its_tier() -> None:
    ram = Candidate("ram", "ab12cd34", prefix_tokens=100, own=False)
    decision = classify(wanted=120, keep=100, candidate=ram, manifest=M)
    assert (decision.outcome, decision.reason, decision.tier) == ("warm", "restored_from_ram", "ram")
    assert "restored from the ram tier" in decision.message
    disk = classify(wanted=100, keep=100, candidate=Candidate("disk", "x", 100, own=False), manifest=M)
    assert disk.reason == "restored_from_disk"


@pytest.mark.parametrize(
    ("loss", "changed", "blocked", "reason"),
    [
        (Loss("engine_reset", "the worker died"), None, False, "engine_reset"),
        (Loss("evicted", "its sequence was needed", "ram"), None, False, "evicted"),
        (Loss("snapshot_rejected", "checksum"), None, False, "snapshot_rejected"),
        (None, ("runtime_digest", "a", "b"), False, "manifest_changed"),
        (None, None, True, "truncation_unsupported"),
        (None, None, False, "empty_cache"),
    ],
)
def test_a_cold_turn_gives_the_most_useful_reason_first(
    loss: Loss | None, changed: tuple[str, str, str] | None, blocked: bool, reason: str
) -> None:
    decision = classify(
        wanted=10, keep=0, candidate=None, manifest=M, loss=loss, changed=changed, truncation_blocked=blocked
    )
    assert (decision.outcome, decision.reason) == ("cold", reason)
    if loss is not None and loss.kind == "evicted":
        assert decision.tier == "ram"
    if changed is not None:
        assert decision.field == "runtime_digest"


def test_a_candidate_that_shares_nothing_is_a_divergence_at_token_zero() -> None:
    decision = classify(wanted=10, keep=0, candidate=Candidate("kv", "c3", 8), manifest=M)
    assert (decision.outcome, decision.reason, decision.diverged_at_token) == ("cold", "diverged", 0)


# --- errors -----------------------------------------------------------------------------------


def test_every_reason_is_unique_and_round_trips_through_a_status() -> None:
    assert len(ERRORS_BY_REASON) == len({cls.reason for cls in ERRORS_BY_REASON.values()})
    for reason, cls in ERRORS_BY_REASON.items():
        err = cls.from_wire(f"message for {reason}", {"k": "v"})
        back = from_status(to_status(err))
        assert type(back) is cls
        assert (back.reason, back.message, back.details) == (reason, err.message, {"k": "v"})


def test_typed_details_survive_the_trip() -> None:
    err = ContextOverflowError(stage="suffix", resident=10, additional=5, window=12)
    back = from_status(to_status(err))
    assert isinstance(back, ContextOverflowError)
    assert (back.stage, back.resident, back.additional, back.window) == ("suffix", 10, 5, 12)


def test_unknown_reason_becomes_internal_not_a_guess() -> None:
    err = error_from_reason("from_the_future", "?", {})
    assert isinstance(err, InternalError)
    assert err.details["unknown_reason"] == "from_the_future"
    assert isinstance(err, ModeldError)


# --- the reference sampler ----------------------------------------------------------------------


def test_greedy_picks_the_best_and_breaks_ties_low() -> None:
    assert sample({0: 1.0, 1: 3.0, 2: 3.0}, DecodeConfig(), random.Random(0), []) == 1


def test_top_k_1_is_greedy_at_any_temperature() -> None:
    logits = {i: float(i % 7) for i in range(20)}
    picks = {sample(logits, DecodeConfig(temperature=5.0, top_k=1), random.Random(s), []) for s in range(50)}
    assert picks == {6}


def test_repeat_penalty_pushes_down_recent_candidates() -> None:
    logits = {0: 2.0, 1: 1.9}
    assert sample(logits, DecodeConfig(repeat_penalty=1.5), random.Random(0), [0]) == 1


@pytest.mark.parametrize("min_p", [0.5, 0.99])
def test_min_p_drops_unlikely_candidates(min_p: float) -> None:
    logits = {0: 10.0, 1: 0.0, 2: 0.0}
    picks = {
        sample(logits, DecodeConfig(temperature=1.0, min_p=min_p), random.Random(s), []) for s in range(50)
    }
    assert picks == {0}


# --- the token memo -----------------------------------------------------------------------------


def test_the_token_memo_keeps_long_texts_apart_by_text_and_bos_and_stays_in_its_bound() -> None:
    from modeld.engine.model import TokenMemo

    memo = TokenMemo()
    assert memo.key("short prefix", add_bos=True) is None  # not worth a digest
    long_a, long_b = "a" * TokenMemo.MIN_CHARS, "a" * (TokenMemo.MIN_CHARS - 1) + "b"
    ka, kb, ka_nobos = memo.key(long_a, True), memo.key(long_b, True), memo.key(long_a, False)
    assert ka is not None and kb is not None and ka_nobos is not None
    assert len({ka, kb, ka_nobos}) == 3
    memo.put(ka, [1, 2, 3])
    assert memo.get(ka) == [1, 2, 3] and memo.get(kb) is None and memo.get(ka_nobos) is None

    # Over the bound the least recently used entry goes first.
    memo.MAX_TOKENS = 5
    memo.put(kb, [4, 5])  # 3 + 2 tokens: at the bound
    assert memo.get(ka) == [1, 2, 3]  # ka is now the most recently used
    memo.put(ka_nobos, [6])  # 6 tokens: kb, the least recently used, is dropped
    assert memo.get(kb) is None and memo.get(ka) == [1, 2, 3] and memo.get(ka_nobos) == [6]
    memo.put(kb, list(range(6)))  # longer than the whole bound: never kept
    assert memo.get(kb) is None
    memo.clear()
    assert memo.get(ka) is None


def test_a_warm_turn_through_a_worker_tokenizes_its_long_prefix_as_the_worker_does() -> None:
    import runtime_client as rc
    from modeld.engine import Engine
    from modeld.settings import Residency

    request = rc.OpenSessionRequest(type="memory", path="memo", config=rc.Config(num_ctx=8192))
    prefix = "".join(f"src/pkg/module_{i}.py: handler_{i}()\n" for i in range(120))
    with Engine(backends=("memory",), residency=Residency(isolation="process")) as engine:
        session = engine.open_session(request)
        first = session.ensure_prefix(rc.PrefixInput(text=prefix))
        again = session.ensure_prefix(rc.PrefixInput(text=prefix))  # answered from the memo
        changed = session.ensure_prefix(rc.PrefixInput(text=prefix[:-2] + "X\n"))
    assert first.prefix_tokens == again.prefix_tokens == len(prefix.encode()) + 1  # one per byte + BOS
    assert again.reuse.reason == "full_match" and again.stable_token_hash == first.stable_token_hash
    assert changed.reuse.outcome == "partial" and changed.prefilled_tokens == 2


# --- the sampler table -------------------------------------------------------------------------


def test_every_sampler_default_is_in_range_and_the_edges_are_refused_by_name() -> None:
    from modeld.decoding.samplers import SAMPLERS, sampler
    from modeld.errors import InvalidArgumentError, LimitExceededError

    for s in SAMPLERS:
        s.check(s.default)  # off is always a valid value
    outside = {
        "temperature": 100.5,
        "top_p": 0.0,
        "top_k": -1,
        "min_p": 1.5,
        "seed": 1 << 64,
        "repeat_penalty": 0.0,
        "logit_bias": {5: 100.5},
        "presence_penalty": -2.5,
        "frequency_penalty": 2.5,
        "logprobs": 1,
        "top_logprobs": 21,
    }
    assert set(outside) == {s.name for s in SAMPLERS}
    for name, value in outside.items():
        with pytest.raises(InvalidArgumentError) as err:
            sampler(name).check(value)
        assert err.value.field.startswith(name), (name, err.value.field)
    with pytest.raises(LimitExceededError):
        sampler("logit_bias").check(dict.fromkeys(range(1025), 1.0))
    assert [s.name for s in SAMPLERS if not s.openai] == ["top_k", "min_p", "repeat_penalty"]


def test_a_divergence_that_is_only_a_re_tokenization_is_named() -> None:
    """The model wrote "_tree" as one token; sent back as text it tokenizes as "_", "t", "ree".
    The tokens differ at k, the bytes do not: the reuse explanation says so (the turn still uses
    the text's own tokens, so warm output equals a fresh evaluation)."""
    from modeld.engine.prepare import same_text

    pieces = {1: b"def ", 2: b"_tree", 3: b"_", 4: b"t", 5: b"ree", 6: b"(x)", 7: b"_leaf"}
    had = [1, 2, 6]
    assert same_text(pieces.__getitem__, had, [1, 3, 4, 5, 6], 1)
    assert same_text(pieces.__getitem__, had, [1, 3, 4], 1)  # one a prefix of the other
    assert not same_text(pieces.__getitem__, had, [1, 7, 6], 1)  # an edit
    assert not same_text(pieces.__getitem__, had, [9, 3], 1)  # not the same before k
    assert not same_text(pieces.__getitem__, had, [1, 2, 6], 3)  # nothing after k


def test_explain_context_locates_the_tool_definitions_the_template_rendered() -> None:
    """Tools are no segment of the text but often the largest part of an agent's prefix: the
    report says which tokens the template gave them, and they are exactly the tools' JSON."""
    import json

    import runtime_client as rc
    from modeld.engine import Engine

    tools = [
        {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "grep", "description": "Søk", "parameters": {}}},
    ]
    request = rc.OpenSessionRequest(
        type="memory", path="memo", config=rc.Config(num_ctx=4096, prompt_format="chat")
    )
    with Engine(backends=("memory",)) as engine:
        session = engine.open_session(request)
        text = "You review code.\n"
        session.ensure_prefix(rc.PrefixInput(text=text, tools_json=json.dumps(tools)))
        report = session.explain_context()
        plain = engine.open_session(request)
        plain.ensure_prefix(rc.PrefixInput(text=text))
        assert plain.explain_context().tools_token_start is None
    start, end = report.tools_token_start, report.tools_token_end
    assert start is not None and end is not None
    rendered = b"".join(session.model.vocab.piece(t) for t in session._tokens[start:end])
    want = json.dumps(tools[0], ensure_ascii=False) + "\n" + json.dumps(tools[1], ensure_ascii=False)
    assert rendered.decode() == want


def test_the_text_assembler_names_the_stop_string_that_ended_the_text() -> None:
    from modeld.engine.text import TextAssembler

    a = TextAssembler(["xyz", "b", "ab"])
    out = "".join(a.feed(piece) for piece in (b"hel", b"lo a", b"bc"))
    assert out == "hello " and a.stopped and a.matched == "ab"  # the earliest
    held = TextAssembler(["lo w", "lo"])  # at one place the shorter completes first
    assert held.feed(b"hello world") == "hel" and held.matched == "lo"
    plain = TextAssembler(["zz"])
    assert plain.feed(b"abc") + plain.flush() == "abc" and plain.matched == ""


def test_an_edit_inside_a_prefix_longer_than_half_a_unified_pool_is_partial_not_busy() -> None:
    """The session's own cells past the edit are cut by the turn: they are room for the rest
    (the pool used to count them twice and refuse the turn as busy)."""
    import runtime_client as rc
    from modeld.engine import Engine

    text = "".join(f"src/module_{i}.py: handler_{i}, helper_{i}\n" for i in range(160))
    edited = text.replace("module_80.py", "module_80b.py")
    request = rc.OpenSessionRequest(type="memory", path="memo", config=rc.Config(num_ctx=8192))
    with Engine(backends=("memory",)) as engine:
        session = engine.open_session(request)
        first = session.ensure_prefix(rc.PrefixInput(text=text))
        assert first.prefix_tokens > 8192 // 2
        session.prefill_suffix(rc.SuffixInput(text="question\n"))
        again = session.ensure_prefix(rc.PrefixInput(text=edited))
    assert (again.reuse.outcome, again.reuse.reason) == ("partial", "diverged")
    assert 0 < again.reused_tokens < first.prefix_tokens
