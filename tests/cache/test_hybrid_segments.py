"""Memory that cannot be cut at any token goes back no further than the segment an edit is in:
the manifest's segment starts are batch starts and checkpoints (blueprint 0016, "Checkpoints").

On the generated model of every class (``modeld.testmodels.ARCH_SPECS``: gemma3 and gpt-oss
sliding windows, lfm2, qwen35, granitehybrid, mamba2) on the real llama.cpp, a prompt built of
segments (a system prompt, a repo map, a pinned file, the user's turn) whose pinned file
changes: the edit turn reuses every token before the edit, in the pool, after a restart (the disk
tier) and on another daemon sharing only the store (a moved conversation), and its greedy tokens
and log-probabilities are a fresh evaluation's, bit for bit. The segment boundaries sit off the
batch grid, so before segment starts were batch starts these turns went back to the last
multiple of the micro-batch (or, for a sliding window restored from a snapshot, to nothing).
"""

from __future__ import annotations

import pytest
from greedy import greedy_logprobs

import runtime_client as rc
from modeld.contract import Config, OpenSessionRequest
from modeld.engine import Engine
from modeld.settings import Residency

pytestmark = pytest.mark.llama

llama = pytest.importorskip("modeld.backends.llama")
testmodels = pytest.importorskip("modeld.testmodels")

SPECS = {spec.name: spec for spec in testmodels.ARCH_SPECS}

BATCH = 64
"""Micro-batch of these tests (checkpoints every 64 tokens besides the segment starts)."""

SYSTEM = "You are a careful coding agent working in this repository. Keep edits small.\n" * 3
REPO_MAP = "".join(
    f"src/module_{i:02d}.py: def handler_{i}(request), class Model{i}(Base)\n" for i in range(14)
)


def _pinned(version: int) -> str:
    return f"{('alpha', 'beta', 'gamma')[version]}.py, pinned:\n" + "".join(
        f"def step_{i}(state):\n    return state + {i}\n" for i in range(12)
    )


def _context(version: int) -> rc.BuiltContext:
    return (
        rc.ContextBuilder()
        .system(SYSTEM)
        .repo_map(REPO_MAP)
        .pinned(_pinned(version))
        .user_turn("Fix the failing test.\n")
        .build()
    )


def _request(path: str) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=path, config=Config(num_ctx=2048, num_batch=BATCH, num_threads=2)
    )


def _decode(session: object, n: int = 6) -> list[tuple[int, float]]:
    return greedy_logprobs(session, n)


def _turn(session: object, ctx: rc.BuiltContext) -> tuple[object, list[tuple[int, float]]]:
    st = session.ensure_prefix(ctx.prefix_input())  # type: ignore[attr-defined]
    session.prefill_suffix(ctx.suffix_input())  # type: ignore[attr-defined]
    return st, _decode(session)


def _fresh(path: str, ctx: rc.BuiltContext) -> list[tuple[int, float]]:
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(path))
        st, out = _turn(s, ctx)
        assert st.reuse.outcome == "cold"  # type: ignore[attr-defined]
        return out


def _check_edit(st: object, tier: str) -> None:
    """The edit turn reused every token before the edit, which is where the pinned file starts
    (and off the batch grid: a fallback to the grid would show)."""
    reuse = st.reuse  # type: ignore[attr-defined]
    diverged = reuse.diverged_at_token
    assert diverged is not None and diverged % BATCH != 0, reuse
    assert reuse.diverged_segment == "pinned", reuse
    assert (reuse.outcome, reuse.tier) == ("partial", tier), reuse
    assert st.reused_tokens == diverged, reuse.message  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_an_edit_of_a_segment_reuses_everything_before_it_and_warm_equals_fresh(name: str) -> None:
    path = str(testmodels.ensure_model(SPECS[name]))
    expected = _fresh(path, _context(1))
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(path))
        first, _ = _turn(s, _context(0))
        assert first.reuse.outcome == "cold"
        st, warm = _turn(s, _context(1))
        _check_edit(st, "kv")
        assert st.reused_tokens + st.prefilled_tokens == st.prefix_tokens
    assert warm == expected


