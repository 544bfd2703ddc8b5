"""The runtime client's tool loop and run-time metadata, on the in-process engine (memory backend).

Prefill accounting is exact on the memory backend (one token per byte), so "each round
prefills only the tool result and the template's glue" is checked to the token. The tool-loop
tests need the engine to parse tool calls (the decode-loop integration of ``modeld.decoding``,
``blueprints/0018``); until the backend lists the ``grammar`` constraint they skip with that
reason, and the lead re-runs them after integrating.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.contract import Config, DecodeConfig, OpenSessionRequest, Session, ToolCall
from modeld.engine import Engine
from runtime_client import ContextBuilder, arun_tools, run_tools

TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 12}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        }
    ]
)
SYSTEM = "You are a coding agent. Read files before you answer.\n"


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine(backends=("memory",))
    yield e
    e.shutdown()


def open_chat(engine: Engine) -> Session:
    return engine.open_session(
        OpenSessionRequest(type="memory", path="agent", config=Config(prompt_format="chat"))
    )


def needs_tool_calls(session: Session) -> None:
    if "grammar" not in session.info.capabilities.constraints:
        pytest.skip("the engine does not parse tool calls yet (decode-loop integration, blueprints/0018)")


def builder_for(session: Session) -> ContextBuilder:
    return (
        ContextBuilder(identity=session.identity, tools_json=TOOLS)
        .system(SYSTEM)
        .user_turn("Why does main() crash?")
    )


def test_run_time_values_stay_in_the_suffix_and_keep_the_prefix_warm(engine: Engine) -> None:
    with engine.open_session(OpenSessionRequest(type="memory", path="agent")) as s:
        base = ContextBuilder(identity=s.identity).system(SYSTEM)
        first = base.copy().runtime(
            "Run-time values follow the task.", {"now": "2026-11-23T09:00:00Z", "budget": "40"}
        )
        first.user_turn("Fix the test.\n")
        ctx1 = first.build()
        s.ensure_prefix(ctx1.prefix_input())
        s.prefill_suffix(ctx1.suffix_input())
        second = base.copy().runtime(
            "Run-time values follow the task.", {"now": "2026-11-23T09:05:00Z", "budget": "35"}
        )
        ctx2 = second.user_turn("Fix the test.\n").build()
        status = s.ensure_prefix(ctx2.prefix_input())
        assert (status.reuse.outcome, status.reuse.reason, status.prefilled_tokens) == (
            "warm",
            "full_match",
            0,
        )
        assert "2026-11-23T09:05:00Z" in ctx2.suffix_text and "2026" not in ctx2.prefix_text


def test_a_timestamp_in_a_stable_segment_makes_every_turn_cold_and_the_builder_says_so(
    engine: Engine,
) -> None:
    with engine.open_session(OpenSessionRequest(type="memory", path="agent")) as s:
        b = ContextBuilder(identity=s.identity)
        warnings: tuple[str, ...] = ()
        reasons = []
        for minute in range(5):
            b._parts.clear()
            ctx = b.system(f"Now: 09:0{minute}. {SYSTEM}").repo_map("src/app.py\n").user_turn("go\n").build()
            status = s.ensure_prefix(ctx.prefix_input())
            reasons.append((status.reuse.reason, status.reuse.diverged_segment, status.reused_tokens))
            warnings = ctx.warnings
        assert reasons[1:] == [("diverged", "system", 10)] * 4  # BOS + "Now: 09:0" survive, no more
        assert len(warnings) == 1 and "'system'" in warnings[0]


def test_each_round_prefills_only_the_tool_result_and_the_template_glue(engine: Engine) -> None:
    with open_chat(engine) as s:
        needs_tool_calls(s)
        seen: list[ToolCall] = []

        def read_file(call: ToolCall) -> str:
            seen.append(call)
            return f"contents of {json.loads(call.arguments)['path']}: def main(): return 1 / 0\n"

        first = DecodeConfig(max_tokens=200, tool_choice="read_file")
        later = DecodeConfig(max_tokens=40, tool_choice="none")
        result = run_tools(s, builder_for(s), read_file, first, after_first=later)
        assert result.finish_reason in ("stop", "length") and len(result.rounds) == 2
        one, two = result.rounds
        assert one.finish_reason == "tool_calls" and [c.name for c in one.calls] == ["read_file"] == [
            c.name for c in seen
        ]
        assert one.usage is not None
        # Everything resident after round one is reused: its prompt and every generated token.
        assert two.prefix.reused_tokens == one.usage.prompt_tokens + one.usage.completion_tokens
        glue = "<|im_end|>\n<|im_start|>tool\n" + one.results[0] + "<|im_end|>\n"
        assert two.prefix.prefilled_tokens == len(glue.encode("utf-8"))
        assert two.suffix is not None and two.suffix.suffix_tokens == len(b"<|im_start|>assistant\n")


def test_the_loop_stops_at_max_tool_iterations_and_reports_failing_and_slow_tools(engine: Engine) -> None:
    with open_chat(engine) as s:
        needs_tool_calls(s)
        release = threading.Event()
        calls = 0

        def flaky(call: ToolCall) -> str:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise OSError("disk on fire")
            if calls == 2:
                release.wait(5)  # slower than the timeout
            return "ok"

        forced = DecodeConfig(max_tokens=200, tool_choice="required")
        result = run_tools(
            s, builder_for(s), flaky, forced, after_first=forced, max_tool_iterations=3, tool_timeout=0.2
        )
        release.set()
        assert result.finish_reason == "max_tool_iterations" and len(result.rounds) == 4
        assert [r.results for r in result.rounds[:3]] == [
            ("error: the tool 'read_file' failed: disk on fire",),
            ("error: the tool 'read_file' did not finish within 0.2 s",),
            ("ok",),
        ]
        assert len(result.pending_calls) == 1 and result.rounds[3].results == ()


def test_the_asyncio_loop_over_the_wire(engine: Engine) -> None:
    from modeld.daemon import Server, parse_listen
    from runtime_client import aconnect

    tmp = Path(tempfile.mkdtemp(prefix="mdt"))
    server = Server(engine, parse_listen(f"unix:{tmp}/modeld.sock"), engine.limits)
    endpoint = server.start()

    async def scenario() -> None:
        async with await aconnect(endpoint) as client:
            session = await client.open_session(
                OpenSessionRequest(type="memory", path="agent", config=Config(prompt_format="chat"))
            )
            try:
                if "grammar" not in session.info.capabilities.constraints:
                    pytest.skip(
                        "the engine does not parse tool calls yet (decode-loop integration, blueprints/0018)"
                    )

                async def read_file(call: ToolCall) -> str:
                    await asyncio.sleep(0)
                    return "print('hi')\n"

                b = (
                    ContextBuilder(identity=session.identity, tools_json=TOOLS)
                    .system(SYSTEM)
                    .user_turn("Look.")
                )
                first = DecodeConfig(max_tokens=200, tool_choice="required")
                result = await arun_tools(
                    session, b, read_file, first, after_first=DecodeConfig(max_tokens=20, tool_choice="none")
                )
                assert result.rounds[0].finish_reason == "tool_calls"
                assert result.rounds[1].prefix.reuse.outcome == "warm"
            finally:
                await session.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop(grace=0.2)
        shutil.rmtree(tmp, ignore_errors=True)


class _KillWorkerInEveryDecode:
    """The real session; after each decode's first chunk its engine worker is SIGKILLed."""

    def __init__(self, session: Session, engine: Engine) -> None:
        self.session, self.engine, self.decodes = session, engine, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.session, name)

    def decode(self, config: DecodeConfig) -> Iterator[object]:
        import os
        import signal
        import time

        self.decodes += 1
        pid = self.engine.status().models[0].worker.pid  # type: ignore[union-attr]

        def chunks() -> Iterator[object]:
            with self.session.decode(config) as stream:
                for i, chunk in enumerate(stream):
                    if i == 0:
                        os.kill(pid, signal.SIGKILL)
                    yield chunk
            deadline = time.monotonic() + 30  # the next try waits for the restarted worker anyway
            while self.engine.status().models[0].worker.pid == pid and time.monotonic() < deadline:  # type: ignore[union-attr]
                time.sleep(0.05)

        return _Closing(chunks())


class _Closing:
    def __init__(self, it: Iterator[object]) -> None:
        self.it = it

    def __iter__(self) -> Iterator[object]:
        return self.it

    def __enter__(self) -> _Closing:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_turn_lost_twice_ends_the_loop_naming_why() -> None:
    """The worker dies in the decode and again in its retry: the loop ends with finish_reason
    ``error`` and the last round says which error (before, the reason was lost)."""
    from modeld.settings import Residency

    with Engine(backends=("memory",), residency=Residency(isolation="process")) as engine:
        session = open_chat(engine)
        needs_tool_calls(session)
        faulty = _KillWorkerInEveryDecode(session, engine)
        builder = ContextBuilder(identity=session.identity, tools_json=TOOLS).system(SYSTEM).user_turn("Why?")
        slow = DecodeConfig(max_tokens=60, tool_choice="none", extra={"delay_ms": "40"})
        result = run_tools(faulty, builder, lambda call: "", slow)  # type: ignore[arg-type]
        assert faulty.decodes == 2 and result.finish_reason == "error"
        (last,) = result.rounds
        assert last.retry_reason == "engine_restarted"
        assert last.error is not None and last.error.reason == "engine_restarted"
        assert "SIGKILL" in last.error.message
