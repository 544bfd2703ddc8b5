"""Every family's tool-call format, used three ways: parsed (whole and streamed, cut at every
point), forced by its grammar (every forced output parses, with valid arguments), written back
(a history's calls parse to the same calls), and recognised from a template's markers.

The outputs below are written here after the families' real templates and llama.cpp's
``tests/test-chat.cpp`` examples (the markers and where whitespace goes are facts of each
family; the text is ours).
"""

from __future__ import annotations

import json
import random
import re
import struct
from typing import Any

import jsonschema
import pytest
import xxhash

from modeld.contract import ToolCall
from modeld.decoding.constraints import compile_constraint
from modeld.decoding.formats import FORMATS, detect_format, make_parser
from modeld.decoding.gbnf_match import ByteMatcher
from modeld.decoding.tools import forced_call_constraint, format_calls, parse_tools

INT = {"type": "integer"}
TOOLS_JSON = json.dumps(
    [
        {
            "name": "special_function",
            "parameters": {"type": "object", "properties": {"arg1": INT}, "required": ["arg1"]},
        },
        {
            "name": "with_opt",
            "parameters": {"type": "object", "properties": {"arg1": INT, "arg2": INT}, "required": ["arg1"]},
        },
        {
            "name": "python",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
        {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "maxLength": 30},
                    "start": {"type": "integer", "minimum": 1},
                },
                "required": ["path"],
            },
        },
        {"name": "empty_args", "parameters": {"type": "object", "properties": {}}},
    ]
)
TOOLS = parse_tools(TOOLS_JSON, field="tools_json")
SCHEMAS = {t.name: t.parameters for t in TOOLS}

BAR, LOW = "\uff5c", "\u2581"


def ds(name: str) -> str:
    """A DeepSeek marker (fullwidth bars, U+2581 for the underscores)."""
    return "<" + BAR + name.replace("_", LOW) + BAR + ">"


