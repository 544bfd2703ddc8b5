"""modeld.decoding without an engine: grammars, schemas, regexes, tool calls, signals, the guard.

Constrained "decodes" here walk the byte matcher with pseudo-random logits drawn from an xxh3
chain, as the reference (memory) backend does: whatever byte the logits favour, only allowed
bytes are taken and the end is allowed only where the grammar accepts. Every output must then
parse and validate, whatever the randomness chose.
"""

from __future__ import annotations

import json
import math
import random
import re
import struct

import pytest
import xxhash

from modeld.contract import Constraint, DecodeConfig, ToolCall
from modeld.decoding.constraints import cache_info, compile_constraint
from modeld.decoding.formats import make_parser
from modeld.decoding.gbnf import parse_gbnf
from modeld.decoding.gbnf_match import ByteMatcher
from modeld.decoding.guard import RepeatedLineGuard
from modeld.decoding.output import OutputProcessor, plan_decode
from modeld.decoding.tools import detect_format, forced_call_constraint, parse_tools
from modeld.errors import InvalidArgumentError, LimitExceededError, UnsupportedError
from modeld.settings import Limits

jsonschema = pytest.importorskip("jsonschema")

EOS = 256


def walk(
    matcher: ByteMatcher, seed: int, max_bytes: int = 600, temperature: float = 1.0
) -> tuple[bytes, str]:
    """A seeded random decode over bytes: logits from xxh3(state, byte), masked by the matcher."""
    rng = random.Random(seed)
    state = seed
    out = bytearray()
    while len(out) < max_bytes:
        allowed = sorted(matcher.allowed_bytes())
        choices = allowed + ([EOS] if matcher.accepting() else [])
        if not choices:
            return bytes(out), "constraint_failed"
        weights = [
            2.0 ** (8.0 * xxhash.xxh3_64_intdigest(struct.pack("<QI", state, c)) / 2**64 / temperature)
            for c in choices
        ]
        choice = rng.choices(choices, weights)[0]
        if choice == EOS:
            return bytes(out), "stop"
        matcher.advance(choice)
        out.append(choice)
        state = xxhash.xxh3_64_intdigest(struct.pack("<QI", state, choice))
    return bytes(out), "length"


TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["read_file", "write_file", "run_tests", "search"]},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "minLength": 1, "maxLength": 40},
                "line": {"type": "integer", "minimum": -7, "maximum": 100000},
                "recursive": {"type": "boolean"},
                "glob": {"type": "string", "pattern": "^[a-z*]+\\.py$"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
                "score": {"type": "number"},
                "limit": {
                    "anyOf": [{"type": "null"}, {"type": "integer", "exclusiveMinimum": 3, "maximum": 900}]
                },
                "mode": {"const": "fast"},
                "meta": {"$ref": "#/$defs/meta"},
            },
            "required": ["path", "line", "recursive"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
    "$defs": {"meta": {"type": "object", "properties": {"by": {"type": ["string", "null"], "maxLength": 8}}}},
}


def test_two_hundred_schema_constrained_decodes_all_parse_and_validate() -> None:
    compiled = compile_constraint(Constraint("json_schema", json.dumps(TOOL_SCHEMA)))
    finished = 0
    distinct = set()
    for seed in range(200):
        out, finish = walk(compiled.byte_matcher(), seed)
        assert finish == "stop", (seed, out)
        document = json.loads(out.decode("utf-8"))
        jsonschema.validate(document, TOOL_SCHEMA)
        finished += 1
        distinct.add(out)
    assert finished == 200
    assert len(distinct) == 200  # the randomness really chose: no two answers alike


def test_json_mode_yields_objects() -> None:
    compiled = compile_constraint(Constraint("json"))
    for seed in range(50):
        out, finish = walk(compiled.byte_matcher(), seed, max_bytes=4000, temperature=0.3)
        if finish == "stop":
            assert isinstance(json.loads(out.decode("utf-8")), dict)


@pytest.mark.parametrize(
    "pattern",
    [
        r"^[a-z]+\.py$",
        r"\d{3}-\d{4}",
        r"(foo|bar)+baz?",
        r"[^\d]x\W",
        r"a.b\s*c",
        r"(?P<k>[A-Z]{2})=(yes|no)",
        "é+→?",
    ],
)
def test_a_regex_constraint_always_matches(pattern: str) -> None:
    compiled = compile_constraint(Constraint("regex", pattern))
    for seed in range(60):
        out, finish = walk(compiled.byte_matcher(), seed, max_bytes=80)
        if finish == "stop":
            assert re.fullmatch(pattern, out.decode("utf-8")), (pattern, out)
        else:
            assert finish == "length"


