"""An edit inside one large segment, or inside a raw prompt without segments, goes back less than
~128 tokens on memory that cannot be cut at any token: line starts every 64 tokens or more are
batch starts and checkpoints (blueprint 0016, "Edits inside a segment").

On the generated qwen35, lfm2, granitehybrid and gemma3 (``modeld.testmodels.ARCH_SPECS``) on the
real llama.cpp, at the default micro-batch (512): a repository map of ~1.5k tokens whose line at
60% changes every turn, as an agent's map refresh does. The first edit goes back to the nearest of
the checkpoints ``--checkpoints`` keeps (8 by default, spread over the prompt; a sliding window in
the pool is cut at the line start itself); the last checkpoint before that edit is kept, so the
next edit of the same line reuses everything but the less than ~128 tokens since the line start
before it. Every warm turn's greedy tokens and log-probabilities are a fresh evaluation's, bit for
bit. Before, both went back to the map segment's start or the last multiple of 512 (316 tokens
before the edit on qwen35).
"""

from __future__ import annotations

import threading

import pytest
from greedy import greedy_logprobs

import runtime_client as rc
from modeld.contract import Config, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.settings import Residency

pytestmark = pytest.mark.llama

llama = pytest.importorskip("modeld.backends.llama")
testmodels = pytest.importorskip("modeld.testmodels")

SPECS = {spec.name: spec for spec in testmodels.ARCH_SPECS}
MODELS = ["hybrid-qwen35", "hybrid-lfm2", "hybrid-granite", "swa-gemma3"]

BACK = 128
"""At most this many tokens before the edit are recomputed (a line start 64 tokens or more after
the batch start before it, plus a line)."""

LINES = 48
LONG = 64


def _repo_map(version: int, lines: int = LINES) -> str:
    """~1.5k tokens (48 lines); the line at 60% changes with ``version``."""
    return "".join(
        f"src/module_{i:02d}.py: def handler_{i}(request), class Model{i}(Base)"
        f"{f'  # v{version}' if i == lines * 3 // 5 else ''}\n"
        for i in range(lines)
    )


def _context(version: int, lines: int = LINES) -> rc.BuiltContext:
    return (
        rc.ContextBuilder()
        .system("You are a careful coding agent working in this repository.\n")
        .repo_map(_repo_map(version, lines))
        .user_turn("Fix the failing test.\n")
        .build()
    )


def _request(path: str) -> OpenSessionRequest:
    return OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=4096, num_threads=2))


def _decode(session: object, n: int = 6) -> list[tuple[int, float]]:
    return greedy_logprobs(session, n)


def _fresh(path: str, prefix: PrefixInput, suffix: SuffixInput) -> list[tuple[int, float]]:
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(path))
        assert s.ensure_prefix(prefix).reuse.outcome == "cold"
        s.prefill_suffix(suffix)
        return _decode(s)


def _edits(path: str, prompts: list[tuple[PrefixInput, SuffixInput]]) -> list[tuple[object, object]]:
    """Every prompt in turn on one session (the first cold, then edits): each turn's status and
    answer, each answer checked against a fresh evaluation of its prompt."""
    out = []
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(path))
        for prefix, suffix in prompts:
            st = s.ensure_prefix(prefix)
            s.prefill_suffix(suffix)
            out.append((st, _decode(s)))
    for (prefix, suffix), (st, warm) in zip(prompts[1:], out[1:], strict=True):
        assert warm == _fresh(path, prefix, suffix), st.reuse.message  # type: ignore[attr-defined]
    return out


def _check(st: object) -> tuple[int, int]:
    """The turn went back no further than a checkpoint (or window cut) before the edit."""
    reuse = st.reuse  # type: ignore[attr-defined]
    diverged = reuse.diverged_at_token
    assert diverged is not None and reuse.outcome == "partial", reuse
    assert st.reused_tokens <= diverged, reuse.message  # type: ignore[attr-defined]
    assert st.reused_tokens + st.prefilled_tokens == st.prefix_tokens  # type: ignore[attr-defined]
    return st.reused_tokens, diverged  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", MODELS)
def test_an_edit_inside_a_large_segment_goes_back_less_than_128_tokens(name: str) -> None:
    path = str(testmodels.ensure_model(SPECS[name]))
    turns = _edits(path, [(_context(v).prefix_input(), _context(v).suffix_input()) for v in range(3)])
    (first, _), (edit, _), (again, _) = turns
    assert first.reuse.outcome == "cold"  # type: ignore[attr-defined]
    for st in (edit, again):
        assert st.reuse.diverged_segment == "repo_map", st.reuse  # type: ignore[attr-defined]
    _check(edit)
    reused, diverged = _check(again)
    # The map's line at 60% sits far past its start and the last multiple of 512.
    assert diverged > 512 + BACK and diverged % 512 > BACK, diverged
    assert diverged - reused < BACK, again.reuse.message  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["swa-gemma3", "hybrid-qwen35"])
