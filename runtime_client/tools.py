"""A tool loop: decode, run the tools the model called, append call and result, decode again.

What: :func:`run_tools` (sync) and :func:`arun_tools` (asyncio) drive a session through rounds
until the model answers without calling a tool, calls an exit tool (a signal), or
``max_tool_iterations`` rounds of tool calls have run. Tools run through a :class:`ToolRunner`
(or :class:`AsyncToolRunner`): any callable that takes a :class:`~modeld.contract.ToolCall` and
returns the result text. Each call gets ``tool_timeout`` seconds; a call that times out or raises
is reported to the model as an error result (``error: ...``), so one bad tool never ends the
loop.

Why it is cheap: the conversation only grows. After each round the builder's volatile segments
become history (:meth:`ContextBuilder.next_turn`) and the assistant's turn (its text plus the
calls exactly as generated, ``StreamChunk.tool_text``) and the tool results are appended as
history; the next ``ensure_prefix`` then reuses everything resident, generated tokens included,
and prefills only the tool results and the template's glue (:attr:`ToolRound.prefix` shows it).

What not: no retries, no parallel tool execution (calls of one round run in order), no
validation of arguments (a forced ``tool_choice`` already guarantees their shape).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from modeld.contract import AsyncSession as AsyncSessionProtocol
from modeld.contract import DecodeConfig, PrefixStatus, Session, StreamChunk, SuffixStatus, ToolCall, Usage
from modeld.errors import InvalidArgumentError
from runtime_client.builder import BuiltContext, ContextBuilder

__all__ = [
    "AsyncToolRunner",
    "ToolLoopResult",
    "ToolRound",
    "ToolRunner",
    "arun_tools",
    "run_tools",
]

DEFAULT_MAX_ITERATIONS = 8
DEFAULT_TOOL_TIMEOUT = 60.0
MAX_RESULT_CHARS = 1 << 20


class ToolRunner(Protocol):
    """Runs one tool call; returns the result text the model will read."""

    def __call__(self, call: ToolCall) -> str: ...


class AsyncToolRunner(Protocol):
    """The asyncio shape of :class:`ToolRunner`."""

    def __call__(self, call: ToolCall) -> Awaitable[str]: ...


@dataclass(frozen=True)
class ToolRound:
    """One decode of the loop: what was prefilled, what came out, what the tools said."""

    prefix: PrefixStatus
    suffix: SuffixStatus | None
    text: str
    finish_reason: str
    usage: Usage | None
    calls: tuple[ToolCall, ...] = ()
    results: tuple[str, ...] = ()
    first_chunk_seconds: float = 0.0  # from ensure_prefix to the first chunk (the round's TTFT)
    context: BuiltContext | None = field(default=None, repr=False)  # what was sent this round


@dataclass(frozen=True)
class ToolLoopResult:
    """The loop's end: the last answer, why it ended, and every round."""

    text: str
    finish_reason: str  # stop / length / ... of the last decode, "signal", or "max_tool_iterations"
    rounds: tuple[ToolRound, ...] = field(default_factory=tuple)
    signal: ToolCall | None = None
    pending_calls: tuple[ToolCall, ...] = ()  # calls not run because the iteration limit was hit


def _read(stream: Iterator[StreamChunk], started: float) -> tuple[list[StreamChunk], float]:
    chunks: list[StreamChunk] = []
    first = 0.0
    for chunk in stream:
        if not chunks:
            first = time.perf_counter() - started
        chunks.append(chunk)
    return chunks, first


def _collect(chunks: list[StreamChunk]) -> tuple[str, StreamChunk]:
    final = chunks[-1]
    return "".join(c.text for c in chunks), final


def _check(max_tool_iterations: int, tool_timeout: float) -> None:
    if (
        isinstance(max_tool_iterations, bool)
        or not isinstance(max_tool_iterations, int)
        or max_tool_iterations < 0
    ):
        raise InvalidArgumentError(
            "max_tool_iterations must be a non-negative integer", field="max_tool_iterations"
        )
    if not tool_timeout > 0:
        raise InvalidArgumentError("tool_timeout must be positive", field="tool_timeout")


def _result_text(value: object) -> str:
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_RESULT_CHARS]


def _is_async(runner: object) -> bool:
    return inspect.iscoroutinefunction(runner) or inspect.iscoroutinefunction(
        getattr(runner, "__call__", None)  # noqa: B004 - a callable object's own method
    )


def _grow(builder: ContextBuilder, text: str, final: StreamChunk, results: list[str]) -> None:
    builder.next_turn()
    builder.assistant(text + final.tool_text)
    for result in results:
        builder.tool_result(result)


