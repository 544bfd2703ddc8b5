"""What the OpenAI endpoint refuses until the work that implements it lands, in one place.

Constrained decoding (``response_format`` json_object / json_schema) and tool-call parsing
(a forced ``tool_choice``, assistant ``tool_calls`` in the history) are issue 11. Until then a
request asking for them gets a 400 naming the field, never a reply that silently ignores it.
To lift a refusal, delete its check here and map the field in ``openai.py``.
"""

from __future__ import annotations

from typing import Any

from modeld.errors import echo

__all__ = ["not_yet_supported"]

_LATER = "is not supported yet (constrained decoding and tool-call parsing are coming)"


def not_yet_supported(body: dict[str, Any]) -> tuple[str, str] | None:
    """``(param, message)`` for the first field of a chat request that is not supported yet."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format", f"response_format type {echo(fmt.get('type'))} {_LATER}"
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "tool_choice", f"a forced tool_choice ({echo(choice)}) {_LATER}; use 'auto' or 'none'"
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict) and message.get("tool_calls"):
                return f"messages[{i}].tool_calls", f"messages[{i}].tool_calls {_LATER}"
    return None
