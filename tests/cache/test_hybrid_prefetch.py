"""Prefetch on memory that cannot be cut at any token (blueprint 0016, "Where a context goes" and
"Checkpoints travel with their context"): an agent's turn ends in a tool call, its context leaves
the KV while the tool runs (another session needs the sequence), and the janitor brings it back
(``prefetch.bring_back``) before the agent's next turn asks. The snapshot carries the context's
checkpoints (recurrent and hybrid states, sliding windows), so the next
turn reuses every token it can, from the KV, and answers as a fresh evaluation of the same turn.

On the real llama.cpp with the generated hybrid (qwen35: gated DeltaNet beside attention) and
sliding-window (gemma3) models. The next turn keeps the agent's prefix and sends a new suffix
(the tool's result), the split a fresh evaluation has too, so the comparison is bit for bit (an
appended turn resumes where the last prompt ended, which a fresh evaluation of the longer prompt
has as a batch boundary only at canonical positions: blueprint 0016, "What is not exact").
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from greedy import greedy_logprobs

from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.settings import Residency

pytestmark = pytest.mark.llama

testmodels = pytest.importorskip("modeld.testmodels")
pytest.importorskip("modeld.backends.llama")

SPECS = {spec.name: spec for spec in testmodels.ARCH_SPECS}

SYSTEM = "You are a coding agent. The repository follows.\n" + "".join(
    f"def handler_{i}(request):\n    value = compute({i}, request.body)\n    return respond(value)\n\n"
    for i in range(16)
)
"""About 450 tokens: several checkpoints' spacing at the tests' micro-batch."""

TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "maxLength": 12}},
                    "required": ["path"],
                },
            },
        }
    ]
)

BATCH = 16


def _request(path: str, **kw: Any) -> OpenSessionRequest:
    config = Config(num_ctx=2048, num_batch=BATCH, num_threads=2, prompt_format="chat")
    return OpenSessionRequest(type="llama", path=path, config=config, **kw)


def _answer(session: Any, n: int = 6) -> list[tuple[int, float]]:
    return greedy_logprobs(session, n, tool_choice="none")


def _in_kv(engine: Engine) -> set[str]:
    return {c.session_id for c in engine.status().models[0].contexts if c.tier == "kv" and c.session_id}


def _prompt(session: Any, system: str) -> Any:
    from runtime_client import ContextBuilder

    built = (
        ContextBuilder(identity=session.identity, tools_json=TOOLS).system(system).user_turn("Why?").build()
    )
    return built


def _fresh(path: str, prefix: PrefixInput, suffix: str) -> list[tuple[int, float]]:
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(path))
        assert s.ensure_prefix(prefix).reuse.outcome == "cold"
        s.prefill_suffix(SuffixInput(text=suffix))
        return _answer(s)


@pytest.mark.parametrize("name", ["hybrid-qwen35", "swa-gemma3"])
def test_a_context_brought_back_while_its_tool_ran_reuses_its_prefix_and_answers_as_fresh(name: str) -> None:
    path = str(testmodels.ensure_model(SPECS[name]))
    residency = Residency(sequences=2, snapshot_min_tokens=8)
    with Engine(backends=("llama",), residency=residency) as engine:
        agent = engine.open_session(_request(path))
        built = _prompt(agent, SYSTEM)
        prefix = built.prefix_input()
        agent.ensure_prefix(prefix)
        agent.prefill_suffix(built.suffix_input())
        config = DecodeConfig(max_tokens=60, tool_choice="read_file", speculation="off")
        final = list(agent.decode(config))[-1]
        assert final.finish_reason == "tool_calls", final
        # The other sequence is pinned; a passing session takes the agent's: it leaves, whole.
        pinned = engine.open_session(_request(path, pin=True))
        pinned.ensure_prefix(PrefixInput(text="You are pinned.\n" * 20))
        passing = engine.open_session(_request(path, keep_alive_seconds=1.0))
        passing.ensure_prefix(PrefixInput(text="You pass by.\n" * 20))
        assert agent.session_id not in _in_kv(engine)
        assert engine.tiers is not None
        held = max(len(e.tokens) for e in engine.tiers.entries() if e.tier == "ram")
        prefix_tokens = agent.explain_context().prefix_tokens
        # Memory that cannot be cut leaves whole, its checkpoints inside (the suffix and the call
        # too): recurrent and hybrid states, and sliding windows (their window checkpoints).
        assert held > prefix_tokens, (held, prefix_tokens)
        deadline = time.monotonic() + 30
        while agent.session_id not in _in_kv(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent.session_id in _in_kv(engine) and passing.session_id not in _in_kv(engine)
        assert engine.status().models[0].counters["prefetched"] == 1
        st = agent.ensure_prefix(prefix)
        assert (st.reuse.tier, st.reused_tokens) == ("kv", st.prefix_tokens), st.reuse
        assert "brought back from the ram tier" in st.reuse.message
        agent.prefill_suffix(SuffixInput(text="the file says: return 42\n"))
        warm = _answer(agent)
        assert engine.status().models[0].counters["recomputed"] == 0
    assert warm == _fresh(path, prefix, "the file says: return 42\n")
