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

Retries: a model turn that lost its operation to a restart -- the engine worker's
(``engine_restarted``, ``stall_timeout``, raised or as the final chunk's error) or the daemon's
(the runtime client raises ``engine_restarted`` for a decode in flight when its daemon goes away,
and resumes the session at the next call: :mod:`runtime_client.resume`) -- is run once more from
its ``ensure_prefix``, which restores the context from the tiers. :attr:`ToolRound.retry_reason`
says it happened. Tools are never run twice: a round's calls run after its decode succeeded.
A turn lost again ends the loop: raised as its typed error, or, when its decode's final chunk
said so, with ``finish_reason`` ``error`` and the reason in :attr:`ToolRound.error`.

What not: no other retries, no parallel tool execution (calls of one round run in order), no
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
from modeld.contract import (
    DecodeConfig,
    ErrorDetail,
    PrefixStatus,
    Session,
    StreamChunk,
    SuffixStatus,
    ToolCall,
    Usage,
)
from modeld.errors import InvalidArgumentError, ModeldError
from runtime_client.builder import BuiltContext, ContextBuilder
from runtime_client.resume import RETRY_REASONS

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
    retry_reason: str = ""  # why the turn ran twice (engine_restarted, stall_timeout), "" if once
    error: ErrorDetail | None = None  # the decode's error when it ended with one (finish "error")


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


def _retryable(final: StreamChunk) -> str:
    """The reason to run a turn again that ended with this final chunk, or ""."""
    if final.finish_reason == "error" and final.error is not None and final.error.reason in RETRY_REASONS:
        return final.error.reason
    return ""


@dataclass(frozen=True)
class _Turn:
    prefix: PrefixStatus
    suffix: SuffixStatus
    text: str
    final: StreamChunk
    first: float
    retry_reason: str


def _retry_after(exc: ModeldError, retry_reason: str) -> str:
    """A turn's attempt failed with ``exc``: the reason to run it once more (``exc`` is raised
    when a restart did not lose the operation, or when the turn ran again already)."""
    if retry_reason or exc.reason not in RETRY_REASONS:
        raise exc
    return exc.reason


def _settle(
    prefix: PrefixStatus, suffix: SuffixStatus, chunks: list[StreamChunk], first: float, retry_reason: str
) -> _Turn | str:
    """The turn an attempt made, or the reason to run it once more (its stream ended with the
    error of a lost operation, and it has not run again yet)."""
    text, final = _collect(chunks)
    again = _retryable(final)
    if again and not retry_reason:
        return again
    return _Turn(prefix, suffix, text, final, first, retry_reason)


def _ended(
    turn: _Turn, ctx: BuiltContext, rounds: list[ToolRound], max_tool_iterations: int
) -> ToolLoopResult | None:
    """The loop's result when this turn ends it (it called no tool, or the rounds are used up:
    its calls are then pending), recording its round; None when its calls are to be run."""
    final = turn.final
    reason = final.finish_reason or "error"
    calls = final.tool_calls
    if reason == "tool_calls" and calls and len(rounds) < max_tool_iterations:
        return None
    rounds.append(_round(turn, reason, calls, (), ctx))
    ended = "max_tool_iterations" if reason == "tool_calls" and calls else reason
    pending = calls if ended == "max_tool_iterations" else ()
    return ToolLoopResult(turn.text, ended, tuple(rounds), final.signal, pending)


def _turn(session: Session, ctx: BuiltContext, config: DecodeConfig) -> _Turn:
    """One model turn (ensure_prefix, prefill_suffix, decode), run again once if a restart lost it."""
    retry_reason = ""
    while True:
        try:
            started = time.perf_counter()
            prefix = session.ensure_prefix(ctx.prefix_input())
            suffix = session.prefill_suffix(ctx.suffix_input())
            with session.decode(config) as stream:
                chunks, first = _read(stream, started)
        except ModeldError as exc:
            retry_reason = _retry_after(exc, retry_reason)
            continue
        done = _settle(prefix, suffix, chunks, first, retry_reason)
        if isinstance(done, _Turn):
            return done
        retry_reason = done


async def _aturn(session: AsyncSessionProtocol, ctx: BuiltContext, config: DecodeConfig) -> _Turn:
    """The asyncio shape of :func:`_turn`."""
    retry_reason = ""
    while True:
        chunks: list[StreamChunk] = []
        first = 0.0
        try:
            started = time.perf_counter()
            prefix = await session.ensure_prefix(ctx.prefix_input())
            suffix = await session.prefill_suffix(ctx.suffix_input())
            stream = await session.decode(config)
            try:
                async for chunk in stream:
                    if not chunks:
                        first = time.perf_counter() - started
                    chunks.append(chunk)
            finally:
                await stream.aclose()
        except ModeldError as exc:
            retry_reason = _retry_after(exc, retry_reason)
            continue
        done = _settle(prefix, suffix, chunks, first, retry_reason)
        if isinstance(done, _Turn):
            return done
        retry_reason = done


def _round(
    turn: _Turn, reason: str, calls: tuple[ToolCall, ...], results: tuple[str, ...], ctx: BuiltContext
) -> ToolRound:
    return ToolRound(
        turn.prefix,
        turn.suffix,
        turn.text,
        reason,
        turn.final.usage,
        calls,
        results,
        turn.first,
        ctx,
        turn.retry_reason,
        turn.final.error,
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
            turn = _turn(session, ctx, config)
            done = _ended(turn, ctx, rounds, max_tool_iterations)
            if done is not None:
                return done
            calls = turn.final.tool_calls
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
            rounds.append(_round(turn, "tool_calls", calls, tuple(results), ctx))
            _grow(builder, turn.text, turn.final, results)
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
        turn = await _aturn(session, ctx, config)
        done = _ended(turn, ctx, rounds, max_tool_iterations)
        if done is not None:
            return done
        calls = turn.final.tool_calls
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
        rounds.append(_round(turn, "tool_calls", calls, tuple(results), ctx))
        _grow(builder, turn.text, turn.final, results)
        config = later