def test_the_byte_matcher_is_exact_on_utf8() -> None:
    m = parse_gbnf('root ::= [é-ê] "→" | "a"').byte_matcher()
    assert m.allowed_bytes() == frozenset({0x61, 0xC3})  # 'a', or the lead byte of é/ê
    m.advance(0xC3)
    assert m.allowed_bytes() == frozenset({0xA9, 0xAA}) and not m.accepting()
    m.advance(0xA9)
    assert m.allowed_bytes() == frozenset({0xE2})
    m.advance_bytes("→".encode())
    assert m.accepting() and not m.dead() and m.allowed_bytes() == frozenset()
    bad = parse_gbnf('root ::= "x"').byte_matcher()
    bad.advance(ord("y"))
    assert bad.dead() and not bad.accepting()


def test_surrogates_are_never_produced() -> None:
    m = parse_gbnf("root ::= [\\uD000-\\uE000]").byte_matcher()
    m.advance(0xED)
    assert max(m.allowed_bytes()) == 0x9F  # ED A0..BF would encode U+D800..DFFF


@pytest.mark.parametrize(
    ("grammar", "line", "column", "words"),
    [
        ('root ::= "a" foo', 1, 14, "never defined"),
        ('root ::= "a\n', 1, 10, "unterminated"),
        ('x ::= "a"', 1, 1, "no 'root' rule"),
        ("root ::= [b-a]", 1, 10, "out of order"),
        ('root ::= "ok"\nitem ::= item "x"', 2, 1, "left-recursive"),
        ('root ::= "\\q"', 1, 11, "unknown escape"),
        ('root ::= "a"{3,2}', 1, 13, "repetition"),
        ('root ::= ( "a"', 1, 15, "expected ')'"),
    ],
)
def test_invalid_grammars_say_where(grammar: str, line: int, column: int, words: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        compile_constraint(Constraint("grammar", grammar))
    assert err.value.reason == "invalid_argument"
    assert (err.value.details["line"], err.value.details["column"]) == (str(line), str(column))
    assert words in err.value.message


def test_token_references_are_unsupported() -> None:
    with pytest.raises(UnsupportedError) as err:
        compile_constraint(Constraint("grammar", 'root ::= "a" <|im_end|>'))
    assert err.value.details["column"] == "14"


def test_an_invalid_schema_says_where() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        compile_constraint(Constraint("json_schema", '{"type": "object",\n "properties": {"a": }}'))
    assert (err.value.details["line"], err.value.details["column"]) == ("2", "22")
    with pytest.raises(InvalidArgumentError) as err:
        compile_constraint(Constraint("json_schema", '{"properties": {"a": {"type": "strin"}}}'))
    assert err.value.details["pointer"] == "/properties/a/type"
    with pytest.raises(InvalidArgumentError) as err:
        compile_constraint(Constraint("json_schema", '{"type": "string", "minLength": -1}'))
    assert err.value.details["pointer"] == "/minLength"


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"oneOf": [{"type": "string"}], "type": "string"}, ""),
        ({"type": "integer", "minimum": 10**16}, "/minimum"),
        ({"type": "number", "minimum": 0}, "/minimum"),
        ({"type": "object", "patternProperties": {"a": {}}}, "/patternProperties"),
        ({"properties": {"x": {"not": {}}}}, "/properties/x/not"),
        ({"$ref": "http://example.com/s"}, "/$ref"),
    ],
)
def test_keywords_that_cannot_be_enforced_are_unsupported(schema: object, pointer: str) -> None:
    with pytest.raises(UnsupportedError) as err:
        compile_constraint(Constraint("json_schema", json.dumps(schema)))
    assert err.value.details["pointer"] == pointer