CODE = 'def f(a = "14"):\n    return "<b>" + a\n'
RECORDED: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    # (format, output as a model writes it, the content, the calls)
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "start": 3}}\n</tool_call>',
        "Let me check.\n",
        [("read_file", {"path": "a.py", "start": 3})],
    ),
    (
        "qwen3_coder",
        f"<tool_call>\n<function=python>\n<parameter=code>\n{CODE}\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=with_opt>\n<parameter=arg1>\n1\n</parameter>\n<parameter=arg2>\n2\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        [("python", {"code": CODE}), ("with_opt", {"arg1": 1, "arg2": 2})],
    ),
    (
        "qwen3_coder",  # a model that skips the opening <tool_call>
        "Let me call it.\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>",
        "Let me call it.\n",
        [("special_function", {"arg1": 1})],
    ),
    (
        "harmony",
        "<|channel|>analysis<|message|>Need the file.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.read_file <|constrain|>json<|message|>{"path": "a.py"}',
        "<|channel|>analysis<|message|>Need the file.<|end|>",
        [("read_file", {"path": "a.py"})],
    ),
    (
        "harmony",  # the recipient in the role header
        ' to=functions.special_function<|channel|>commentary <|constrain|>json<|message|>{"arg1": 1}<|call|>',
        "",
        [("special_function", {"arg1": 1})],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "read_file", "parameters": {"path": "x"}}; {"name": "empty_args", "parameters": {}}',
        "",
        [("read_file", {"path": "x"}), ("empty_args", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "c.py"}, "id": "a1b2c3d4e"}]',
        "",
        [("read_file", {"path": "c.py"})],
    ),
    (
        "mistral_args",
        'Sure. [TOOL_CALLS]read_file[ARGS]{"path": "d.py"}[TOOL_CALLS]empty_args[ARGS]{}',
        "Sure. ",
        [("read_file", {"path": "d.py"}), ("empty_args", {})],
    ),
    (
        "mistral_ids",
        '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
        '[TOOL_CALLS]with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}',
        "",
        [("special_function", {"arg1": 1}), ("with_opt", {"arg1": 1, "arg2": 2})],
    ),
    (
        "glm45",
        "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>a b.py</arg_value>\n"
        "<arg_key>start</arg_key>\n<arg_value>7</arg_value>\n</tool_call>",
        "",
        [("read_file", {"path": "a b.py", "start": 7})],
    ),
    (
        "glm47",  # no newlines; a call without arguments
        "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call>"
        "<tool_call>empty_args</tool_call>",
        "",
        [("special_function", {"arg1": 1}), ("empty_args", {})],
    ),
    (
        "kimi_k2",
        "Calling.<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
        '<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_end|><|tool_call_begin|>functions.python:1'
        '<|tool_call_argument_begin|>{"code": "print(\'hey\')"}<|tool_call_end|><|tool_calls_section_end|>',
        "Calling.",
        [("special_function", {"arg1": 1}), ("python", {"code": "print('hey')"})],
    ),
    (
        "deepseek_v31",
        f'CONTENT{ds("tool_calls_begin")}{ds("tool_call_begin")}read_file{ds("tool_sep")}{{"path": "p"}}'
        f"{ds('tool_call_end')}{ds('tool_call_begin')}empty_args{ds('tool_sep')}{{}}{ds('tool_call_end')}"
        f"{ds('tool_calls_end')}",
        "CONTENT",
        [("read_file", {"path": "p"}), ("empty_args", {})],
    ),
    (
        "deepseek_r1",
        f"{ds('tool_calls_begin')}{ds('tool_call_begin')}function{ds('tool_sep')}special_function\n"
        f'```json\n{{"arg1": 1}}\n```{ds("tool_call_end")}{ds("tool_calls_end")}',
        "",
        [("special_function", {"arg1": 1})],
    ),
    (
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="special_function">\n<parameter name="arg1">1</parameter>\n</invoke>\n'
        '<invoke name="empty_args">\n</invoke>\n</minimax:tool_call>',
        "",
        [("special_function", {"arg1": 1}), ("empty_args", {})],
    ),
    (
        "seed_oss",
        f"<seed:tool_call>\n<function=python>\n<parameter=code>{CODE}</parameter>\n</function>\n</seed:tool_call>",
        "",
        [("python", {"code": CODE})],
    ),
    (
        "nemotron",
        '<TOOLCALL>[{"name": "special_function", "arguments": {"arg1": 1}}, '
        '{"name": "read_file", "arguments": {"path": "n"}}]</TOOLCALL>\n',
        "",  # whitespace after the calls is markup, not content
        [("special_function", {"arg1": 1}), ("read_file", {"path": "n"})],
    ),
    (
        "gemma4",
        'Hi.<|tool_call>call:read_file{path:<|"|>San Francisco, "CA"<|"|>,start:3}<tool_call|>'
        "<|tool_call>call:special_function{arg1:-7}<tool_call|>",
        "Hi.",
        [("read_file", {"path": 'San Francisco, "CA"', "start": 3}), ("special_function", {"arg1": -7})],
    ),
    (
        "lfm2",
        'Let me check.<|tool_call_start|>[read_file(path="a\\nb", start=2), python(code="x = None")]'
        "<|tool_call_end|>",
        "Let me check.",
        [("read_file", {"path": "a\nb", "start": 2}), ("python", {"code": "x = None"})],
    ),
    (
        "granite",
        '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]',
        "",
        [("special_function", {"arg1": 1})],
    ),
    (
        "command_r",
        '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "special_function", "parameters": {"arg1": 1}}\n'
        "]<|END_ACTION|>",
        "",
        [("special_function", {"arg1": 1})],
    ),
]


def run(fmt: str, pieces: list[str], *, cut: bool = False) -> tuple[str, list[Any], list[Any], str]:
    """Feed ``pieces``, finish; (content, calls, deltas, malformed reason)."""
    parser = make_parser(fmt, SCHEMAS)
    assert parser is not None
    text, deltas, reason = "", [], ""
    for piece in pieces:
        step = parser.feed(piece)
        text, deltas, reason = text + step.text, deltas + step.deltas, step.malformed
        if reason:
            return text, parser.calls, deltas, reason
    end = parser.finish(cut=cut)
    return text + end.text, parser.calls, deltas + end.deltas, end.malformed


