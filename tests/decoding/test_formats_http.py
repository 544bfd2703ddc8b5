"""A call forced in a family's own format, end to end: the official ``openai`` SDK against a real
``modeld serve --http`` on the generated tiny llama model, copied with a chat template written
here in a family's shape (only ``tokenizer.chat_template`` changed). The daemon recognises the
format from the template, forces the call by a grammar in that markup, parses it back (whole
and streamed), and writes it back into the next turn's history in the same markup.

Every family, each template showing a call in its markup (as real templates teach their
models): Qwen3-Coder's XML parameters (string values raw, others typed by the schema), GLM's
``<arg_key>``/``<arg_value>`` pairs, gpt-oss's harmony channels, Kimi's and DeepSeek's sections,
Gemma 4's and LFM2's literals, and the JSON families.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from daemon_proc import serve_http, stop
from gguf_craft import STRING, load

from modeld.contract import ToolCall
from modeld.decoding.formats import FORMATS
from modeld.decoding.tools import format_calls
from modeld.testmodels import TINY, ensure_model

pytestmark = [pytest.mark.wire, pytest.mark.llama]

_HEAD = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a coding assistant.' }}{%- endif %}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n' }}{%- for tool in tools %}"
    "{{- '\\n- ' + tool.function.name + ': ' + (tool.function.description or '') }}{%- endfor %}"
)
_TAIL = (
    "{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _jinja_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def template_for(fmt: str) -> str:
    """A ChatML template (Qwen's shape) whose system turn shows a call in the family's markup,
    as real templates teach their models (what the daemon recognises the family by)."""
    example = format_calls(fmt, [ToolCall("call_1", "NAME", json.dumps({"KEY": "VALUE"}))])
    if fmt == "llama3":
        example = "<|python_tag|>" + example
    return _HEAD + "{{- '\\n\\nTo call a function:\\n' + " + _jinja_string(example) + " }}" + _TAIL


TEMPLATES = {fmt: template_for(fmt) for fmt in FORMATS}
READ_FILE: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 24},
                "line": {"type": "integer", "minimum": 1, "maximum": 999},
            },
            "required": ["path", "line"],
        },
    },
}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    tmp = Path(tempfile.mkdtemp(prefix="mdfmt"))
    tiny = load(ensure_model(TINY))
    models: list[str] = []
    for fmt, template in TEMPLATES.items():
        path = tiny.set("tokenizer.chat_template", template, STRING).write(tmp / f"tiny-{fmt}.gguf")
        models += ["--model", f"tiny-{fmt}={path}"]
    # The same file under another name, told to parse no calls (--tool-format, a per-model override).
    models += ["--model", f"tiny-none={tmp / 'tiny-glm45.gguf'}", "--tool-format", "tiny-none=none"]
    proc, record = serve_http(tmp, *models, backend="llama", timeout=300)
    sdk = openai.OpenAI(base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        yield sdk
    finally:
        sdk.close()
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_a_forced_call_in_the_models_own_format_comes_back_parsed(client: openai.OpenAI, fmt: str) -> None:
    model = f"tiny-{fmt}"
    messages: list[Any] = [
        {"role": "system", "content": "You fix failing tests. " * 8},
        {"role": "user", "content": "Open the failing test."},
    ]
    ask: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "tools": [READ_FILE],
        "tool_choice": {"type": "function", "function": {"name": "read_file"}},
        "max_tokens": 200,
        "extra_headers": {"X-Modeld-Conversation": f"formats-{fmt}"},
    }
    done = client.chat.completions.create(**ask)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["read_file"]
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, READ_FILE["function"]["parameters"])
    assert isinstance(args["line"], int)  # typed by the schema, though the markup has no types
    assert not choice.message.content  # no markup shown as content

    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["read_file"]
    streamed = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(streamed) == args  # the same greedy call, streamed
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""

    # The call and its result go back; the history shows the call in the family's markup, so
    # the next turn reuses the generated call (the daemon's exact text of it) and more.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "def test_lease(): assert False"},
    ]
    again = client.chat.completions.create(
        **{**ask, "messages": messages, "tool_choice": "auto", "max_tokens": 8}
    )
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls", "malformed_tool_call")
    assert again.usage is not None and done.usage is not None
    cached = again.usage.prompt_tokens_details.cached_tokens if again.usage.prompt_tokens_details else 0
    # Past turn one's prompt into its generated call: its text is the daemon's own. (Not always
    # to its end: a random model under a grammar samples token splits the tokenizer does not
    # make, and a turn runs on the text's own tokens: blueprint 0018.)
    assert cached > done.usage.prompt_tokens, (again.usage, done.usage)


def test_describe_says_which_format_each_model_writes(client: openai.OpenAI) -> None:
    from modeld.decoding.tools import detect_format

    for fmt, template in TEMPLATES.items():
        assert detect_format(template) == fmt


def test_a_models_tool_format_can_be_set_at_serve(client: openai.OpenAI) -> None:
    """``--tool-format tiny-none=none``: that model parses no calls, so a forced call is refused
    (the same file under its own name forces and parses GLM calls, as above)."""
    with pytest.raises(openai.BadRequestError, match="tool_format is 'none'"):
        client.chat.completions.create(
            model="tiny-none",
            messages=[{"role": "user", "content": "Open the failing test."}],
            tools=[READ_FILE],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=20,
        )
    answer = client.chat.completions.create(
        model="tiny-none",
        messages=[{"role": "user", "content": "Open the failing test."}],
        tools=[READ_FILE],  # type: ignore[list-item]
        max_tokens=4,
    )
    assert answer.choices[0].finish_reason == "length" and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "specs", [("tiny=yaml",), ("tiny",), ("=hermes",), ("tiny=",), ("tiny=hermes", "tiny=glm45")]
)
def test_a_bad_tool_format_option_is_refused_before_serving(specs: tuple[str, ...]) -> None:
    from modeld.settings import parse_tool_formats  # modeld serve checks them with it, before the lease

    with pytest.raises(ValueError, match="--tool-format"):
        parse_tool_formats(specs)
    assert parse_tool_formats(("a=hermes", "b=none")) == {"a": "hermes", "b": "none"}
