"""Never compute a token twice (issue 30): conversations that take turns on one model, as a new
user runs them (a real ``modeld serve --http``, default flags, the official ``openai`` SDK, the
generated tiny llama model), each reuse their whole previous prompt on every later turn.

The scenario is the issue's repro: three chat conversations of about 2.4k tokens sharing a
system prompt, taking turns, three turns each. Before, every turn evicted the other idle
contexts from the unified pool ("its prefix is on disk"), and each conversation's next turn
reused only the shared system prompt: its own history was computed again.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_proc import serve_http, stop

pytestmark = [pytest.mark.wire, pytest.mark.llama]

SYSTEM = "You are a careful engineer. The repository's handlers follow.\n" + "".join(
    f"def handler_{i}(request, config):\n"
    f'    """Serve route {i} of the web app."""\n'
    f"    return render(request, 'page_{i}.html', config.get('k{i}'))\n\n"
    for i in range(44)
)
"""About 2.4k tokens of the tiny model's vocabulary: the prompt every conversation shares."""

QUESTIONS = {
    "a": ["Why does handler_3 fail?", "And handler_4?", "Fix both."],
    "b": ["Rename handler_7.", "Add a docstring to it.", "Now test it."],
    "c": ["What does config.get return?", "Where is k12 set?", "Remove k12."],
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[tuple[openai.OpenAI, Path]]:
    tmp = Path(tempfile.mkdtemp(prefix="mdr"))
    proc, record = serve_http(tmp, backend="llama")
    client = openai.OpenAI(
        base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0, timeout=120
    )
    try:
        yield client, tmp
    finally:
        client.close()
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def test_conversations_taking_turns_reuse_their_whole_previous_prompt(
    daemon: tuple[openai.OpenAI, Path],
) -> None:
    """Three conversations, three turns each, round robin: every warm turn reuses at least the
    whole prompt of its conversation's previous turn (the history the daemon computed before),
    however the other conversations' turns came between."""
    client, _tmp = daemon
    history: dict[str, list[dict[str, str]]] = {k: [{"role": "system", "content": SYSTEM}] for k in QUESTIONS}
    previous: dict[str, int] = {}
    seen: list[tuple[str, int, int, int]] = []
    for turn in range(3):
        for key, questions in QUESTIONS.items():
            messages = history[key]
            messages.append({"role": "user", "content": questions[turn]})
            done = client.chat.completions.create(
                model="modeld-tiny",
                messages=messages,
                max_tokens=8,
                temperature=0,  # type: ignore[arg-type]
            )
            usage = done.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            seen.append((key, turn, usage.prompt_tokens, cached))
            if key in previous:
                assert cached >= previous[key], seen
            previous[key] = usage.prompt_tokens
            messages.append({"role": "assistant", "content": done.choices[0].message.content or ""})
    assert len(seen) == 9 and all(p > 2300 for _k, _t, p, _c in seen), seen


def _workspace(agent: int, handlers: int = 108) -> str:
    """About 2.8k tokens of one agent's own context (no two agents share more than a line)."""
    return f"You are agent {agent}.\n" + "".join(
        f"def agent{agent}_step_{i}(state):\n    return state.advance({agent}, {i})\n\n"
        for i in range(handlers)
    )


def test_three_agents_at_once_on_an_8k_window_wait_for_cells_instead_of_failing() -> None:
    """Three agents of about 2.8k tokens each, concurrently, on the default layout (one window of
    8192 cells shared by four sequences): they do not fit together, so a turn that needs cells
    held by a running operation waits for it (in the order turns came), and the context that
    gives way leaves with all of its tokens. No turn fails ``busy``; every second turn reuses its
    whole first one (prompt and decode), and nothing is computed twice."""
    from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
    from modeld.engine import Engine
    from modeld.testmodels import TINY, ensure_model

    path = str(ensure_model(TINY))
    errors: list[BaseException] = []
    rows: dict[int, list[tuple[int, int, int, int]]] = {}
    with Engine(backends=("llama",)) as engine:
        barrier = threading.Barrier(3)

        def agent(i: int) -> None:
            try:
                session = engine.open_session(
                    OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=8192))
                )
                text = _workspace(i)
                barrier.wait(timeout=60)
                for turn in range(2):
                    st = session.ensure_prefix(PrefixInput(text=text))
                    sf = session.prefill_suffix(SuffixInput(text=f"turn {turn}: go on\n"))
                    out = list(session.decode(DecodeConfig(max_tokens=200, temperature=0.0)))
                    generated = sum(len(c.token_ids) for c in out)
                    rows.setdefault(i, []).append(
                        (st.prefix_tokens, st.reused_tokens, sf.suffix_tokens, generated)
                    )
                    text += f"turn {turn}: go on\n" + "".join(f"step {k}\n" for k in range(5))
                session.close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        counters = engine.status().models[0].counters
    for i, (first, second) in rows.items():
        assert first[0] > 2500, rows
        assert second[1] >= first[0], (i, rows)  # the whole first prefix came back
    assert counters["recomputed"] == 0, counters


