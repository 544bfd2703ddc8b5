"""OpenAI chat completions and completions: a turn's events as OpenAI's JSON and SSE chunks
(the requests are parsed in :mod:`modeld.server.http.openai.request`; ``blueprints/0014``).

Usage carries the cached tokens where OpenAI clients read them, and DeepSeek's
``prompt_cache_hit_tokens``/``prompt_cache_miss_tokens``; ``n`` choices share one usage (the
prompt once, every choice's completion). Each answer carries modeld's own ``modeld`` extension:
the session and how warm the turn was. :data:`OPENAI` is the dialect: OpenAI's error words, and
a whole answer, a stream or ``n`` choices of chat completions or completions (the turn says
which: a raw prompt is a completion).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from modeld.contract import TokenLogprob, ToolCall, ToolCallDelta
from modeld.server.http.answers import chat_logprobs, extension, sse
from modeld.server.http.conversations import Collected, Delta, Event, Finished, Started, TurnUsage
from modeld.server.http.dialect import Dialect
from modeld.server.http.errors import openai_error
from modeld.server.http.openai.request import OpenAIAsked
from modeld.server.http.turn import Turn

__all__ = [
    "OPENAI",
    "chat_choices",
    "chat_complete",
    "chat_stream",
    "choices_note",
    "completion_choices",
    "completion_complete",
    "completion_stream",
    "finish_reason",
    "models_response",
    "timings_dict",
    "usage_dict",
]


def timings_dict(usage: TurnUsage | None) -> dict[str, Any]:
    """Server-side timings under llama-server's names (``timings`` of its responses), with the
    speculation counts (blueprint 0021): ``draft_n`` tokens drafted and verified in
    ``draft_batches`` batches, ``draft_n_accepted`` of them the model's own choice, ``forced_n``
    forced by a constraint. ``predicted_per_second`` counts from the first token to the last."""
    if usage is None:
        usage = TurnUsage(0, 0, 0, 0)
    n, ms = usage.completion_tokens, usage.decode_ms
    return {
        "cache_n": usage.cached_tokens,
        "prompt_n": usage.computed_tokens,
        "prompt_ms": round(usage.prefill_ms, 3),
        "predicted_n": n,
        "predicted_ms": round(ms, 3),
        "predicted_per_second": round((n - 1) * 1000.0 / ms, 3) if n > 1 and ms > 0 else None,
        "draft_n": usage.drafted_tokens,
        "draft_n_accepted": usage.accepted_tokens,
        "draft_batches": usage.draft_batches,
        "forced_n": usage.forced_tokens,
    }


def usage_dict(usage: TurnUsage | None) -> dict[str, Any]:
    """OpenAI's usage, with the cached tokens where OpenAI clients read them (and DeepSeek's
    ``prompt_cache_hit_tokens``/``prompt_cache_miss_tokens``, which aider and Cline read)."""
    if usage is None:
        usage = TurnUsage(0, 0, 0, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.computed_tokens,
    }


_FINISH = {
    "length": "length",
    "tool_calls": "tool_calls",
    "signal": "tool_calls",  # to an OpenAI client an exit tool is a tool
    "constraint_failed": "constraint_failed",  # not "stop": the output is not valid
    "repeated_line": "repeated_line",
}


def finish_reason(finish: str) -> str:
    """OpenAI's finish reason: stop, length, tool_calls, or modeld's constraint_failed and
    repeated_line (the output is not what was asked for, so never "stop")."""
    return _FINISH.get(finish, "stop")


def _calls_dicts(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def _tool_delta(d: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": d.index}
    if d.id or d.name:
        out["id"] = d.id
        out["type"] = "function"
        out["function"] = {"name": d.name, "arguments": d.arguments}
    else:
        out["function"] = {"arguments": d.arguments}
    return out


def completion_logprobs(logprobs: tuple[TokenLogprob, ...], offset: int) -> dict[str, Any] | None:
    """The legacy ``choices[].logprobs`` of /v1/completions (``offset``: text before these)."""
    if not logprobs:
        return None
    offsets: list[int] = []
    at = offset
    for lp in logprobs:
        offsets.append(at)
        at += len(lp.text)
    return {
        "tokens": [lp.text for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.text: t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_message(done: Collected) -> dict[str, Any]:
    calls = _calls_dicts(done.finished.calls)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": done.text or (None if calls else ""),
        "refusal": None,
    }
    if done.reasoning:
        message["reasoning_content"] = done.reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def choices_usage(dones: Sequence[Collected]) -> TurnUsage | None:
    """The first choice's prompt (the others reuse it warm) and every choice's completion."""
    first = dones[0].finished.usage
    if first is None:
        return None
    completion = sum(d.finished.usage.completion_tokens for d in dones if d.finished.usage is not None)
    reasoning = sum(d.finished.usage.reasoning_tokens for d in dones if d.finished.usage is not None)
    return replace(first, completion_tokens=completion, reasoning_tokens=reasoning)


def choices_note(turn: Turn, dones: Sequence[Collected]) -> dict[str, Any]:
    """How ``n`` > 1 choices were decoded (``decoded``): ``together`` from the prompt's KV
    forked into ``n`` sequences, ``once`` (greedy: every choice is the same), or ``one by one``,
    and ``why``; {} for one choice."""
    if turn.n <= 1:
        return {}
    started = dones[0].started
    return {"n": turn.n, "decoded": started.decoded, **({"why": started.why} if started.why else {})}


def _answer(
    turn: Turn, dones: Sequence[Collected], answer_id: str, kind: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    """A whole answer (chat or completion) of one or ``n`` choices, with usage and timings."""
    usage = choices_usage(dones)
    answer: dict[str, Any] = {
        "id": answer_id,
        "object": kind,
        "created": turn.created,
        "model": turn.model,
        "choices": choices,
        "usage": usage_dict(usage),
        "timings": timings_dict(usage),
        "system_fingerprint": None,
        "modeld": extension(dones[0].started),
    }
    note = choices_note(turn, dones)
    if note:
        answer["timings"]["choices"] = note
        answer["modeld"]["choices"] = note
    return answer


def chat_complete(turn: Turn, done: Collected) -> dict[str, Any]:
    return chat_choices(turn, [done])


def chat_choices(turn: Turn, dones: Sequence[Collected]) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": chat_message(done),
            "logprobs": chat_logprobs(done.logprobs),
            "finish_reason": finish_reason(done.finished.finish),
        }
        for i, done in enumerate(dones)
    ]
    return _answer(turn, dones, f"chatcmpl-{turn.id}", "chat.completion", choices)


def _chat_chunk(
    turn: Turn,
    delta: dict[str, Any] | None,
    include_usage: bool,
    *,
    finish: str | None = None,
    usage: TurnUsage | None = None,
    ext: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; with ``delta`` None, the usage-only last chunk."""
    choice = (
        None if delta is None else {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    )
    return _stream_chunk(
        f"chatcmpl-{turn.id}", "chat.completion.chunk", turn, choice, include_usage, usage, ext
    )


def _stream_chunk(
    chunk_id: str,
    kind: str,
    turn: Turn,
    choice: dict[str, Any] | None,
    include_usage: bool,
    usage: TurnUsage | None,
    ext: dict[str, Any] | None,
) -> dict[str, Any]:
    """One chunk of a chat or completion stream; with ``choice`` None, the usage-only last one."""
    chunk: dict[str, Any] = {
        "id": chunk_id,
        "object": kind,
        "created": turn.created,
        "model": turn.model,
        "system_fingerprint": None,
        "choices": [] if choice is None else [choice],
    }
    if include_usage:
        chunk["usage"] = usage_dict(usage) if choice is None else None
    if ext is not None:
        chunk["modeld"] = ext
    return chunk


async def chat_stream(
    turn: Turn, started: Started, events: AsyncIterator[Event], include_usage: bool
) -> AsyncIterator[bytes]:
    ext = extension(started)
    yield sse(_chat_chunk(turn, {"role": "assistant", "content": ""}, include_usage))
    async for event in events:
        if isinstance(event, Delta):
            delta: dict[str, Any] = {}
            if event.reasoning:
                delta["reasoning_content"] = event.reasoning
            if event.text:
                delta["content"] = event.text
            calls = [d for d in event.calls if turn.parallel_tool_calls or d.index == 0]
            if calls:
                delta["tool_calls"] = [_tool_delta(d) for d in calls]
            if delta or event.logprobs:
                yield sse(_chat_chunk(turn, delta, include_usage, logprobs=chat_logprobs(event.logprobs)))
        elif isinstance(event, Finished):
            if event.error is not None:
                yield sse(openai_error(event.error))
                return
            tail = None if include_usage else ext
            end = _chat_chunk(turn, {}, include_usage, finish=finish_reason(event.finish), ext=tail)
            end["timings"] = timings_dict(event.usage)  # as llama-server's last chunk
            last = sse(end)
            if include_usage:
                last += sse(_chat_chunk(turn, None, include_usage, usage=event.usage, ext=ext))
            yield last + b"data: [DONE]\n\n"  # the last events in one write
            return


def completion_complete(turn: Turn, done: Collected) -> dict[str, Any]:
    return completion_choices(turn, [done])


def completion_choices(turn: Turn, dones: Sequence[Collected]) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": done.text,
            "logprobs": completion_logprobs(done.logprobs, 0),
            "finish_reason": finish_reason(done.finished.finish),
        }
        for i, done in enumerate(dones)
    ]
    return _answer(turn, dones, f"cmpl-{turn.id}", "text_completion", choices)