def as_pairs(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), RECORDED)
def test_each_family_parses_whole_and_streamed_at_every_cut_point(
    fmt: str, output: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    splits = [[output], list(output), *([output[:i], output[i:]] for i in range(1, len(output)))]
    for pieces in splits:
        text, got, deltas, reason = run(fmt, pieces)
        assert reason == "", (pieces, reason)
        assert text == content, pieces
        assert as_pairs(got) == calls, pieces
        # The deltas rebuild the calls: id and name first, the arguments when complete.
        rebuilt: dict[int, list[str]] = {}
        for d in deltas:
            entry = rebuilt.setdefault(d.index, ["", "", ""])
            entry[0] += d.id
            entry[1] += d.name
            entry[2] += d.arguments
        assert [(n, json.loads(a)) for _, n, a in rebuilt.values()] == calls
        assert [i for i, _, _ in rebuilt.values()] == [c.id for c in got]


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), RECORDED)
def test_output_cut_off_anywhere_never_shows_markup_as_content(
    fmt: str, output: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    """max_tokens may end the output at any character: what is shown is always a prefix of the
    content the whole output has (so never the markup of a call)."""
    for i in range(len(output)):
        text, _, _, _ = run(fmt, [output[:i]], cut=True)
        assert content.startswith(text), (i, text)


def test_the_kimi_and_mistral_ids_are_the_models_own() -> None:
    _, calls, _, _ = run("kimi_k2", [RECORDED[11][1]])
    assert [c.id for c in calls] == ["functions.special_function:0", "functions.python:1"]
    _, calls, _, _ = run("mistral_ids", [RECORDED[8][1]])
    assert [c.id for c in calls] == ["000000001", "000000002"]


MALFORMED = [
    (
        "hermes",
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}\n</tool_call>',
        "not valid JSON",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=python>\nprint(1)\n</function>\n</tool_call>",
        "outside its parameters",
    ),
    ("glm45", "<tool_call><arg_key>a</arg_key></tool_call>", "function's name"),
    ("kimi_k2", "<|tool_calls_section_begin|>oops<|tool_calls_section_end|>", "inside the tool-call section"),
    ("gemma4", '<|tool_call>call:read_file{path:<|"|>x}<tool_call|>', "do not parse"),
    ("lfm2", "<|tool_call_start|>[read_file(path=open('x'))]<|tool_call_end|>", "Python list of calls"),
    ("harmony", "<|channel|>commentary to=functions.read_file<|message|>{path}<|call|>", "not JSON"),
    (
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="x">\n<parameter name="a">1</parameter>junk</invoke>',
        "outside",
    ),
]


@pytest.mark.parametrize(("fmt", "output", "why"), MALFORMED)
def test_a_malformed_call_says_why_and_keeps_its_text(fmt: str, output: str, why: str) -> None:
    parser = make_parser(fmt, SCHEMAS)
    assert parser is not None
    step = parser.feed(output)
    reason = step.malformed or parser.finish().malformed
    assert why in reason
    assert parser.raw and output.endswith(parser.raw[-8:])


# --- forced by the family's grammar --------------------------------------------------------------


def _literals(gbnf: str) -> list[str]:
    out = []
    for m in re.finditer(r'"((?:[^"\\]|\\.)*)"', gbnf):
        try:
            out.append(json.loads(f'"{m.group(1)}"'))
        except ValueError:
            continue
    return [s for s in out if s]


CLOSERS = (
    '"',
    "}",
    "]",
    ")",
    "\n",
    "</",
    "<tool_call|>",
    '<|"|>',
    "<|tool_call_end|>",
    "<|END",
    ds("tool_call_end"),
)


def walk(
    matcher: ByteMatcher, seed: int, literals: list[str], budget: int = 120, cap: int = 4000
) -> tuple[bytes, str]:
    """A seeded random decode over bytes, masked by the matcher: random (xxh3 weights) for the
    first ``budget`` bytes, then steering to an end as a model closes its markup: stop where
    allowed, else continue the closing literal begun furthest, else start one."""
    rng = random.Random(seed)
    state = seed
    out = bytearray()
    closing = [s.encode() for s in literals if s.startswith(CLOSERS)]
    starts = sorted({c[0] for c in closing})
    while len(out) < cap:
        allowed = sorted(matcher.allowed_bytes())
        if matcher.accepting() and (len(out) >= budget or rng.random() < 0.05):
            return bytes(out), "stop"
        if not allowed:
            return bytes(out), "constraint_failed" if not matcher.accepting() else "stop"
        if len(out) < budget:
            weights = [
                2.0 ** (8.0 * xxhash.xxh3_64_intdigest(struct.pack("<QI", state, c)) / 2**64) for c in allowed
            ]
            choice = rng.choices(allowed, weights)[0]
        else:
            recent = bytes(out[-96:])

            def score(c: int, recent: bytes = recent) -> int:
                tail = bytes(out[-32:]) + bytes((c,))
                best = 0
                for lit in closing:
                    if len(lit) > 1 and lit in recent:
                        continue  # written already: it did not end the call (inside a value)
                    for k in range(min(len(lit), len(tail)), max(best, 1), -1):
                        if tail.endswith(lit[:k]):
                            best = k
                            break
                return best

            scores = {c: score(c) for c in allowed}
            top = max(scores.values())
            if 0x22 in allowed and top < 2 and rng.random() < 0.3:
                choice = 0x22  # a JSON string ends
            elif top:
                choice = rng.choice([c for c in allowed if scores[c] == top])
            else:
                firsts = [c for c in allowed if c in starts]
                choice = rng.choice(firsts or allowed)
        matcher.advance(choice)
        out.append(choice)
        state = xxhash.xxh3_64_intdigest(struct.pack("<QI", state, choice))
    return bytes(out), "length"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_forced_call_in_each_family_parses_with_valid_arguments(fmt: str) -> None:
    constraint = forced_call_constraint(TOOLS, "required", fmt)
    compiled = compile_constraint(constraint)
    literals = _literals(constraint.value)
    names = set()
    for seed in range(24):
        out, finish = walk(compiled.byte_matcher(), seed, literals)
        assert finish == "stop", (seed, out)
        text, calls, _, reason = run(fmt, [out.decode("utf-8")])
        assert reason == "" and len(calls) == 1, (seed, out, reason)
        assert text.strip() == "", (seed, out)
        call = calls[0]
        names.add(call.name)
        args = json.loads(call.arguments)
        if fmt != "gemma4" or call.name != "python":
            jsonschema.validate(args, SCHEMAS[call.name])
    assert len(names) >= 2, names  # "required" lets the model pick any tool


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_named_tool_choice_forces_that_tool_in_each_family(fmt: str) -> None:
    constraint = forced_call_constraint(TOOLS, "read_file", fmt)
    compiled = compile_constraint(constraint)
    for seed in range(6):
        out, finish = walk(compiled.byte_matcher(), seed, _literals(constraint.value))
        assert finish == "stop"
        _, calls, _, reason = run(fmt, [out.decode("utf-8")])
        assert reason == "" and [c.name for c in calls] == ["read_file"], out
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["read_file"])


