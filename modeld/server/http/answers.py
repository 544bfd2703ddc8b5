"""What every API's answer shaping shares, owned by no API.

An API's ``answer.py`` turns the conversation layer's events (``Started``, ``Delta``...,
``Finished``) into its wire format with these pieces:

* :func:`extension`: the ``modeld`` object every answer carries (which session served the turn,
  how warm it was and where a cold one diverged, what content was left out of the prompt);
* :func:`chat_logprobs`: token logprobs in OpenAI's form (chat completions and the Responses
  API write the same entries);
* :func:`call_arguments`: a tool call's arguments as an object (the APIs that send them parsed:
  Anthropic's ``input``, Ollama's ``arguments``);
* :func:`sse` / :func:`sse_event`: one server-sent event, without and with an event name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from modeld.contract import TokenLogprob, ToolCall
from modeld.server.http.conversations import Started

__all__ = ["call_arguments", "chat_logprobs", "extension", "sse", "sse_event"]


def extension(started: Started) -> dict[str, Any]:
    """The ``modeld`` extension object: which session served the turn and why it was warm."""
    status = started.status
    reuse = status.reuse
    info: dict[str, Any] = {
        "session_id": started.session_id,
        "reuse": reuse.outcome,
        "reason": reuse.reason,
        "reused_tokens": status.reused_tokens,
        "prefilled_tokens": status.prefilled_tokens,
    }
    if reuse.tier:
        info["tier"] = reuse.tier
    if reuse.diverged_at_token is not None:
        info["diverged_at_token"] = reuse.diverged_at_token
        if started.diverged_message is not None:
            info["diverged_at_message"] = started.diverged_message
    if started.omitted:  # images, documents of earlier turns: placeholders in the prompt
        info["omitted_content"] = list(started.omitted)
    return info


def _token_bytes(text: str) -> list[int]:
    """The bytes of a token's text (``bytes:\\xNN...`` spells out a partial UTF-8 token)."""
    if text.startswith("bytes:\\x"):
        try:
            return list(bytes.fromhex(text[6:].replace("\\x", "")))
        except ValueError:
            pass
    return list(text.encode("utf-8"))


def chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a chat response or chunk (``{"content": [...]}``)."""
    if not logprobs:
        return None
    content = [
        {
            "token": lp.text,
            "logprob": lp.logprob,
            "bytes": _token_bytes(lp.text),
            "top_logprobs": [
                {"token": t.text, "logprob": t.logprob, "bytes": _token_bytes(t.text)} for t in lp.top
            ],
        }
        for lp in logprobs
    ]
    return {"content": content, "refusal": None}


def call_arguments(call: ToolCall) -> dict[str, Any]:
    """A tool call's arguments as an object ({} when they are not one)."""
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` (``data: ...``)."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_event(kind: str, data: Mapping[str, Any]) -> bytes:
    """One named server-sent event (``event: kind`` and ``data: ...``)."""
    return (
        f"event: {kind}\ndata: ".encode()
        + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )
