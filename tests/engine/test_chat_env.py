"""The Jinja environment real chat templates are written for (``modeld/engine/chat_env.py``),
one construct at a time, and how a conversation reaches a template (``modeld/engine/chat.py``).

Each construct is one the templates of the families people run use (named beside it); the
expected text is what Hugging Face's environment and llama.cpp's renderer give for it.
"""

from __future__ import annotations

import datetime
import json

import pytest

from modeld.engine.chat import ChatRenderer, Message, parse_template_args
from modeld.engine.chat_env import TemplateRefusedError, compile_template, render_template, tojson
from modeld.errors import InvalidArgumentError, UnsupportedError


def render(source: str, **values: object) -> str:
    return render_template(compile_template(source), dict(values))


def whole(role: str, content: object = "", **fields: object) -> Message:
    """A message given whole, as a ``message`` segment carries it."""
    value = {"role": role, "content": content, **fields}
    return Message(role, content if isinstance(content, str) else "", (), json.dumps(value))


def test_raise_exception_is_the_templates_refusal_with_its_own_words() -> None:
    with pytest.raises(TemplateRefusedError) as err:
        render("{{ raise_exception('No user query found in messages.') }}")
    assert err.value.template_message == "No user query found in messages."
    assert err.value.reason == "invalid_argument" and err.value.field == "messages"
    assert "No user query found in messages." in err.value.message


def test_any_error_while_rendering_is_a_refusal_not_an_internal_error() -> None:
    with pytest.raises(TemplateRefusedError) as err:  # a TypeError inside the template (GLM's, once)
        render("{{ messages[0].content + 1 }}", messages=[{"content": "x"}])
    assert "TypeError" in err.value.template_message
    with pytest.raises(TemplateRefusedError):  # calling what is not callable
        render("{{ foo() }}")


def test_a_template_that_does_not_compile_is_unsupported() -> None:
    with pytest.raises(UnsupportedError) as err:
        compile_template("{% for x in %}")
    assert err.value.field == "chat_template"


def test_strftime_now_formats_the_local_time() -> None:  # gpt-oss, Mistral, Granite
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    assert render("{{ strftime_now('%Y-%m-%d') }}") in (
        today,
        datetime.datetime.now().strftime("%Y-%m-%d"),  # midnight passed meanwhile
    )


def test_loop_controls_break_and_continue() -> None:  # Kimi K2 Thinking, Nemotron, Gemma 4
    source = "{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}"
    assert render(source, xs=[1, 2, 3, 4, 5]) == "13"


def test_tojson_keeps_key_order_does_not_escape_and_takes_keywords() -> None:  # GLM, Llama 3
    value = {"b": "<é>", "a": [1, 2]}
    assert render("{{ v | tojson }}", v=value) == '{"b": "<é>", "a": [1, 2]}'
    assert render("{{ v | tojson(ensure_ascii=False) }}", v=value) == '{"b": "<é>", "a": [1, 2]}'
    assert render("{{ v | tojson(ensure_ascii=True) }}", v=value) == '{"b": "<\\u00e9>", "a": [1, 2]}'
    assert render("{{ v | tojson(indent=4) }}", v={"a": 1}) == '{\n    "a": 1\n}'
    assert render("{{ v | tojson(separators=(',', ':')) }}", v=value) == '{"b":"<é>","a":[1,2]}'
    assert render("{{ v | tojson(sort_keys=True) }}", v=value) == '{"a": [1, 2], "b": "<é>"}'
    assert tojson("x") == '"x"'


def test_lists_can_be_appended_to_and_popped() -> None:  # Kimi K2's queue of call ids
    source = (
        "{% set q = namespace(ids=[]) %}{% set _ = q.ids.append('a') %}{% set _ = q.ids.append('b') %}"
        "{{ q.ids.pop(0) }}{{ q.ids | length }}"
    )
    assert render(source) == "a1"


def test_generation_blocks_render_their_body() -> None:  # Hugging Face's assistant mask marker
    assert render("<{% generation %}x{{ y }}{% endgeneration %}>", y=1) == "<x1>"


def test_the_constructs_real_templates_lean_on() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " ok "}]
    assert (
        render(
            "{% for m in messages %}{{ loop.previtem.role if loop.previtem else '-' }}{% endfor %}",
            messages=messages,
        )
        == "-user"
    )
    assert (
        render(
            "{% for m in messages %}{{ loop.nextitem.role if loop.nextitem else '.' }}{% endfor %}",
            messages=messages,
        )
        == "assistant."
    )
    assert (
        render(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
            messages=messages,
        )
        == "2"
    )
    assert (
        render("{{ messages | selectattr('role', 'equalto', 'user') | list | length }}", messages=messages)
        == "1"
    )
    assert render("{{ messages[::-1][0].role }}", messages=messages) == "assistant"
    assert render("{% for k, v in d | items %}{{ k }}={{ v }};{% endfor %}", d={"b": 1, "a": 2}) == "b=1;a=2;"
    assert render("{% for k, v in d | dictsort %}{{ k }}{% endfor %}", d={"b": 1, "a": 2}) == "ab"
    assert render("{{ d.get('x', 'none') }}{{ d.items() | list | length }}", d={"a": 1}) == "none1"
    assert render("{{ s.split('</think>')[-1].lstrip('\\n') | trim }}", s="<think>a</think>\n b ") == "b"
    assert (
        render("{{ s.startswith('<t') }}{{ s.endswith('>') }}{{ '{}!'.format(s) }}", s="<t>")
        == "TrueTrue<t>!"
    )
    tests = "{{ [a is string, b is mapping, c is sequence, c is iterable, d is boolean, n is none, u is defined, d is false] }}"
    assert (
        render(tests, a="x", b={}, c=[1], d=False, n=None)
        == "[True, True, True, True, True, True, False, True]"
    )
    assert render("{{ x | default('d', true) }}{{ 'a,b' | replace(',', ';') | upper }}", x="") == "dA;B"