def run_tools(
    session: Session,
    builder: ContextBuilder,
    runner: ToolRunner,
    decode: DecodeConfig,
    *,
    max_tool_iterations: int = DEFAULT_MAX_ITERATIONS,
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT,
    after_first: DecodeConfig | None = None,
) -> ToolLoopResult:
    """Run the loop on a session. ``builder`` holds the context (it is grown in place).
    ``after_first``: the DecodeConfig from the second round on (default: ``decode`` with
    ``tool_choice`` back to ``auto``, so a forced first call does not force every round)."""
    _check(max_tool_iterations, tool_timeout)
    later = after_first or replace(decode, tool_choice="auto" if decode.tool_choice != "none" else "none")
    rounds: list[ToolRound] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="modeld-tool")
    try:
        config = decode
        while True:
            ctx = builder.build()
            started = time.perf_counter()
            prefix = session.ensure_prefix(ctx.prefix_input())
            suffix = session.prefill_suffix(ctx.suffix_input())
            with session.decode(config) as stream:
                chunks, first = _read(stream, started)
            text, final = _collect(chunks)
            reason = final.finish_reason or "error"
            calls = final.tool_calls
            if reason != "tool_calls" or not calls or len(rounds) >= max_tool_iterations:
                rounds.append(ToolRound(prefix, suffix, text, reason, final.usage, calls, (), first, ctx))
                ended = "max_tool_iterations" if reason == "tool_calls" and calls else reason
                pending = calls if ended == "max_tool_iterations" else ()
                return ToolLoopResult(text, ended, tuple(rounds), final.signal, pending)
            results: list[str] = []
            for call in calls:
                future = pool.submit(runner, call)
                try:
                    results.append(_result_text(future.result(timeout=tool_timeout)))
                except concurrent.futures.TimeoutError:
                    results.append(f"error: the tool {call.name!r} did not finish within {tool_timeout:g} s")
                    pool.shutdown(wait=False, cancel_futures=True)  # its thread may still run; do not wait
                    pool = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="modeld-tool"
                    )
                except Exception as exc:
                    results.append(f"error: the tool {call.name!r} failed: {exc}")
            rounds.append(
                ToolRound(prefix, suffix, text, reason, final.usage, calls, tuple(results), first, ctx)
            )
            _grow(builder, text, final, results)
            config = later
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


async def arun_tools(
    session: AsyncSessionProtocol,
    builder: ContextBuilder,
    runner: AsyncToolRunner | Callable[[ToolCall], str],
    decode: DecodeConfig,
    *,
    max_tool_iterations: int = DEFAULT_MAX_ITERATIONS,
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT,
    after_first: DecodeConfig | None = None,
) -> ToolLoopResult:
    """The asyncio loop: the same rounds as :func:`run_tools`. A coroutine runner is awaited
    with ``asyncio.wait_for``; a plain function runs in a thread."""
    _check(max_tool_iterations, tool_timeout)
    later = after_first or replace(decode, tool_choice="auto" if decode.tool_choice != "none" else "none")
    rounds: list[ToolRound] = []
    config = decode
    while True:
        ctx = builder.build()
        started = time.perf_counter()
        prefix = await session.ensure_prefix(ctx.prefix_input())
        suffix = await session.prefill_suffix(ctx.suffix_input())
        stream = await session.decode(config)
        chunks: list[StreamChunk] = []
        first = 0.0
        async for chunk in stream:
            if not chunks:
                first = time.perf_counter() - started
            chunks.append(chunk)
        text, final = _collect(chunks)
        reason = final.finish_reason or "error"
        calls = final.tool_calls
        if reason != "tool_calls" or not calls or len(rounds) >= max_tool_iterations:
            rounds.append(ToolRound(prefix, suffix, text, reason, final.usage, calls, (), first, ctx))
            ended = "max_tool_iterations" if reason == "tool_calls" and calls else reason
            pending = calls if ended == "max_tool_iterations" else ()
            return ToolLoopResult(text, ended, tuple(rounds), final.signal, pending)
        results: list[str] = []
        for call in calls:
            try:
                if _is_async(runner):
                    value = await asyncio.wait_for(runner(call), tool_timeout)  # type: ignore[arg-type]
                else:
                    sync_runner: Callable[[ToolCall], str] = runner  # type: ignore[assignment]
                    value = await asyncio.wait_for(asyncio.to_thread(sync_runner, call), tool_timeout)
                results.append(_result_text(value))
            except TimeoutError:
                results.append(f"error: the tool {call.name!r} did not finish within {tool_timeout:g} s")
            except Exception as exc:
                results.append(f"error: the tool {call.name!r} failed: {exc}")
        rounds.append(ToolRound(prefix, suffix, text, reason, final.usage, calls, tuple(results), first, ctx))
        _grow(builder, text, final, results)
        config = later