# What agents send: opencode's Zod tools bound integers by +-(2^53 - 1) ("any safe integer"),
# Qwen Code's agent tool chooses between shapes with oneOf.
AGENT_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "filePath": {"type": "string", "maxLength": 30},
            "offset": {"type": "integer", "minimum": -9007199254740991, "maximum": 9007199254740991},
            "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991},
        },
        "required": ["filePath", "offset", "limit"],
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    },
    {
        "type": "object",
        "properties": {
            "task": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "search"},
                            "query": {"type": "string", "maxLength": 12},
                        },
                        "required": ["kind", "query"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "edit"}, "line": {"type": "integer", "minimum": 1}},
                        "required": ["kind", "line"],
                        "additionalProperties": False,
                    },
                    {"type": "string", "enum": ["stop"]},
                ]
            }
        },
        "required": ["task"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", AGENT_SCHEMAS, ids=["zod-safe-integers", "one-of"])
def test_schemas_as_agents_write_them_compile_and_every_output_validates(schema: dict[str, object]) -> None:
    compiled = compile_constraint(Constraint("json_schema", json.dumps(schema)))
    for seed in range(100):
        out, finish = walk(compiled.byte_matcher(), seed)
        assert finish == "stop", (seed, out)
        jsonschema.validate(json.loads(out.decode("utf-8")), schema)  # oneOf: exactly one matches


def test_invalid_regexes_and_unsupported_features_say_where() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        compile_constraint(Constraint("regex", "ab(c"))
    assert err.value.details["offset"] == "2"
    with pytest.raises(UnsupportedError) as err:
        compile_constraint(Constraint("regex", r"(a)\1"))
    assert err.value.details["offset"] == "3"
    with pytest.raises(UnsupportedError):
        compile_constraint(Constraint("regex", "a(?=b)"))


def test_compiling_is_cached_by_digest_and_bounded() -> None:
    schema = json.dumps({"type": "object", "properties": {"k": {"type": "integer", "minimum": 12345}}})
    before = cache_info()
    first = compile_constraint(Constraint("json_schema", schema))
    again = compile_constraint(Constraint("json_schema", schema))
    after = cache_info()
    assert first is again
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (1, 1)
    with pytest.raises(LimitExceededError) as exc:
        compile_constraint(Constraint("regex", "a" * (300 << 10)), max_bytes=Limits().max_constraint_bytes)
    assert exc.value.limit == "max_constraint_bytes"
    with pytest.raises(InvalidArgumentError):
        compile_constraint(Constraint("yaml", "a: 1"))


# --- tool calls -------------------------------------------------------------------------------

TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "maxLength": 30},
                        "start": {"type": "integer", "minimum": 1},
                    },
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        },
        {
            "name": "run_tests",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    ]
)
EXIT = json.dumps(
    [
        {
            "name": "NEEDS_MANAGER_DECISION",
            "parameters": {
                "type": "object",
                "properties": {
                    "question": {"type": "string", "maxLength": 40},
                    "options": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 12},
                        "minItems": 2,
                        "maxItems": 3,
                    },
                },
                "required": ["question", "options"],
                "additionalProperties": False,
            },
        },
        {
            "name": "LOW_CONFIDENCE",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    ]
)

RECORDED = [
    # (format, output as a model wrote it, content, calls, malformed reason or "")
    (
        "hermes",
        'Reading it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "start": 3}}\n</tool_call>',
        "Reading it.\n",
        [("read_file", {"path": "a.py", "start": 3})],
        "",
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>',
        "",  # the whitespace between calls is markup
        [("read_file", {"path": "a.py"}), ("run_tests", {})],
        "",
    ),
    (
        "hermes",
        "No tools needed: 3 < 4 and <tool is not a tag.",
        "No tools needed: 3 < 4 and <tool is not a tag.",
        [],
        "",
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}\n</tool_call>',
        "",
        [],
        "not valid JSON",
    ),
    ("hermes", '<tool_call>\n{"name": "read_file", "arguments": {"pa', "", [], "ended inside a tool call"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "", [], "needs a string name"),
    (
        "llama3",
        '{"name": "read_file", "parameters": {"path": "b.py"}}',
        "",
        [("read_file", {"path": "b.py"})],
        "",
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "read_file", "parameters": {"path": "x"}}; {"name": "run_tests", "parameters": {}}',
        "",
        [("read_file", {"path": "x"}), ("run_tests", {})],
        "",
    ),
    ("llama3", "The file is {not json}", "The file is {not json}", [], ""),
    ("llama3", '{"name": "read_file", "parameters": {"path": ', "", [], "ended inside a tool call"),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "c.py"}, "id": "a1b2c3d4e"}]',
        "",
        [("read_file", {"path": "c.py"})],
        "",
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS]read_file[ARGS]{"path": "d.py"}[TOOL_CALLS]run_tests[CALL_ID]x9[ARGS]{}',
        "Sure. ",
        [("read_file", {"path": "d.py"}), ("run_tests", {})],
        "",
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "read_file", "arguments": ["a.py"]}]',
        "",
        [],
        "must be a JSON object",
    ),
]