@pytest.mark.parametrize("name", sorted(SPECS))
def test_an_edit_of_a_segment_after_a_restart_and_on_another_box(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The prefix written to disk and through to the shared store carries the checkpoints at its
    segment starts (a sliding window's too: its snapshot holds only the last window): after a
    restart, and on a second daemon sharing only the store, the edit goes back to the pinned
    file's start, and the answer is a fresh evaluation's."""
    path = str(testmodels.ensure_model(SPECS[name]))
    tmp = tmp_path_factory.mktemp("segments")
    store = tmp / "store"

    def engine(data: str) -> Engine:
        residency = Residency(sequences=1, persist_min_tokens=64, shared_store=str(store))
        return Engine(backends=("llama",), residency=residency, data_dir=tmp / data)

    with engine("a") as a:
        s = a.open_session(_request(path))
        assert s.ensure_prefix(_context(0).prefix_input()).reuse.outcome == "cold"
        assert a.tiers is not None and a.tiers.flush(60)
    for data, tier, version in (("a", "disk", 1), ("b", "shared", 2)):
        ctx = _context(version)
        expected = _fresh(path, ctx)
        with engine(data) as e:
            s = e.open_session(_request(path))
            st = s.ensure_prefix(ctx.prefix_input())
            _check_edit(st, tier)
            s.prefill_suffix(ctx.suffix_input())
            assert _decode(s) == expected


@pytest.mark.parametrize("name", ["hybrid-qwen35", "swa-gemma3"])
def test_a_chat_edit_at_a_message_start_reuses_everything_before_it(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Over the OpenAI chat API every message is a segment: an agent that clears an old tool
    result (Claude Code's micro-compaction) makes the prompt diverge at that message's start,
    deep inside the prefix, and the turn reuses every token before it. The messages are short
    (turn starts less than 128 tokens apart are not batch starts by themselves), so before
    segment starts were batch starts this turn went back to an earlier message."""
    import openai
    from daemon_proc import serve_http, stop

    path = str(testmodels.ensure_model(SPECS[name]))
    tmp = tmp_path_factory.mktemp("chat")
    proc, record = serve_http(tmp, "--model", f"m={path}", "--num-ctx", "4096", backend="llama")
    client = openai.OpenAI(
        base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0, timeout=120
    )

    def messages(cleared: bool) -> list[dict[str, str]]:
        out = [{"role": "system", "content": SYSTEM + REPO_MAP}]
        for k in range(3):
            result = f"tests of module_{k:02d}: 2 failed in handler_{k}, line {k + 10}.\n" * 2
            if k == 1 and cleared:
                result = "[Old tool result content cleared]\n"
            out.append({"role": "user", "content": result})
            out.append({"role": "assistant", "content": f"Fixed handler_{k}; running the tests again.\n"})
        out.append({"role": "user", "content": "tests of module_03: all passed.\n"})
        return out

    def ask(cleared: bool) -> tuple[int, int, int]:
        done = client.chat.completions.create(
            model="m", messages=messages(cleared), max_tokens=2, temperature=0
        )
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        diverged = (done.model_extra or {}).get("modeld", {}).get("diverged_at_token") or 0
        return done.usage.prompt_tokens_details.cached_tokens or 0, diverged, done.usage.prompt_tokens

    try:
        ask(False)
        cached, diverged, prompt = ask(True)
        assert 0 < diverged < prompt and diverged % 512 != 0, (cached, diverged, prompt)
        assert cached == diverged, (cached, diverged, prompt)
    finally:
        client.close()
        stop(proc)


@pytest.mark.parametrize("name", ["swa-gemma3", "swa-gptoss", "hybrid-qwen35"])
def test_a_turn_that_appends_after_a_restart_equals_a_fresh_evaluation(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A prefix restored whole from disk, then a turn that appends a segment to it: the append
    resumes where the snapshot ends, a segment start (a fresh evaluation's batch start too), and
    a sliding window's restored cells sit where a fresh evaluation holds them (before, its window
    came back at cell 0 and the turn was off by ~1e-4 of a log-probability)."""
    path = str(testmodels.ensure_model(SPECS[name]))
    tmp = tmp_path_factory.mktemp("append")
    head = _context(0).prefix_text

    def engine() -> Engine:
        return Engine(
            backends=("llama",), residency=Residency(sequences=1, persist_min_tokens=64), data_dir=tmp
        )

    longer = (
        rc.ContextBuilder()
        .system(head)
        .history("More history appended here.\n" * 8)
        .user_turn("Fix the failing test.\n")
        .build()
    )
    with engine() as a:
        s = a.open_session(_request(path))
        first = s.ensure_prefix(rc.ContextBuilder().system(head).user_turn("x\n").build().prefix_input())
        assert a.tiers is not None and a.tiers.flush(60)
    expected = _fresh(path, longer)
    with engine() as b:
        s = b.open_session(_request(path))
        st, warm = _turn(s, longer)
    assert (st.reuse.outcome, st.reuse.tier) == ("warm", "disk"), st.reuse
    assert st.reused_tokens == first.prefix_tokens
    assert warm == expected