def _memory_engine(**residency: Any) -> Any:
    from modeld.engine import Engine
    from modeld.settings import Residency

    return Engine(backends=("memory",), residency=Residency(**{"snapshot_min_tokens": 8, **residency}))


def _agent_turn(engine: Any, *, tool: bool, text: str, pinned: bool = False, keep_alive: float = 0.0) -> Any:
    """A chat session's turn on the memory backend: a forced tool call (the agent then runs its
    tool) or an answer."""
    from modeld.contract import Config, DecodeConfig, OpenSessionRequest
    from runtime_client import ContextBuilder

    session = engine.open_session(
        OpenSessionRequest(
            type="memory",
            path="agent",
            config=Config(prompt_format="chat"),
            pin=pinned,
            keep_alive_seconds=keep_alive,
        )
    )
    built = ContextBuilder(identity=session.identity, tools_json=TOOLS).system(text).user_turn("Why?").build()
    session.ensure_prefix(built.prefix_input())
    session.prefill_suffix(built.suffix_input())
    config = DecodeConfig(max_tokens=400 if tool else 16, tool_choice="read_file" if tool else "none")
    final = list(session.decode(config))[-1]
    assert final.finish_reason == ("tool_calls" if tool else "length"), final
    return session, built


TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}},
                    "required": ["path"],
                },
            },
        }
    ]
)


def _in_kv(engine: Any) -> set[str]:
    return {c.session_id for c in engine.status().models[0].contexts if c.tier == "kv" and c.session_id}


def test_an_agent_running_its_tool_keeps_its_cells_and_a_one_off_gives_way_first() -> None:
    """Two sequences: an agent whose turn ended in a tool call, then a one-off request (answered,
    not coming back). A third session needs a sequence: the one-off gives way, though the agent
    has been idle longer; the agent's next turn reuses everything it computed."""
    with _memory_engine(sequences=2) as engine:
        agent, _ = _agent_turn(engine, tool=True, text="You are a coding agent. " * 8)
        time.sleep(0.05)
        _once, _ = _agent_turn(engine, tool=False, text="Write a title for this conversation. " * 8)
        third, _ = _agent_turn(engine, tool=False, text="You review code. " * 8)
        assert _in_kv(engine) == {agent.session_id, third.session_id}
        assert engine.status().models[0].counters["recomputed"] == 0