def test_a_template_cannot_reach_python_internals() -> None:
    with pytest.raises(TemplateRefusedError):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_messages_reach_the_template_whole_and_fresh() -> None:
    """A message segment's fields arrive as sent (arguments as objects where the template
    formats them itself), and a template that changes what it gets changes nothing kept."""
    source = (
        "{% for m in messages %}{{ m.role }}|{{ m.content }}|{{ m.tool_call_id }}|{{ m.name }}|"
        "{{ m.reasoning_content }}|{% for c in m.tool_calls or [] %}{{ c.id }}:{{ c.function.name }}:"
        "{% for k, v in c.function.arguments | items %}{{ k }}={{ v }}{% endfor %}{% endfor %}"
        "{% set _ = m.update({'role': 'changed'}) %};{% endfor %}"
    )
    renderer = ChatRenderer(source)
    assert renderer.string_arguments is False  # it formats arguments itself: objects
    call = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"q": "x"}'}}
    messages = [
        whole("assistant", "looking", tool_calls=[call], reasoning_content="think"),
        whole("tool", "found", tool_call_id="c1", name="grep"),
    ]
    first = renderer.render(messages, None, add_generation_prompt=False)
    assert first == "assistant|looking|||think|c1:grep:q=x;tool|found|c1|grep||;"
    assert renderer.render(messages, None, add_generation_prompt=False) == first


def test_arguments_stay_text_for_a_template_that_shows_text_as_it_is() -> None:
    """Qwen3's template prints arguments given as text verbatim: the call keeps the bytes the
    model wrote (and its tokens stay warm)."""
    source = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}"
        "{% endfor %}{% endfor %}"
    )
    renderer = ChatRenderer(source)
    assert renderer.string_arguments is True
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q":"x"}'}}
    assert (
        renderer.render([whole("assistant", "", tool_calls=[call])], None, add_generation_prompt=False)
        == '{"q":"x"}'
    )


def test_content_parts_reach_only_a_template_that_reads_parts() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    reads = ChatRenderer(
        "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}"
    )
    prints = ChatRenderer("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert reads.reads_parts and not prints.reads_parts
    assert reads.render([whole("user", parts)], None, add_generation_prompt=False) == "[one][two]"
    # As llama-server gives a template that takes strings only: text parts joined by newlines.
    assert prints.render([whole("user", parts)], None, add_generation_prompt=False) == "one\ntwo"


def test_template_arguments_reach_the_template_and_cannot_replace_modelds_own() -> None:
    renderer = ChatRenderer(
        "{{ enable_thinking }}/{{ reasoning_effort | default('-') }}/{{ custom }}"
        "{% if add_generation_prompt %}!{% endif %}"
    )
    args = parse_template_args(json.dumps({"enable_thinking": False, "custom": 3}))
    assert renderer.render([], None, add_generation_prompt=True, args=args) == "False/-/3!"
    with pytest.raises(InvalidArgumentError) as err:
        parse_template_args(json.dumps({"messages": []}))
    assert err.value.field == "template_args_json" and "messages" in err.value.message
    with pytest.raises(InvalidArgumentError):
        parse_template_args("[1]")


def test_the_prefix_is_what_every_rendering_shares_once_a_message_follows() -> None:
    """A template that refuses tools without a user message (Llama 3.3) is never asked to
    render a system message alone; the prefix stops where the next message's text starts."""
    source = (
        "{% if tools and messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
        "{{ raise_exception('no user message') }}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    renderer = ChatRenderer(source)
    system = [Message("system", "S", ())]
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(TemplateRefusedError):
        renderer.render(system, tools, add_generation_prompt=False)
    assert renderer.render_prefix(system, "user", tools) == "<system>S</system><user>"
    full = renderer.render([*system, Message("user", "hello", ())], tools, add_generation_prompt=True)
    assert full.startswith(renderer.render_prefix(system, "user", tools))


def test_a_template_reading_thinking_gets_the_reasoning_there() -> None:  # gpt-oss, LFM2
    renderer = ChatRenderer("{% for m in messages %}[{{ m.thinking }}]{{ m.content }}{% endfor %}")
    assert renderer.reads_thinking
    message = whole("assistant", "answer", reasoning_content="because")
    assert renderer.render([message], None, add_generation_prompt=False) == "[because]answer"