def test_the_second_edit_after_a_restart_goes_back_no_further_than_the_first(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The checkpoint at the line start the first edit went back to travels in the context's
    snapshot: a sliding window, cut there in the pool without one, takes it at the cut (its
    snapshot holds only the last window: before, the edit after the restart went back to a
    checkpoint of the first evaluation, 183 tokens before the edit)."""
    path = str(testmodels.ensure_model(SPECS[name]))
    tmp = tmp_path_factory.mktemp("restart")

    def engine() -> Engine:
        return Engine(
            backends=("llama",), residency=Residency(sequences=1, persist_min_tokens=64), data_dir=tmp
        )

    with engine() as a:
        s = a.open_session(_request(path))
        for version in range(2):
            st = s.ensure_prefix(_context(version, LONG).prefix_input())
        reused, diverged = _check(st)
        assert a.tiers is not None and a.tiers.flush(60)
    ctx = _context(2, LONG)
    with engine() as b:
        s = b.open_session(_request(path))
        st = s.ensure_prefix(ctx.prefix_input())
        assert st.reuse.tier == "disk", st.reuse
        again, at = _check(st)
        assert at == diverged and reused <= again and diverged - again < BACK, st.reuse.message
        s.prefill_suffix(ctx.suffix_input())
        warm = _decode(s)
    assert warm == _fresh(path, ctx.prefix_input(), ctx.suffix_input())


def _raw(version: int) -> str:
    return "".join(
        f"def handler_{i}(request):  # v{version if i == 30 else 0}\n    return respond(compute({i}))\n"
        for i in range(48)
    )


@pytest.mark.parametrize("name", ["hybrid-qwen35", "swa-gemma3"])
def test_an_edit_inside_a_raw_prompt_goes_back_less_than_128_tokens(name: str) -> None:
    """A prefix of plain text (no segments: the gRPC API's text, a raw completion), evaluated
    cold in batches of 512 before: its line starts are batch starts and checkpoints too."""
    path = str(testmodels.ensure_model(SPECS[name]))
    turns = _edits(path, [(PrefixInput(text=_raw(v)), SuffixInput(text="fix it\n")) for v in range(3)])
    reused, diverged = _check(turns[2][0])
    assert diverged % 512 > BACK, diverged
    assert diverged - reused < BACK, turns[2][0].reuse.message  # type: ignore[attr-defined]


def test_a_raw_completion_edited_inside_reuses_what_precedes_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Through ``/v1/completions`` (the OpenAI SDK, a real daemon, qwen35): the prompt's line at
    60% changes twice; the second edit reuses all but less than 128 tokens before it, and its
    text and log-probabilities are what a second daemon answers cold."""
    import openai
    from daemon_proc import serve_http, stop

    path = str(testmodels.ensure_model(SPECS["hybrid-qwen35"]))

    def daemon(tag: str) -> tuple[object, openai.OpenAI]:
        proc, record = serve_http(
            tmp_path_factory.mktemp(tag), "--model", f"m={path}", "--num-ctx", "4096", backend="llama"
        )
        client = openai.OpenAI(
            base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0, timeout=120
        )
        return proc, client

    def ask(client: openai.OpenAI, version: int) -> tuple[int, int, object]:
        done = client.completions.create(
            model="m", prompt=_raw(version), max_tokens=4, temperature=0, logprobs=3
        )
        assert done.usage is not None
        details = done.usage.prompt_tokens_details
        cached = (details.cached_tokens if details is not None else 0) or 0
        diverged = (done.model_extra or {}).get("modeld", {}).get("diverged_at_token") or 0
        choice = done.choices[0]
        return cached, diverged, (choice.text, choice.logprobs)

    proc, client = daemon("warm")
    try:
        for version in range(2):
            ask(client, version)
        cached, diverged, warm = ask(client, 2)
    finally:
        client.close()
        stop(proc)
    assert diverged % 512 > BACK and 0 <= diverged - cached < BACK, (cached, diverged)
    proc, client = daemon("fresh")
    try:
        cached, _, fresh = ask(client, 2)
    finally:
        client.close()
        stop(proc)
    assert cached == 0 and warm == fresh


def test_a_chat_whose_system_message_changes_inside_reuses_what_precedes_the_edit(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """bench.hybrid's map loop through the OpenAI SDK (qwen35): each turn is a new conversation to
    the daemon (its first message changes), which copies the context of a turn before. Of the
    contexts sharing as much, the one used last is taken: it holds the checkpoint the last edit
    left just before the line (the first context only those of its first evaluation)."""
    import openai
    from daemon_proc import serve_http, stop

    path = str(testmodels.ensure_model(SPECS["hybrid-qwen35"]))
    proc, record = serve_http(
        tmp_path_factory.mktemp("chat"), "--model", f"m={path}", "--num-ctx", "4096", backend="llama"
    )
    client = openai.OpenAI(
        base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0, timeout=120
    )
    seen = []
    try:
        for version in range(4):
            messages = [
                {
                    "role": "system",
                    "content": "You are a coding agent.\nRepository map:\n" + _repo_map(version),
                },
                {"role": "user", "content": "Fix the failing test.\n"},
            ]
            done = client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0)
            assert done.usage is not None and done.usage.prompt_tokens_details is not None
            diverged = (done.model_extra or {}).get("modeld", {}).get("diverged_at_token") or 0
            seen.append((done.usage.prompt_tokens_details.cached_tokens or 0, diverged))
    finally:
        client.close()
        stop(proc)
    for cached, diverged in seen[2:]:
        assert diverged % 512 > BACK and 0 <= diverged - cached < BACK, seen


@pytest.mark.parametrize("name", ["hybrid-qwen35", "tiny"])
def test_a_turn_copies_what_a_prefill_ahead_keeps_while_it_runs(name: str) -> None:
    """A prefill ahead of the next turn appends to its conversation's context, which another
    conversation's turn may want to copy (the map loop: each edit a new conversation). While it
    runs, the tokens it keeps are offered, as a suffix's or a decode's are: before, a running
    prefix offered none, and the turn went to an older context (or computed everything). A prefix
    that cuts checkpointed memory offers none (it re-evaluates tokens before the cut)."""
    spec = testmodels.TINY if name == "tiny" else SPECS[name]
    path = str(testmodels.ensure_model(spec))
    first, edited = _context(1), _context(2)
    # No RAM tier: the prefix's snapshot would serve the edit (checkpoints travel inside it).
    with Engine(backends=("llama",), residency=Residency(sequences=3, ram_tier_bytes=0)) as engine:
        a = engine.open_session(_request(path))
        a.ensure_prefix(first.prefix_input())
        cache, tokens = a.model.cache, list(a._tokens)
        more = tokens + tokens[5:40]  # the turn's answer, closed: any tokens appended
        with cache.hold(a.slot, more, stage="prefix", manifest=a._manifest, ahead=True) as ahead:
            b = engine.open_session(_request(path))
            st = b.ensure_prefix(edited.prefix_input())  # while the prefill ahead holds a's context
            b.prefill_suffix(edited.suffix_input())
            warm = _decode(b)
            ahead.sync(None, None)
            ahead.commit(prefix=len(more))
        reused, diverged = _check(st)
        assert diverged - reused < BACK, st.reuse.message
        # Cut inside checkpointed memory: what it keeps is re-evaluated, offered to no one.
        edit = more[: len(tokens) // 2] + tokens[5:40]
        with cache.hold(a.slot, edit, stage="prefix", manifest=a._manifest) as cut:
            assert (cut.context.floor > 0) == (name == "tiny"), cut.context.floor
    # The tiny model's pool is unified (the copy attends over cells summed in another order:
    # blueprint 0016); the hybrid's answer is bit for bit.
    fresh = _fresh(path, edited.prefix_input(), edited.suffix_input())
    assert [t for t, _ in warm] == [t for t, _ in fresh]
    assert max(abs(x - y) for (_, x), (_, y) in zip(warm, fresh, strict=True)) <= (
        2e-3 if name == "tiny" else 0
    )


def test_a_turn_waits_for_the_prefill_ahead_running_on_the_context_it_copies() -> None:
    """The answer's prefill ahead of the next turn cuts its context a token back (the answer's last
    token is rendered otherwise once closed): on checkpointed memory, it offers nothing while it
    runs. A turn that would copy from it waits for it rather than go to an older context (which
    holds only the checkpoints of its first evaluation) or compute everything."""
    path = str(testmodels.ensure_model(SPECS["hybrid-qwen35"]))
    first, edited = _context(1), _context(2)
    with Engine(backends=("llama",), residency=Residency(sequences=3, ram_tier_bytes=0)) as engine:
        a = engine.open_session(_request(path))
        a.ensure_prefix(first.prefix_input())
        tokens = list(a._tokens)
        closed = tokens[:-1] + tokens[5:40]
        got: list[object] = []
        with a.model.cache.hold(a.slot, closed, stage="prefix", manifest=a._manifest, ahead=True) as ahead:
            assert ahead.context.floor == 0  # it re-evaluates from a checkpoint before its cut
            b = engine.open_session(_request(path))
            turn = threading.Thread(target=lambda: got.append(b.ensure_prefix(edited.prefix_input())))
            turn.start()
            turn.join(1.0)
            assert turn.is_alive()  # it waits (it would have computed all 1448 tokens)
            ahead.sync(None, None)
            ahead.commit(prefix=len(closed))
        turn.join(60)
        (st,) = got
        assert st.reuse.outcome == "partial" and st.reused_tokens > 512, st.reuse.message  # type: ignore[attr-defined]
        b.prefill_suffix(edited.suffix_input())
        warm = _decode(b)
    assert warm == _fresh(path, edited.prefix_input(), edited.suffix_input())