def _completion_chunk(
    turn: Turn,
    text: str | None,
    include_usage: bool,
    *,
    finish: str | None = None,
    usage: TurnUsage | None = None,
    ext: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = (
        None if text is None else {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    )
    return _stream_chunk(f"cmpl-{turn.id}", "text_completion", turn, choice, include_usage, usage, ext)


async def completion_stream(
    turn: Turn, started: Started, events: AsyncIterator[Event], include_usage: bool
) -> AsyncIterator[bytes]:
    ext = extension(started)
    offset = 0  # characters sent so far (logprobs' text_offset)
    async for event in events:
        if isinstance(event, Delta):
            if event.text or event.logprobs:
                logprobs = completion_logprobs(event.logprobs, offset)
                yield sse(_completion_chunk(turn, event.text, include_usage, logprobs=logprobs))
                offset += len(event.text)
        elif isinstance(event, Finished):
            if event.error is not None:
                yield sse(openai_error(event.error))
                return
            tail = None if include_usage else ext
            end = _completion_chunk(turn, "", include_usage, finish=finish_reason(event.finish), ext=tail)
            end["timings"] = timings_dict(event.usage)
            last = sse(end)
            if include_usage:
                last += sse(_completion_chunk(turn, None, include_usage, usage=event.usage, ext=ext))
            yield last + b"data: [DONE]\n\n"
            return


def models_response(entries: list[tuple[str, int, dict[str, Any]]]) -> dict[str, Any]:
    """``GET /v1/models``: each model with its window (``context_length``, the names Codex and
    LiteLLM read) where it is known."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "modeld", **meta}
            for name, created, meta in entries
        ],
    }


def _complete(asked: OpenAIAsked, done: Collected) -> dict[str, Any]:
    return chat_complete(asked.turn, done) if asked.turn.chat else completion_complete(asked.turn, done)


def _choices(asked: OpenAIAsked, dones: Sequence[Collected]) -> dict[str, Any]:
    return chat_choices(asked.turn, dones) if asked.turn.chat else completion_choices(asked.turn, dones)


def _stream(asked: OpenAIAsked, started: Started, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    turn = asked.turn
    if turn.chat:
        return chat_stream(turn, started, events, asked.include_usage)
    return completion_stream(turn, started, events, asked.include_usage)


OPENAI: Dialect[OpenAIAsked] = Dialect("openai", openai_error, _complete, _stream, _choices)
"""OpenAI's chat completions and completions (its error words are every OpenAI-compatible
route's: ``modeld.server.http.errors.openai_error``)."""