def test_a_forced_call_after_a_thinking_block_the_prompt_opened_closes_it_first() -> None:
    constraint = forced_call_constraint(TOOLS, "read_file", "qwen3_coder", after="</think>\n\n")
    out, finish = walk(compile_constraint(constraint).byte_matcher(), 1, _literals(constraint.value))
    assert finish == "stop" and out.startswith(b"</think>\n\n<tool_call>\n<function=read_file>\n")


# --- written back into a history -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_calls_written_back_parse_to_the_same_calls(fmt: str) -> None:
    calls = [
        ToolCall("call_1", "read_file", '{"path": "a <b> \\"c\\".py", "start": 2}'),
        ToolCall("call_2", "with_opt", '{"arg1": 1}'),
    ]
    written = format_calls(fmt, calls)
    text, got, _, reason = run(fmt, [written])
    assert reason == "" and text.strip() == "", (written, reason)
    assert as_pairs(got) == as_pairs(calls), written
    assert format_calls(fmt, []) == ""


# --- recognised from the template -------------------------------------------------------------------

TEMPLATES = {
    "harmony": "{{- '<|start|>assistant<|channel|>analysis<|message|>' }}",
    "kimi_k2": "{{- '<|tool_calls_section_begin|>' }}{%- for tc in tool_calls %}<|tool_call_begin|>",
    "deepseek_r1": "{{'<"
    + BAR
    + "tool"
    + LOW
    + "calls"
    + LOW
    + "begin"
    + BAR
    + ">'}}function"
    + "\\n```json\\n",
    "deepseek_v31": "{{'<"
    + BAR
    + "tool"
    + LOW
    + "calls"
    + LOW
    + "begin"
    + BAR
    + ">' + tool['function']['name']}}",
    "gemma4": "{{- '<|tool_call>call:' + function['name'] }}",
    "lfm2": "{{- '<|tool_list_start|>' }}...<|tool_call_start|>",
    "minimax_m2": "{{- '<minimax:tool_call>\\n' }}",
    "seed_oss": "{{ '<seed:tool_call>\\n<function=' }}",
    "glm45": "<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>",
    "glm47": "<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>",
    "qwen3_coder": "<tool_call>\\n<function={{ name }}>\\n<parameter={{ k }}>",
    "nemotron": "{{- '<TOOLCALL>[' -}}",
    "command_r": "<|START_ACTION|>{{ calls }}<|END_ACTION|>",
    "granite": "respond only with <|tool_call|> followed by a JSON list",
    "mistral_ids": "[TOOL_CALLS]{{ name }}[CALL_ID]{{ id }}[ARGS]{{ args }}",
    "mistral_args": "[TOOL_CALLS]{{ name }}[ARGS]{{ args }}",
    "mistral": "[TOOL_CALLS]{{ calls | tojson }}",
    "hermes": "<tool_call>\\n{{ call | tojson }}\\n</tool_call>",
    "llama3": "<|start_header_id|>ipython<|end_header_id|>{{ tool.parameters }}",
}


