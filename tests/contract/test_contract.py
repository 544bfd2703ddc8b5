"""The contract suite: written once, run against every implementation and over the wire.

Each test narrates one scenario a coding tool lives through and asserts exact token counts.
The ``harness`` fixture (tests/conftest.py) supplies the Service under test: the in-process
engine or the runtime client talking to a real daemon on a temporary unix socket.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from harness import Harness

from modeld.cache.reuse import common_prefix_len
from modeld.contract import DecodeConfig, PrefixInput, Session, StreamChunk, SuffixInput
from modeld.errors import (
    ContextOverflowError,
    InvalidArgumentError,
    LimitExceededError,
    ManifestMismatchError,
    ModelLoadError,
    NotOwnerError,
    PrefixRequiredError,
    SessionClosedError,
    StaleFenceError,
    UnsupportedError,
)
from modeld.manifest import ContextManifest
from runtime_client import ContextBuilder

SYSTEM = "You are a careful coding assistant. Answer with a patch.\n"
TOOLS = '{"name": "run_tests", "description": "run the test suite"}\n'
REPO_MAP = "src/app.py: main(), load_config()\nsrc/db.py: connect(), migrate()\ntests/test_app.py\n"
PINNED = "def load_config(path):\n    return json.load(open(path))\n"


def build(
    session: Session,
    *,
    repo_map: str = REPO_MAP,
    user: str = "Fix the failing test.\n",
    diff: str = "",
    system: str = SYSTEM,
) -> tuple[PrefixInput, SuffixInput]:
    b = (
        ContextBuilder(identity=session.identity)
        .system(system)
        .tools(TOOLS)
        .repo_map(repo_map)
        .pinned(PINNED)
    )
    if diff:
        b.diff(diff)
    ctx = b.user_turn(user).build()
    return ctx.prefix_input(), ctx.suffix_input()


def decode_all(session: Session, **kw: object) -> list[StreamChunk]:
    with session.decode(DecodeConfig(**kw)) as stream:  # type: ignore[arg-type]
        return list(stream)


def text_of(chunks: list[StreamChunk]) -> str:
    return "".join(c.text for c in chunks)


def ids_of(chunks: list[StreamChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# --- describe and open ----------------------------------------------------------------------


def test_describe_reports_the_model_and_its_window(harness: Harness) -> None:
    info = harness.service.describe(harness.request(num_ctx=2048))
    assert info.backend == harness.backend
    assert info.effective_context == min(2048, info.model_max_context)
    assert info.kv_bytes_per_token > 0
    assert info.free_bytes > 0
    assert len(info.model_digest) == 32
    assert len(info.tokenizer_digest) == 32


def test_open_session_exposes_identity_for_manifests(harness: Harness) -> None:
    with harness.open() as s:
        assert s.identity.backend == harness.backend
        assert s.identity.model_digest == s.info.model_digest
        assert s.identity.add_bos is s.info.add_bos
        assert len(s.identity.runtime_digest) == 32


def test_missing_model_file_is_a_clear_load_error(harness: Harness) -> None:
    missing = str(harness.tmp / "no-such-model.gguf")
    with pytest.raises(ModelLoadError) as err:
        harness.service.open_session(harness.request(path=missing))
    assert err.value.path == missing
    assert "no-such-model" in str(err.value)


def test_digest_that_does_not_match_the_model_is_refused(harness: Harness) -> None:
    with pytest.raises(ModelLoadError):
        harness.service.open_session(harness.request(digest="0" * 32))


# --- warm reuse -----------------------------------------------------------------------------


def test_second_identical_prefix_is_warm_and_reuses_every_token(harness: Harness) -> None:
    with harness.open() as s:
        prefix, _ = build(s)
        first = s.ensure_prefix(prefix)
        assert first.reuse.outcome == "cold"
        assert first.reuse.reason == "empty_cache"
        assert first.reused_tokens == 0
        assert first.prefilled_tokens == first.prefix_tokens == len(harness.tokenize(prefix.text))

        second = s.ensure_prefix(prefix)
        assert second.reuse.outcome == "warm"
        assert second.reuse.reason == "full_match"
        assert second.reused_tokens == second.prefix_tokens == first.prefix_tokens
        assert second.prefilled_tokens == 0
        assert second.dropped_tokens == 0
        assert second.stable_token_hash == first.stable_token_hash
        assert second.manifest_digest == first.manifest_digest


def test_accounting_is_exact_after_suffix_and_decode(harness: Harness) -> None:
    with harness.open() as s:
        prefix, suffix = build(s)
        p = s.ensure_prefix(prefix)
        sfx = s.prefill_suffix(suffix)
        assert sfx.suffix_tokens == len(harness.tokenize(suffix.text, add_bos=False))
        assert sfx.resident_tokens == p.prefix_tokens + sfx.suffix_tokens
        assert sfx.available_tokens == p.available_tokens - sfx.suffix_tokens
        chunks = decode_all(s, max_tokens=8)
        before = s.explain_context()
        assert before.resident_tokens == sfx.resident_tokens + chunks[-1].usage.completion_tokens  # type: ignore[union-attr]

        again = s.ensure_prefix(prefix)
        assert again.reused_tokens == p.prefix_tokens
        assert again.reused_tokens + again.prefilled_tokens == again.prefix_tokens
        assert again.dropped_tokens == before.kv_tokens - again.reused_tokens
        assert again.resident_tokens == again.prefix_tokens
        assert again.available_tokens == s.info.effective_context - again.prefix_tokens
        after = s.explain_context()
        assert (after.suffix_tokens, after.generated_tokens) == (0, 0)


def test_growing_history_extends_the_warm_prefix(harness: Harness) -> None:
    with harness.open() as s:
        base = PrefixInput(text=SYSTEM + REPO_MAP)
        s.ensure_prefix(base)
        grown = PrefixInput(text=SYSTEM + REPO_MAP + "user: hi\nassistant: hello\n")
        st = s.ensure_prefix(grown)
        expected = common_prefix_len(harness.tokenize(base.text), harness.tokenize(grown.text))
        assert st.reused_tokens == expected
        assert st.reuse.outcome == "warm"
        assert st.reuse.reason == "extended"
        assert st.prefilled_tokens == st.prefix_tokens - expected


def test_edit_in_the_middle_reuses_up_to_the_divergence_and_names_the_segment(harness: Harness) -> None:
    with harness.open() as s:
        prefix, _ = build(s)
        assert s.ensure_prefix(prefix).diverged_segment_index is None  # nothing to diverge from
        edited, _ = build(s, repo_map=REPO_MAP.replace("migrate()", "migrate(), rollback()"))
        st = s.ensure_prefix(edited)
        manifest = s.explain_context().manifest
        assert manifest is not None and st.diverged_segment_index is not None
        assert st.diverged_segment_index > 0  # the status names the segment: no explain-context needed
        assert manifest.segments[st.diverged_segment_index].label == "repo_map"
        assert st.diverged_part == ""  # a text prefix has no chat parts
        k = common_prefix_len(harness.tokenize(prefix.text), harness.tokenize(edited.text))
        assert 0 < k < st.prefix_tokens
        assert st.reused_tokens == k
        assert st.prefilled_tokens == st.prefix_tokens - k
        assert st.reuse.outcome == "partial"
        assert st.reuse.reason == "diverged"
        assert st.reuse.diverged_at_token == k
        assert st.reuse.diverged_segment == "repo_map"
        assert st.reuse.diverged_at_byte is not None
        assert (
            prefix.text.encode()[: st.reuse.diverged_at_byte]
            == edited.text.encode()[: st.reuse.diverged_at_byte]
        )


def test_edit_at_the_very_start_reuses_at_most_the_bos_token(harness: Harness) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text="alpha " + REPO_MAP))
        st = s.ensure_prefix(PrefixInput(text="omega " + REPO_MAP))
        assert st.reused_tokens == (1 if s.identity.add_bos else 0)
        assert st.reuse.reason == "diverged"


def test_suffix_replacement_keeps_the_prefix_and_changes_the_answer(harness: Harness) -> None:
    with harness.open() as s:
        prefix, suffix_a = build(s, user="Explain load_config.\n")
        _, suffix_b = build(s, user="Rename migrate to upgrade.\n")
        s.ensure_prefix(prefix)
        s.prefill_suffix(suffix_a)
        a = ids_of(decode_all(s, max_tokens=12))
        st = s.prefill_suffix(suffix_b)
        assert st.resident_tokens == st.prefix_tokens + st.suffix_tokens
        report = s.explain_context()
        assert report.suffix_tokens == st.suffix_tokens
        assert report.generated_tokens == 0
        b = ids_of(decode_all(s, max_tokens=12))
        with harness.open() as fresh:
            fresh.ensure_prefix(prefix)
            fresh.prefill_suffix(suffix_b)
            assert ids_of(decode_all(fresh, max_tokens=12)) == b
        assert a != b


def test_warm_greedy_decode_equals_cold(harness: Harness) -> None:
    """Greedy tokens after a warm ensure_prefix equal those of a cold evaluation."""
    with harness.open() as s:
        prefix, suffix = build(s)
        s.ensure_prefix(PrefixInput(text=SYSTEM + "unrelated words " * 20))
        s.ensure_prefix(prefix)
        s.prefill_suffix(suffix)
        cold = ids_of(decode_all(s, max_tokens=16))
        warm_status = s.ensure_prefix(prefix)
        assert warm_status.reuse.outcome == "warm"
        s.prefill_suffix(suffix)
        warm = ids_of(decode_all(s, max_tokens=16))
        assert warm == cold
        assert len(cold) > 0


def test_closed_session_leaves_its_kv_warm_for_the_next_session(harness: Harness) -> None:
    with harness.open() as first:
        prefix, _ = build(first)
        cold = first.ensure_prefix(prefix)
    with harness.open() as second:
        prefix2, _ = build(second)
        warm = second.ensure_prefix(prefix2)
        assert warm.reuse.outcome == "warm"
        assert warm.reused_tokens == cold.prefix_tokens


def test_two_sessions_take_turns_without_mixing_their_tokens(harness: Harness) -> None:
    """Two workspaces on one model each keep their own warm context: neither displaces the
    other, the second shares exactly the common head of the first, and both stay warm."""
    solo_prefix, solo_suffix = PrefixInput(text=SYSTEM + REPO_MAP), SuffixInput(text="task A\n")
    other = PrefixInput(text=SYSTEM + "a different repo\n")
    with harness.open() as solo:
        solo.ensure_prefix(solo_prefix)
        solo.prefill_suffix(solo_suffix)
        expected = ids_of(decode_all(solo, max_tokens=10))
    with harness.open() as a, harness.open() as b:
        a.ensure_prefix(solo_prefix)
        b_status = b.ensure_prefix(other)
        k = common_prefix_len(harness.tokenize(solo_prefix.text), harness.tokenize(other.text))
        assert b_status.reused_tokens == k  # exactly what it shares with A's warm context
        st = a.prefill_suffix(solo_suffix)  # A's prefix is still in its own sequence
        assert st.restored_tokens == 0
        assert ids_of(decode_all(a, max_tokens=10)) == expected
        b_again = b.ensure_prefix(other)
        assert b_again.reuse.outcome == "warm"
        assert b_again.reused_tokens == b_again.prefix_tokens
        a_again = a.ensure_prefix(solo_prefix)
        assert a_again.reuse.outcome == "warm"
        assert a_again.reused_tokens == a_again.prefix_tokens


# --- manifests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_ctx": 2048}, "runtime_digest"),
        ({"num_batch": 128}, "runtime_digest"),  # neither backend's default (64 llama, 512 memory)
        ({"kv_cache_type": "f32"}, "runtime_digest"),
        ({"disable_bos": True}, "add_bos"),
        ({"prompt_template_digest": "f" * 32}, "prompt_template_digest"),
        ({"prompt_format": "chat"}, "prompt_format"),
    ],
)
def test_runtime_change_is_a_cold_miss_naming_the_field(
    harness: Harness, change: dict[str, object], field: str
) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text=SYSTEM + REPO_MAP))
    with harness.open(**change) as s2:
        st = s2.ensure_prefix(PrefixInput(text=SYSTEM + REPO_MAP))
        assert st.reuse.outcome == "cold"
        assert st.reuse.reason == "manifest_changed"
        assert st.reuse.field == field
        assert st.reused_tokens == 0
        assert st.prefilled_tokens == st.prefix_tokens


def test_replaced_model_file_is_a_cold_miss_on_model_digest(harness: Harness) -> None:
    assert harness.model.make_variant is not None
    path = harness.tmp / "model.bin"
    harness.model.make_variant(path, 1)
    with harness.service.open_session(harness.request(path=str(path))) as s:
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        old_digest = s.info.model_digest
    harness.model.make_variant(path, 2)
    with harness.service.open_session(harness.request(path=str(path))) as s2:
        assert s2.info.model_digest != old_digest
        st = s2.ensure_prefix(PrefixInput(text=SYSTEM))
        assert st.reuse.reason == "model_changed"  # the file holds another model now
        assert st.reuse.field == "model_digest"
        assert st.reused_tokens == 0


def test_equal_text_under_a_contradicting_manifest_is_refused(harness: Harness) -> None:
    with harness.open() as s:
        prefix, _ = build(s)
        assert prefix.manifest is not None
        bogus = replace(prefix.manifest, tokenizer_digest="0" * 32)
        with pytest.raises(ManifestMismatchError) as err:
            s.ensure_prefix(replace(prefix, manifest=bogus))
        assert err.value.field == "tokenizer_digest"


def test_manifest_that_does_not_describe_the_text_is_refused(harness: Harness) -> None:
    with harness.open() as s:
        prefix, _ = build(s)
        assert prefix.manifest is not None
        with pytest.raises(ManifestMismatchError) as err:
            s.ensure_prefix(replace(prefix, text=prefix.text.replace("careful", "CAREFUL")))
        assert err.value.field == "stable_byte_hash"
        segs = list(prefix.manifest.segments)
        segs[1] = replace(segs[1], hash="0" * 32)
        with pytest.raises(ManifestMismatchError) as err:
            s.ensure_prefix(replace(prefix, manifest=prefix.manifest.with_segments(segs)))
        assert err.value.field == "segments[1].hash"


def test_suffix_built_for_another_prefix_is_refused(harness: Harness) -> None:
    with harness.open() as s:
        prefix, _ = build(s)
        _, other_suffix = build(s, system="Another system prompt.\n")
        s.ensure_prefix(prefix)
        with pytest.raises(ManifestMismatchError) as err:
            s.prefill_suffix(other_suffix)
        assert err.value.field == "stable_byte_hash"


def test_token_ranges_of_segments_tile_the_context(harness: Harness) -> None:
    with harness.open() as s:
        prefix, suffix = build(s, diff="--- a/src/db.py\n+++ b/src/db.py\n")
        p = s.ensure_prefix(prefix)
        sx = s.prefill_suffix(suffix)
        manifest = s.explain_context().manifest
        assert manifest is not None
        kinds = [seg.kind for seg in manifest.segments]
        assert kinds == ["system", "tools", "repo_map", "pinned", "diff", "user_turn"]
        start = 1 if s.identity.add_bos else 0
        for seg in manifest.segments:
            assert seg.token_start == start
            assert seg.token_end is not None and seg.token_end >= seg.token_start
            start = seg.token_end
        assert start == p.prefix_tokens + sx.suffix_tokens
        assert manifest.stable_token_hash and manifest.volatile_token_hash


# --- limits and errors ----------------------------------------------------------------------


def test_prefix_larger_than_the_window_overflows_and_changes_nothing(harness: Harness) -> None:
    with harness.open(num_ctx=256) as s:
        ok = s.ensure_prefix(PrefixInput(text=SYSTEM))
        before = s.explain_context()
        big = "x " * 400
        with pytest.raises(ContextOverflowError) as err:
            s.ensure_prefix(PrefixInput(text=big))
        e = err.value
        assert (e.stage, e.window) == ("prefix", 256)
        assert e.additional == len(harness.tokenize(big))
        after = s.explain_context()
        assert (after.resident_tokens, after.kv_tokens, after.stable_token_hash) == (
            before.resident_tokens,
            before.kv_tokens,
            before.stable_token_hash,
        )
        again = s.ensure_prefix(PrefixInput(text=SYSTEM))
        assert again.reused_tokens == ok.prefix_tokens


def test_suffix_that_does_not_fit_overflows_and_keeps_the_prefix(harness: Harness) -> None:
    with harness.open(num_ctx=256) as s:
        p = s.ensure_prefix(PrefixInput(text=SYSTEM))
        big = "y " * 200
        with pytest.raises(ContextOverflowError) as err:
            s.prefill_suffix(SuffixInput(text=big))
        e = err.value
        assert (e.stage, e.resident, e.window) == ("suffix", p.prefix_tokens, 256)
        assert e.additional == len(harness.tokenize(big, add_bos=False))
        st = s.prefill_suffix(SuffixInput(text="small\n"))
        assert st.prefix_tokens == p.prefix_tokens
        assert st.restored_tokens == 0


def test_decode_stops_at_the_window_with_length(harness: Harness) -> None:
    with harness.open(num_ctx=64) as s:
        words = SYSTEM.split()
        text = ""
        while len(harness.tokenize(text + words[0] + " ")) <= 56:  # leave a few tokens of room
            text += words[0] + " "
            words = words[1:] + words[:1]
        p = s.ensure_prefix(PrefixInput(text=text))
        room = 64 - p.prefix_tokens
        assert 0 < room < 16
        chunks = decode_all(s, max_tokens=64)
        last = chunks[-1]
        assert last.finish_reason == "length"
        assert last.usage is not None
        assert last.usage.completion_tokens == room
        assert s.explain_context().available_tokens == 0


def test_operations_need_a_prefix_first(harness: Harness) -> None:
    with harness.open() as s:
        with pytest.raises(PrefixRequiredError):
            s.prefill_suffix(SuffixInput(text="x"))
        with pytest.raises(PrefixRequiredError):
            s.decode(DecodeConfig(max_tokens=4))


def test_closed_session_refuses_work_but_still_explains(harness: Harness) -> None:
    s = harness.open()
    s.ensure_prefix(PrefixInput(text=SYSTEM))
    s.close()
    s.close()  # idempotent
    for op in (
        lambda: s.ensure_prefix(PrefixInput(text=SYSTEM)),
        lambda: s.prefill_suffix(SuffixInput(text="x")),
        lambda: s.decode(DecodeConfig()),
    ):
        with pytest.raises(SessionClosedError):
            op()
    assert s.explain_context().closed is True


def test_fence_naming_another_owner_is_stale_at_open(harness: Harness) -> None:
    with pytest.raises(StaleFenceError):
        harness.service.open_session(harness.request(fence="someone-else"))
    own = harness.engine.owner.instance_id
    with harness.service.open_session(harness.request(fence=own)) as s:
        assert s.ensure_prefix(PrefixInput(text=SYSTEM)).prefix_tokens > 0


def test_takeover_fails_old_sessions_with_stale_fence(harness: Harness) -> None:
    s = harness.open()
    s.ensure_prefix(PrefixInput(text=SYSTEM))
    harness.engine.owner.revoke("instance new took over")
    time.sleep(0.4)  # a stream notices within its poll interval
    with pytest.raises(StaleFenceError):
        s.ensure_prefix(PrefixInput(text=SYSTEM))
    with pytest.raises(StaleFenceError):
        s.decode(DecodeConfig())
    with pytest.raises(NotOwnerError):
        harness.open()


def test_too_much_text_is_refused_and_the_session_survives(harness: Harness) -> None:
    limit = harness.engine.limits.max_text_bytes
    with harness.open() as s:
        with pytest.raises(LimitExceededError) as err:
            s.ensure_prefix(PrefixInput(text="z" * (limit + 1)))
        assert err.value.limit == "max_text_bytes"
        assert s.ensure_prefix(PrefixInput(text=SYSTEM)).prefix_tokens > 0


def test_too_many_sessions_is_refused_and_the_service_keeps_serving(harness: Harness) -> None:
    limit = harness.engine.limits.max_sessions
    sessions = [harness.open() for _ in range(limit)]
    try:
        with pytest.raises(LimitExceededError) as err:
            harness.open()
        assert err.value.limit == "max_sessions"
    finally:
        for s in sessions:
            s.close()
    with harness.open() as s:
        assert s.ensure_prefix(PrefixInput(text=SYSTEM)).prefix_tokens > 0


def test_wrong_types_are_invalid_arguments(harness: Harness) -> None:
    with harness.open() as s:
        with pytest.raises(InvalidArgumentError):
            s.ensure_prefix(PrefixInput(text=123))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            s.ensure_prefix("just a string")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            s.ensure_prefix(PrefixInput(text="bad \udc80 surrogate"))
        assert s.ensure_prefix(PrefixInput(text=SYSTEM)).prefix_tokens > 0
    with pytest.raises(InvalidArgumentError):
        harness.service.open_session(harness.request(num_ctx=-1))  # 0 is the model's own window
    with pytest.raises(InvalidArgumentError):
        harness.service.open_session(harness.request(kv_cache_type="f64"))


# --- decode ---------------------------------------------------------------------------------


def test_decode_streams_deltas_and_ends_with_usage(harness: Harness) -> None:
    with harness.open() as s:
        prefix, suffix = build(s)
        p = s.ensure_prefix(prefix)
        sx = s.prefill_suffix(suffix)
        chunks = decode_all(s, max_tokens=12)
        final = chunks[-1]
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert final.finish_reason in ("length", "stop")
        assert final.usage is not None
        assert final.usage.prompt_tokens == sx.resident_tokens
        assert final.usage.cached_tokens == p.reused_tokens
        ids = ids_of(chunks)
        assert final.usage.completion_tokens == len(ids) <= 12
        text, raw = text_of(chunks).encode(), harness.detokenize(ids)
        assert raw[: len(text)] == text  # whole characters; a character cut by max_tokens is dropped
        assert len(raw) - len(text) < 4


def test_decode_continues_and_generated_tokens_stay_resident(harness: Harness) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        first = decode_all(s, max_tokens=5)
        second = decode_all(s, max_tokens=5)
        assert second[-1].usage is not None
        assert second[-1].usage.prompt_tokens == first[-1].usage.prompt_tokens + len(ids_of(first))  # type: ignore[union-attr]


def test_stop_string_cuts_the_text_before_it(harness: Harness) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        full = text_of(decode_all(s, max_tokens=40))
        assert len(full) > 6
        stop = full[3:6]
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        cut = decode_all(s, max_tokens=40, stop=(stop,))
        assert cut[-1].finish_reason == "stop_sequence"
        assert text_of(cut) == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible(harness: Harness) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        a = ids_of(decode_all(s, max_tokens=12, temperature=0.9, top_k=8, top_p=0.9, seed=7))
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        b = ids_of(decode_all(s, max_tokens=12, temperature=0.9, top_k=8, top_p=0.9, seed=7))
        assert a == b


def test_cancel_stops_the_decode_within_a_step(harness: Harness) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        stream = s.decode(DecodeConfig(max_tokens=2000, extra=harness.model.slow_extra))
        first = next(stream)
        assert first.finish_reason is None
        stream.cancel()
        rest = list(stream)
        assert rest[-1].finish_reason == "canceled"
        assert rest[-1].usage is not None
        assert rest[-1].usage.completion_tokens < 200
        assert s.ensure_prefix(PrefixInput(text=SYSTEM)).reuse.outcome == "warm"


def test_leaving_a_decode_early_frees_the_model_for_others(harness: Harness) -> None:
    with harness.open() as s, harness.open() as other:
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        with s.decode(DecodeConfig(max_tokens=2000, extra=harness.model.slow_extra)) as stream:
            next(stream)
        started = time.monotonic()
        other.ensure_prefix(PrefixInput(text=REPO_MAP))
        assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(
    ("config", "error"),
    [
        (DecodeConfig(max_tokens=0), InvalidArgumentError),
        (DecodeConfig(temperature=-1.0), InvalidArgumentError),
        (DecodeConfig(top_p=0.0), InvalidArgumentError),
        (DecodeConfig(min_p=1.5), InvalidArgumentError),
        (DecodeConfig(stop=("",)), InvalidArgumentError),
        (DecodeConfig(stop=tuple(str(i) for i in range(17))), LimitExceededError),
        (DecodeConfig(extra={"no_such_knob": "1"}), UnsupportedError),
    ],
)
def test_bad_decode_config_is_refused_before_anything_runs(
    harness: Harness, config: DecodeConfig, error: type[Exception]
) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text=SYSTEM))
        with pytest.raises(error):
            s.decode(config)
        assert decode_all(s, max_tokens=2)[-1].finish_reason in ("length", "stop")


def test_explain_context_reports_the_last_reuse_decision(harness: Harness) -> None:
    with harness.open() as s:
        prefix, _ = build(s)
        s.ensure_prefix(prefix)
        s.ensure_prefix(prefix)
        report = s.explain_context()
        assert report.last_reuse is not None
        assert report.last_reuse.outcome == "warm"
        assert report.manifest is not None
        assert report.manifest_digest == report.manifest.digest()
        assert report.num_ctx == s.info.effective_context
        assert isinstance(report.manifest, ContextManifest)


# --- chat format ----------------------------------------------------------------------------

TOOLS_JSON = '[{"type": "function", "function": {"name": "run_tests", "parameters": {}}}]'


def chat_context(session: Session, question: str, *, answer: str = "") -> tuple[PrefixInput, SuffixInput]:
    b = ContextBuilder(identity=session.identity, tools_json=TOOLS_JSON)
    b.system(SYSTEM).repo_map(REPO_MAP).history("What does db.py do?\n", role="user")
    b.history("It connects and migrates.\n" + answer, role="assistant")
    ctx = b.user_turn(question).build()
    return ctx.prefix_input(), ctx.suffix_input()


def test_chat_format_renders_the_model_template_and_stays_warm(harness: Harness) -> None:
    with harness.open(prompt_format="chat") as s:
        assert s.identity.prompt_format == "chat"
        assert s.identity.prompt_template_digest == s.info.template_digest != ""
        prefix, suffix = chat_context(s, "Add a rollback.\n")
        cold = s.ensure_prefix(prefix)
        warm = s.ensure_prefix(prefix)
        assert (cold.reuse.outcome, warm.reuse.outcome) == ("cold", "warm")
        assert warm.reused_tokens == cold.prefix_tokens
        # The template adds its markers: more tokens than the raw text would make.
        assert cold.prefix_tokens > len(harness.tokenize(prefix.text))
        sx = s.prefill_suffix(suffix)
        assert sx.suffix_tokens > len(harness.tokenize(suffix.text, add_bos=False))
        chunks = decode_all(s, max_tokens=8)
        assert chunks[-1].finish_reason in ("length", "stop")
        manifest = s.explain_context().manifest
        assert manifest is not None
        located = [seg for seg in manifest.segments if seg.token_start is not None]
        assert [seg.kind for seg in located] == ["system", "repo_map", "history", "history", "user_turn"]
        starts = [seg.token_start for seg in located]
        assert starts == sorted(starts)


def test_chat_history_that_grows_keeps_the_earlier_turns_warm(harness: Harness) -> None:
    with harness.open(prompt_format="chat") as s:
        first, _ = chat_context(s, "Q1\n")
        a = s.ensure_prefix(first)
        grown, _ = chat_context(s, "Q2\n", answer="Also: rollback() exists.\n")
        b = s.ensure_prefix(grown)
        assert 0 < b.reused_tokens < a.prefix_tokens
        assert b.reuse.diverged_segment == "history"
        # The status places the divergence in the chat prompt and names the warm context (what
        # the HTTP diagnosis reads, with no explain-context round trip): the same as the report.
        report = s.explain_context()
        assert (a.diverged_part, b.diverged_part) == ("", "messages")
        assert b.context_id == a.context_id == report.context_id != ""


def test_chat_tools_must_be_a_json_array(harness: Harness) -> None:
    with harness.open(prompt_format="chat") as s:
        with pytest.raises(InvalidArgumentError) as err:
            s.ensure_prefix(PrefixInput(text=SYSTEM, tools_json='{"not": "a list"}'))
        assert err.value.field == "tools_json"
    with harness.open() as raw:
        with pytest.raises(InvalidArgumentError) as err:
            raw.ensure_prefix(PrefixInput(text=SYSTEM, tools_json=TOOLS_JSON))
        assert err.value.field == "tools_json"
