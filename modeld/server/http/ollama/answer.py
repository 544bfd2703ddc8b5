"""Ollama's answers: a turn's events as one JSON object or NDJSON lines (the last with ``done``,
``done_reason`` and Ollama's counts and durations in nanoseconds), and the model entries of
``/api/tags`` and ``/api/show``. :data:`OLLAMA` is the dialect: Ollama's ``{"error": "..."}``
(also for any path under ``/api/``), NDJSON streams.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any

from modeld.contract import ModelInfo, PrefillProgress, ToolCall
from modeld.decoding.toolcalls import new_call_id
from modeld.server.http.answers import call_arguments
from modeld.server.http.conversations import Collected, Delta, Event, Finished, Started
from modeld.server.http.dialect import Dialect
from modeld.server.http.errors import HttpError, WindowExceededError
from modeld.server.http.models import ModelEntry
from modeld.server.http.ollama.request import OllamaAsked
from modeld.server.http.turn import Turn

__all__ = ["OLLAMA", "OLLAMA_API_VERSION", "details", "digest", "modified", "now", "ollama_error"]

OLLAMA_API_VERSION = "0.12.0"
"""The version of Ollama's API this endpoint follows (what ``/api/version`` says): clients
check it before using features such as tools and thinking."""


def ollama_error(error: HttpError) -> dict[str, Any]:
    """Ollama's error body: ``{"error": "message"}`` (a prompt beyond the window in Ollama's
    words, with the counts)."""
    if isinstance(error, WindowExceededError):
        return {
            "error": f"the input length exceeds the context length ({error.prompt_tokens} tokens, "
            f"context length {error.window})"
        }
    return {"error": error.message}


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _done_reason(finish: str) -> str:
    return "length" if finish == "length" else "stop"


def _final_fields(started: Started, finished: Finished, began: float) -> dict[str, Any]:
    usage = finished.usage
    elapsed = time.monotonic() - began
    return {
        "done": True,
        "done_reason": _done_reason(finished.finish),
        "total_duration": int(elapsed * 1e9),
        "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens,  # the whole prompt, cached tokens included (Ollama's)
        "prompt_eval_duration": int(usage.prefill_ms * 1e6),
        "eval_count": usage.completion_tokens,
        "eval_duration": int(usage.decode_ms * 1e6),
        "modeld": {
            "session_id": started.session_id,
            "reuse": started.status.reuse.outcome,
            "reason": started.status.reuse.reason,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
            **({"omitted_content": list(started.omitted)} if started.omitted else {}),
        },
    }


def _calls(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [
        {"id": call.id or new_call_id(), "function": {"name": call.name, "arguments": call_arguments(call)}}
        for call in calls
    ]


def _line(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def chat_complete(turn: Turn, done: Collected, think: bool, began: float) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.text}
    if done.reasoning and think:
        message["thinking"] = done.reasoning
    if done.finished.calls:
        message["tool_calls"] = _calls(done.finished.calls)
    return {
        "model": turn.model,
        "created_at": now(),
        "message": message,
        **_final_fields(done.started, done.finished, began),
    }


def generate_complete(turn: Turn, done: Collected, think: bool, began: float) -> dict[str, Any]:
    out: dict[str, Any] = {"model": turn.model, "created_at": now(), "response": done.text}
    if done.reasoning and think:
        out["thinking"] = done.reasoning
    return {**out, **_final_fields(done.started, done.finished, began)}


async def _stream(
    turn: Turn, started: Started, events: AsyncIterator[Event], think: bool, began: float, chat: bool
) -> AsyncIterator[bytes]:
    async for event in events:
        if isinstance(event, Delta):
            thinking = event.reasoning if think else ""
            if not (event.text or thinking):
                continue
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": event.text}
                if thinking:
                    message["thinking"] = thinking
                yield _line({"model": turn.model, "created_at": now(), "message": message, "done": False})
            else:
                piece: dict[str, Any] = {
                    "model": turn.model,
                    "created_at": now(),
                    "response": event.text,
                    "done": False,
                }
                if thinking:
                    piece["thinking"] = thinking
                yield _line(piece)
        elif isinstance(event, Finished):
            if event.error is not None:
                yield _line(ollama_error(event.error))
                return
            final = _final_fields(started, event, began)
            if chat:
                message = {"role": "assistant", "content": ""}
                if event.calls:
                    message["tool_calls"] = _calls(event.calls)
                yield _line({"model": turn.model, "created_at": now(), "message": message, **final})
            else:
                yield _line({"model": turn.model, "created_at": now(), "response": "", **final})
            return


# --- models (GET /api/tags, POST /api/show) ----------------------------------------------------


def details(info: ModelInfo | None) -> dict[str, Any]:
    family = info.architecture if info is not None else ""
    return {
        "parent_model": "",
        "format": "gguf"
        if info is not None and info.backend in ("llama", "openvino")
        else (info.backend if info else ""),
        "family": family,
        "families": [family] if family else [],
        "parameter_size": "",
        "quantization_level": "",
    }


def modified(entry: ModelEntry) -> str:
    return datetime.fromtimestamp(entry.created, UTC).isoformat().replace("+00:00", "Z")


def digest(info: ModelInfo | None) -> str:
    return info.model_digest if info is not None else ""


def _complete(asked: OllamaAsked, done: Collected) -> dict[str, Any]:
    if asked.chat:
        return chat_complete(asked.turn, done, asked.think, asked.began)
    return generate_complete(asked.turn, done, asked.think, asked.began)


def _answer_stream(
    asked: OllamaAsked, started: Started, events: AsyncIterator[Event]
) -> AsyncIterator[bytes]:
    return _stream(asked.turn, started, events, asked.think, asked.began, asked.chat)


def _alive(asked: OllamaAsked, progress: PrefillProgress | None) -> bytes:
    """An empty piece of the answer (``done: false``), with how far a prefill got."""
    line: dict[str, Any] = {"model": asked.turn.model, "created_at": now()}
    if asked.chat:
        line["message"] = {"role": "assistant", "content": ""}
    else:
        line["response"] = ""
    line["done"] = False
    if progress is not None:
        line["modeld"] = {
            "progress": {"stage": progress.stage, "done": progress.done, "total": progress.total}
        }
    return _line(line)


OLLAMA: Dialect[OllamaAsked] = Dialect(
    "ollama",
    ollama_error,
    _complete,
    _answer_stream,
    media_type="application/x-ndjson",
    paths=("/api/",),
    alive=_alive,
)
"""Ollama's API."""