def test_each_family_is_recognised_from_its_templates_markers() -> None:
    assert set(TEMPLATES) == set(FORMATS)
    for fmt, template in TEMPLATES.items():
        assert detect_format(template) == fmt, fmt
    assert detect_format("{{ messages }}") == ""


def test_the_contract_lists_every_family() -> None:
    from modeld.contract import TOOL_FORMATS

    assert set(TOOL_FORMATS) == {"", "none", *FORMATS}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_long_call_streamed_in_small_deltas_parses_whole(fmt: str) -> None:
    """A call writing a file (24k characters with quotes, braces, backslashes and markup in its
    text), fed four characters at a time, as tokens arrive. (Before, the formats without a
    close marker scanned the whole call again on every delta: 12-16 s for this one.)"""
    code = "def f(x):\n    return {'a': [x, \"</b>\\\\\"]}\n" * 500
    call = ToolCall("c1", "python", json.dumps({"code": code}))
    text = format_calls(fmt, [call])
    _, calls, _, reason = run(fmt, [text[i : i + 4] for i in range(0, len(text), 4)])
    assert reason == "" and [json.loads(c.arguments) for c in calls] == [{"code": code}]


def test_text_after_a_call_that_only_looks_like_a_marker_keeps_its_whitespace() -> None:
    out = '<tool_call>\n{"name": "empty_args", "arguments": {}}\n</tool_call>\n<toolbox> is a tag.'
    for pieces in ([out], list(out)):
        text, calls, _, reason = run("hermes", pieces)
        assert reason == "" and [c.name for c in calls] == ["empty_args"]
        assert text == "\n<toolbox> is a tag.", pieces


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_mangled_outputs_never_raise_and_never_lose_text(fmt: str) -> None:
    """Whatever a model writes (here: every recorded output of every family, cut, spliced and
    mangled), each family's parser returns content, calls or a malformed reason, never an
    exception, and every character ends up in the content or in the calls' raw text."""
    rng = random.Random(fmt)
    sources = [out for _, out, _, _ in RECORDED] + [out for _, out, _ in MALFORMED]
    for _ in range(150):
        text = rng.choice(sources)
        for _ in range(rng.randint(1, 4)):
            i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
            other = rng.choice(sources)
            k = rng.randrange(len(other) + 1)
            text = rng.choice([text[:i] + text[j:], text[:i] + other[k : k + 12] + text[i:], text[:i]])
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        parser = make_parser(fmt, SCHEMAS)
        assert parser is not None
        shown = ""
        for piece in pieces:
            step = parser.feed(piece)
            shown += step.text
            if step.malformed:
                break
        else:
            end = parser.finish(cut=rng.random() < 0.5)
            shown += end.text
            if not end.malformed:  # all of it is content or the calls' raw text, in order
                assert len(shown) + len(parser.raw) == len(text), (text, shown, parser.raw)


def test_calls_sent_back_are_known_by_id_name_and_arguments() -> None:
    """The arguments of calls this daemon generated are recalled as the model wrote them by this
    key (``Conversations.recall``): Kimi writes ``functions.read_file:0`` in every turn, so the
    id alone would recall another turn's call."""
    from modeld.decoding.tools import call_key

    first = ToolCall("functions.read_file:0", "read_file", '{"path": "a.py", "start": 1}')
    later = ToolCall("functions.read_file:0", "read_file", '{"path": "b.py"}')
    assert call_key([first]) != call_key([later])
    # A client's own spacing and key order are the same call.
    assert call_key([first]) == call_key([ToolCall(first.id, "read_file", '{"start":1,"path":"a.py"}')])


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), RECORDED)
def test_a_decode_cut_off_anywhere_shows_no_markup_and_keeps_the_call_as_far_as_it_got(
    fmt: str, output: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    """The decode's view (``OutputProcessor``, finish ``length``): what is shown is a prefix of
    the content; a call cut off after its name is written comes back as that call, partial;
    ``text + tool_text`` is everything the model wrote."""
    from modeld.contract import DecodeConfig
    from modeld.decoding.output import OutputProcessor, plan_decode

    config = DecodeConfig(tools_json=TOOLS_JSON, tool_format=fmt)
    plan = plan_decode(config)
    names = [name for name, _ in calls]
    for i in range(len(output)):
        out = OutputProcessor(config, plan)
        shown = out.feed(output[:i]).text
        final = out.finish("length")
        shown += final.text
        assert content.startswith(shown), (i, shown)
        assert final.finish_reason == "length"
        assert [c.name for c in final.tool_calls] == names[: len(final.tool_calls)], (i, final.tool_calls)
        assert len(shown) + len(final.tool_text) == i, (i, shown, final.tool_text)