def test_a_context_that_left_while_its_tool_ran_comes_back_before_it_asks() -> None:
    """An agent's turn ends in a tool call; another session needs its sequence meanwhile (the
    only other one is pinned), so the agent's context leaves, whole. When a sequence frees up
    (the other session's keep-alive ran out), the context is brought back before the agent's
    next turn asks, which then reuses all of it and says so."""
    from modeld.contract import PrefixInput

    with _memory_engine(sequences=2) as engine:
        agent, built = _agent_turn(engine, tool=True, text="You are a coding agent. " * 8)
        _agent_turn(engine, tool=False, text="You are pinned. " * 8, pinned=True)
        passing, _ = _agent_turn(engine, tool=False, text="You pass by. " * 8, keep_alive=1.0)
        assert agent.session_id not in _in_kv(engine)  # it left, whole, for the tiers
        deadline = time.monotonic() + 15
        while agent.session_id not in _in_kv(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent.session_id in _in_kv(engine) and passing.session_id not in _in_kv(engine)
        counters = engine.status().models[0].counters
        assert counters["prefetched"] == 1
        status = agent.ensure_prefix(PrefixInput(text=built.prefix_text + "next turn\n"))
        assert status.reuse.tier == "kv" and "brought back from the ram tier" in status.reuse.message
        assert engine.status().models[0].counters["recomputed"] == 0


def test_a_decode_takes_its_cells_as_it_grows_never_its_whole_room_up_front() -> None:
    """A one-window pool of 2048 cells (the memory backend's unified layout): an idle context of
    ~600 tokens, and another session's decode asking for 2048 tokens after a ~600-token prompt
    (Claude Code sends max_tokens 32000). The decode starts with 512 cells, so the idle context
    stays; stopped early, it never took the rest. Let run, it takes cells as it grows: the idle
    context leaves (whole) only when they are needed, and the decode fills the window."""
    from modeld.contract import Constraint, DecodeConfig, OpenSessionRequest, PrefixInput

    with _memory_engine(sequences=2, pool_tokens=2048) as engine:
        idle = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        idle.ensure_prefix(PrefixInput(text="idle workspace\n" * 40))
        writer = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        writer.ensure_prefix(PrefixInput(text="a long answer follows\n" * 27))
        with writer.decode(DecodeConfig(max_tokens=2048)) as stream:
            first = next(iter(stream))
            assert first.token_ids
            assert idle.session_id in _in_kv(engine)  # no room for 2048 taken up front
        assert idle.session_id in _in_kv(engine)
        prompt = len(engine.status().models[0].contexts)  # two contexts
        assert prompt == 2
        long = Constraint("grammar", 'root ::= [a-d]{600} [a-d]{600} "."')  # 1200 tokens, then it may end
        chunks = list(writer.decode(DecodeConfig(max_tokens=2048, constraint=long)))
        final = chunks[-1]
        assert final.error is None and final.finish_reason in ("length", "stop", "constraint_failed"), final
        generated = sum(len(c.token_ids) for c in chunks)
        assert generated > 1000, generated  # well past its first 512 cells
        assert idle.session_id not in _in_kv(engine)  # it gave way when the cells were needed
        counters = engine.status().models[0].counters
        assert counters["evicted_to_ram"] == 1 and counters["recomputed"] == 0


@pytest.mark.llama
def test_a_decode_that_grows_past_its_cells_on_llama_equals_one_that_had_them_all() -> None:
    """The tiny llama model, greedy, speculation on (verify batches): a decode of 1500 tokens
    after a ~300-token prompt, in a pool of 2048 cells where an idle context holds ~300, pauses
    at each 512 cells for more (the idle context leaves, whole, when they are needed) and gives
    the same tokens as the same decode in a pool with room for all of it up front."""
    from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput
    from modeld.engine import Engine
    from modeld.settings import Residency
    from modeld.testmodels import TINY, ensure_model

    path = str(ensure_model(TINY))
    request = OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=2048))
    prompt = "def f(x):\n    return x * 2\n" * 30
    outputs = []
    for pool in (2048, 8192):
        residency = Residency(sequences=2, pool_tokens=pool)
        with Engine(backends=("llama",), residency=residency) as engine:
            idle = engine.open_session(request)
            idle.ensure_prefix(PrefixInput(text="class Idle:\n    pass\n" * 40))
            writer = engine.open_session(request)
            writer.ensure_prefix(PrefixInput(text=prompt))
            chunks = list(writer.decode(DecodeConfig(max_tokens=1500, temperature=0.0)))
            assert chunks[-1].error is None, chunks[-1]
            outputs.append([t for c in chunks for t in c.token_ids])
            counters = engine.status().models[0].counters
            assert counters["recomputed"] == 0
            if pool == 2048:
                assert counters["evicted_to_ram"] == 1, counters  # the idle one gave way, whole
    assert len(outputs[0]) > 1300 and outputs[0] == outputs[1]