@pytest.mark.parametrize(("fmt", "output", "content", "calls", "malformed"), RECORDED)
@pytest.mark.parametrize("piece", [1, 4, 10_000])
def test_parsers_on_recorded_outputs(
    fmt: str,
    output: str,
    content: str,
    calls: list[tuple[str, dict[str, object]]],
    malformed: str,
    piece: int,
) -> None:
    parser = make_parser(fmt)
    assert parser is not None
    text, deltas, reason = "", [], ""
    for i in range(0, len(output), piece):
        step = parser.feed(output[i : i + piece])
        text, deltas, reason = text + step.text, deltas + step.deltas, step.malformed
        if reason:
            break
    if not reason:
        step = parser.finish()
        text, deltas, reason = text + step.text, deltas + step.deltas, step.malformed
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls
    if malformed:
        assert malformed in reason
        assert parser.raw and output.endswith(parser.raw[-10:])  # the raw text is kept
    else:
        assert reason == "" and text == content
        # Deltas rebuild the calls: names from first deltas, arguments concatenated.
        rebuilt: dict[int, list[str]] = {}
        for d in deltas:
            entry = rebuilt.setdefault(d.index, ["", ""])
            entry[0] += d.name
            entry[1] += d.arguments
        assert [(n, json.loads(a)) for n, a in rebuilt.values()] == calls


