"""The memory backend's prompt, written out as an oracle: its token count (one token per byte,
plus BOS) and its chat template (ChatML, tools in the system turn)."""

from __future__ import annotations

import json
from typing import Any


def tokens(text: str) -> int:
    """Memory backend: one token per byte, plus BOS."""
    return len(text.encode()) + 1


def chatml(messages: list[tuple[str, str]], tools: list[Any] | None = None, generation: bool = True) -> str:
    """The memory model's template (ChatML, tools in the system turn) over (role, content) pairs."""
    out = ""
    if tools:
        out += "<|im_start|>system\n"
        if messages[0][0] == "system":
            out += messages[0][1] + "\n"
        out += "# Tools\n" + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools) + "<|im_end|>\n"
    for i, (role, content) in enumerate(messages):
        if tools and i == 0 and role == "system":
            continue
        out += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return out + ("<|im_start|>assistant\n" if generation else "")