def test_busy_only_when_no_wait_helps_and_it_says_which() -> None:
    """A pool of 1024 cells, 800 of them held by a pinned session's context: a turn needing 600
    cannot have them by waiting (a pin holds until its session closes), so it fails ``busy`` at
    once, saying so; once the pinned session closes, the same turn runs (the closed context
    gives way, whole)."""
    from modeld.contract import OpenSessionRequest, PrefixInput
    from modeld.errors import BusyError

    with _memory_engine(sequences=2, pool_tokens=1024) as engine:
        pinned = engine.open_session(OpenSessionRequest(type="memory", path="m", pin=True))
        pinned.ensure_prefix(PrefixInput(text="p" * 800))
        other = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        started = time.monotonic()
        with pytest.raises(BusyError) as err:
            other.ensure_prefix(PrefixInput(text="o" * 600))
        assert time.monotonic() - started < 5  # no wait: it could not help
        assert (
            "pinned contexts hold 800" in err.value.message
            and "until their sessions close" in err.value.message
        )
        pinned.close()
        assert other.ensure_prefix(PrefixInput(text="o" * 600)).prefix_tokens == 601


@pytest.mark.llama
def test_a_restored_context_stores_the_start_it_shares_with_another_once_again() -> None:
    """Two sessions of the tiny llama model share a system prompt of ~600 tokens (the second
    copied it: its cells are tagged, not duplicated). The first leaves the pool (its keep-alive)
    and comes back from the RAM tier into cells of its own; it then shares that start with the
    other again, so the pool holds what it held before it left, and its output is unchanged."""
    from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
    from modeld.engine import Engine
    from modeld.settings import Residency
    from modeld.testmodels import TINY, ensure_model

    path = str(ensure_model(TINY))
    system = "You are a careful engineer. Rules follow.\n" + "".join(
        f"Rule {i}: test it.\n" for i in range(80)
    )

    def request(keep_alive: float = 0.0) -> OpenSessionRequest:
        return OpenSessionRequest(
            type="llama", path=path, config=Config(num_ctx=1536, num_batch=32), keep_alive_seconds=keep_alive
        )

    # A pool that runs short once both are in it: the restored start is shared (with room to
    # spare a restored context keeps its own cells: blueprint 0016).
    with Engine(backends=("llama",), residency=Residency(sequences=3, pool_tokens=1536)) as engine:
        a = engine.open_session(request(keep_alive=1.0))
        a.ensure_prefix(PrefixInput(text=system + "Task: fix the test.\n"))
        a.prefill_suffix(SuffixInput(text="go\n"))
        first = [t for c in a.decode(DecodeConfig(max_tokens=4, temperature=0.0)) for t in c.token_ids]
        b = engine.open_session(request())
        shared = b.ensure_prefix(PrefixInput(text=system + "Task: add a docstring.\n"))
        assert shared.reused_tokens > 600
        (model,) = engine.models()
        together = engine.status().models[0].resident_tokens
        deadline = time.monotonic() + 15
        while a.session_id in _in_kv(engine) and time.monotonic() < deadline:
            time.sleep(0.1)  # a's keep-alive runs out: it leaves, whole, for the RAM tier
        assert a.session_id not in _in_kv(engine)
        back = a.ensure_prefix(PrefixInput(text=system + "Task: fix the test.\n"))
        assert back.reuse.reason == "restored_from_ram" and back.prefilled_tokens == 0, back
        assert engine.status().models[0].resident_tokens == together  # the start is stored once
        a.prefill_suffix(SuffixInput(text="go\n"))
        again = [t for c in a.decode(DecodeConfig(max_tokens=4, temperature=0.0)) for t in c.token_ids]
        assert again == first
        assert model.cache.counters["recomputed"] == 0