def test_formats_are_recognised_from_templates() -> None:
    from modeld.testmodels._template import CHATML_TOOLS_TEMPLATE as CHAT_TEMPLATE

    assert detect_format(CHAT_TEMPLATE) == "hermes"
    assert detect_format("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_format("<|start_header_id|>{{ tool.parameters }}") == "llama3"
    assert detect_format("{{ messages }}") == ""


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_tool_choice_required_always_yields_a_parsed_call_with_valid_arguments(fmt: str) -> None:
    tools = parse_tools(TOOLS, field="tools_json")
    compiled = compile_constraint(forced_call_constraint(tools, "required", fmt))
    schemas = {t.name: t.parameters for t in tools}
    for seed in range(60):
        out, finish = walk(compiled.byte_matcher(), seed)
        assert finish == "stop"
        parser = make_parser(fmt)
        assert parser is not None
        step = parser.feed(out.decode("utf-8"))
        end = parser.finish()
        assert not step.malformed and not end.malformed and len(parser.calls) == 1
        call = parser.calls[0]
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_named_tool_choice_forces_that_tool() -> None:
    tools = parse_tools(TOOLS, field="tools_json")
    compiled = compile_constraint(forced_call_constraint(tools, "run_tests", "hermes"))
    out, _ = walk(compiled.byte_matcher(), 7)
    assert out.decode() == '<tool_call>\n{"name":"run_tests","arguments":{}}\n</tool_call>'
    with pytest.raises(InvalidArgumentError) as err:
        forced_call_constraint(tools, "delete_everything", "hermes")
    assert err.value.field == "tool_choice"


def run_output(
    config: DecodeConfig, text: str, natural: str = "stop", template: str = "<tool_call>"
) -> tuple[str, object]:
    plan = plan_decode(config, chat_template=template)
    out = OutputProcessor(config, plan)
    shown = ""
    for ch in text:
        step = out.feed(ch)
        shown += step.text
        if step.stop:
            natural = step.stop
            break
    final = out.finish(natural)
    return shown + final.text, final


def test_an_exit_tool_forced_by_tool_choice_becomes_a_signal_and_stops() -> None:
    config = DecodeConfig(tools_json=TOOLS, exit_tools_json=EXIT, tool_choice="NEEDS_MANAGER_DECISION")
    plan = plan_decode(config, chat_template="<tool_call>")
    assert plan.forced and plan.constraint is not None
    out, _ = walk(plan.constraint.byte_matcher(), 3)
    generated = out.decode() + "text the model would write after the call"
    shown, final = run_output(config, generated)
    assert final.finish_reason == "signal"
    assert isinstance(final.signal, ToolCall) and final.signal.name == "NEEDS_MANAGER_DECISION"
    args = json.loads(final.signal.arguments)
    assert set(args) == {"question", "options"} and 2 <= len(args["options"]) <= 3
    assert final.tool_calls == () and shown == ""  # nothing after the signal was shown


def test_calls_end_with_tool_calls_and_keep_the_raw_text() -> None:
    config = DecodeConfig(tools_json=TOOLS)
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "x.py"}}\n</tool_call>'
    shown, final = run_output(config, "Let me see.\n" + call)
    assert (shown, final.finish_reason) == ("Let me see.\n", "tool_calls")
    assert [c.name for c in final.tool_calls] == ["read_file"] and final.tool_text == call
    shown, final = run_output(config, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>')
    assert final.finish_reason == "malformed_tool_call" and "rm_rf" in shown
    shown, final = run_output(config, "<tool_call>\n{oops}\n</tool_call>")
    assert (final.finish_reason, shown) == ("malformed_tool_call", "<tool_call>\n{oops}\n</tool_call>")


def test_constraint_and_forced_call_do_not_combine() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        plan_decode(DecodeConfig(tools_json=TOOLS, tool_choice="required", constraint=Constraint("json")))
    assert err.value.field == "tool_choice"


def test_a_model_that_stops_early_under_a_constraint_fails_it() -> None:
    config = DecodeConfig(constraint=Constraint("regex", "[a-z]{5}"))
    _, final = run_output(config, "abc", natural="stop")
    assert final.finish_reason == "constraint_failed"
    _, final = run_output(config, "abcde", natural="stop")
    assert final.finish_reason == "stop"


def test_a_grammar_that_forces_a_repeated_line_is_stopped_by_the_guard() -> None:
    line = "assert value == expected_value\n"
    config = DecodeConfig(constraint=Constraint("grammar", f"root ::= ({json.dumps(line)}){{20}}"))
    plan = plan_decode(config)
    assert plan.constraint is not None
    out, finish = walk(plan.constraint.byte_matcher(), 1, max_bytes=2000)
    assert finish == "stop" and out.decode() == line * 20
    shown, final = run_output(config, out.decode(), natural=finish)
    assert final.finish_reason == "repeated_line"
    assert shown.count(line) == 8  # the default: 8 identical lines of >= 16 characters


def test_the_guard_counts_only_long_identical_lines_in_a_row() -> None:
    guard = RepeatedLineGuard(min_chars=10, max_repeats=3)
    assert not guard.feed("}\n}\n}\n}\n")  # short lines never count
    assert not guard.feed("x = compute(1)\nx = compute(1)\ny\nx = compute(1)\n")  # broken run
    assert guard.feed("x = compute(1)\n  x = compute(1)  \nx = compute(1)\n")
    off = RepeatedLineGuard(min_chars=0, max_repeats=3)
    assert not off.feed("same line again\n" * 50)


# --- extra sampling parameters ------------------------------------------------------------------


def test_bias_and_penalties_follow_openai_and_agree_between_dicts_and_arrays() -> None:
    np = pytest.importorskip("numpy")
    from modeld.decoding.sampling import adjust, adjust_array, logprob, logprob_array

    logits = {0: 1.0, 1: 2.0, 2: 0.5, 3: -1.0}
    counts = {1: 3, 2: 1}
    kw = {
        "counts": counts,
        "logit_bias": {3: 5.0, 0: -100.0},
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    out = adjust(logits, **kw)  # type: ignore[arg-type]
    assert out == {0: -99.0, 1: 2.0 - 0.5 - 0.75, 2: 0.5 - 0.5 - 0.25, 3: 4.0}
    arr = np.array([1.0, 2.0, 0.5, -1.0], dtype=np.float32)
    adjust_array(arr, **kw)  # type: ignore[arg-type]
    assert arr.tolist() == pytest.approx([out[i] for i in range(4)])
    lp = logprob(out, 3, 2)
    assert lp.logprob == pytest.approx(lp.top[0].logprob) and [t.token for t in lp.top] == [3, 1]
    assert sum(math.exp(v) for v in (logprob(out, t, 0).logprob for t in range(4))) == pytest.approx(1.0)
    lpa = logprob_array(arr, 3, 2)
    assert lpa.logprob == pytest.approx(lp.logprob) and [t.token for t in lpa.top] == [3, 1]
    arr[0] = -np.inf  # a masked token has no probability and is never a top alternative
    assert [t.token for t in logprob_array(arr, 3, 4).top] == [3, 1, 2]


def test_a_cancelled_decode_keeps_its_reason_and_its_text() -> None:
    config = DecodeConfig(tools_json=TOOLS)
    plan = plan_decode(config, chat_template="<tool_call>")
    out = OutputProcessor(config, plan)
    shown = out.feed('Looking.\n<tool_call>\n{"name": "read_file", "argu').text
    final = out.finish("canceled")
    assert final.finish_reason == "canceled"
    assert shown + final.text == 'Looking.\n<tool_call>\n{"name": "read_file", "argu'


def test_calls_written_back_in_each_format_parse_to_the_same_calls() -> None:
    from modeld.contract import ToolCall
    from modeld.decoding.tools import format_calls

    calls = [ToolCall("call_1", "read_file", '{"path": "a.py"}'), ToolCall("call_2", "grep", '{"q": [1, 2]}')]
    for fmt in ("hermes", "llama3", "mistral"):
        parser = make_parser(fmt)
        assert parser is not None
        shown = parser.feed(format_calls(fmt, calls)).text + parser.finish().text
        assert shown.strip() == "", fmt  # all of it is calls, nothing is content
        assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in calls], fmt
    assert format_calls("hermes", []) == ""
