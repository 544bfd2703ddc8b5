"""Memory that cannot be cut at any token stays warm: the generated sliding-window, hybrid and
recurrent models (``modeld.testmodels.ARCH_SPECS``) on the real llama.cpp.

Each scenario runs on every class: gemma3 and gpt-oss (sliding window), lfm2 (short
convolutions), qwen35 (gated DeltaNet), granitehybrid (Mamba-2 beside attention), mamba2 (pure
recurrent). What they check, as the issue states it: warm equals fresh (greedy tokens and their
log-probabilities, bit for bit), an edit inside the prefix reuses what precedes it (back to the
last checkpoint at or before it), and a repeated prompt answers, the same as the first time.
Design record: ``blueprints/0016-warm-state.md``, "Checkpoints".
"""

from __future__ import annotations

import pytest

from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.settings import Residency

pytestmark = pytest.mark.llama

llama = pytest.importorskip("modeld.backends.llama")
testmodels = pytest.importorskip("modeld.testmodels")

SPECS = {spec.name: spec for spec in testmodels.ARCH_SPECS}

BASE = "".join(
    f"def handler_{i}(request):\n    value = compute({i}, request.body)\n    return respond(value)\n\n"
    for i in range(24)
)
"""About 700 tokens of code-like text (raw prompts: no turn starts, checkpoints by spacing)."""

BATCH = 16
"""Micro-batch of these tests: checkpoints every 64 tokens (4 batches)."""


def _request(path: str) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=path, config=Config(num_ctx=2048, num_batch=BATCH, num_threads=2)
    )


def _decode(session: object, n: int = 8) -> list[tuple[int, float]]:
    """Greedy tokens with their log-probabilities."""
    out: list[tuple[int, float]] = []
    with session.decode(DecodeConfig(max_tokens=n, logprobs=True)) as stream:  # type: ignore[attr-defined]
        for chunk in stream:
            for token, lp in zip(chunk.token_ids, chunk.logprobs, strict=True):
                out.append((token, lp.logprob))
    return out


def _fresh(path: str, prefix: str, suffix: str) -> list[tuple[int, float]]:
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(path))
        assert s.ensure_prefix(PrefixInput(text=prefix)).reuse.outcome == "cold"
        s.prefill_suffix(SuffixInput(text=suffix))
        return _decode(s)


@pytest.fixture(params=sorted(SPECS), scope="module")
def model(request: pytest.FixtureRequest) -> str:
    return str(testmodels.ensure_model(SPECS[request.param]))


def test_the_engine_classifies_and_describes_each_class(model: str) -> None:
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        info = engine.describe(_request(model))
        assert info.capabilities.truncation is False
        s = engine.open_session(_request(model))
        layout = s.model.layout  # type: ignore[attr-defined]
        assert layout.can_truncate is False and layout.checkpoints is True


def test_an_edit_inside_the_prefix_reuses_what_precedes_it_and_warm_equals_fresh(model: str) -> None:
    """Edit at ~60% of the prefix: the turn keeps the last checkpoint before the edit (at most
    4 batches back), names it, and its greedy tokens and log-probabilities are a fresh
    evaluation's."""
    edited = BASE.replace("handler_15(", "handler_15b(")
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(model))
        first = s.ensure_prefix(PrefixInput(text=BASE))
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        _decode(s)
        st = s.ensure_prefix(PrefixInput(text=edited))
        diverged = st.reuse.diverged_at_token
        assert diverged is not None and diverged > first.prefix_tokens // 2
        assert st.reuse.outcome == "partial", st.reuse
        assert diverged - 4 * BATCH <= st.reused_tokens <= diverged, st.reuse.message
        if st.reused_tokens < diverged:
            assert f"checkpoint at token {st.reused_tokens}" in st.reuse.message
        assert st.reused_tokens + st.prefilled_tokens == st.prefix_tokens
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        warm = _decode(s)
    assert warm == _fresh(model, edited, "fix it\n")


def test_a_repeated_prompt_answers_the_same_as_the_first_time(model: str) -> None:
    """The same prefix and suffix three times (a retry, a regeneration): every time an answer,
    and the same one."""
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(model))
        answers = []
        for _ in range(3):
            s.ensure_prefix(PrefixInput(text=BASE))
            s.prefill_suffix(SuffixInput(text="again\n"))
            answers.append(_decode(s))
        # The prefix alone, decoded twice (a completion sent twice): no suffix to evaluate.
        again = []
        for _ in range(2):
            s.ensure_prefix(PrefixInput(text=BASE + "again\n"))
            again.append(_decode(s))
    assert answers[0] == answers[1] == answers[2]
    assert again[0] == again[1]


def test_two_sessions_share_a_prefix_through_a_copy(model: str) -> None:
    """A second conversation with the same head copies the first's context and goes back to a
    checkpoint inside it: its output is a fresh evaluation's."""
    other = BASE[: len(BASE) // 2] + "class Other:\n    pass\n"
    with Engine(backends=("llama",), residency=Residency(sequences=2, kv_unified=False)) as engine:
        a = engine.open_session(_request(model))
        a.ensure_prefix(PrefixInput(text=BASE))
        b = engine.open_session(_request(model))
        st = b.ensure_prefix(PrefixInput(text=other))
        assert st.reused_tokens > 0, st.reuse
        b.prefill_suffix(SuffixInput(text="go\n"))
        warm = _decode(b)
    assert warm == _fresh(model, other, "go\n")
