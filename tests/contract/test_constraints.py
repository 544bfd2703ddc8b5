"""The contract suite for constrained output, tool calls, signals and the loop guard.

Runs against every implementation (in process and over the wire) that lists the constraint
kinds in ``Capabilities.constraints``; until the decode loop and a backend are wired to
``modeld.decoding`` (``blueprints/0018``), the tests skip with that reason. On the generated
random-weight models free text is garbage, so output that parses and validates shows the
constraint at work, not the model.
"""

from __future__ import annotations

import json
import re

import pytest
from harness import Harness

from modeld.contract import Constraint, DecodeConfig, PrefixInput, Session, StreamChunk, SuffixInput
from modeld.errors import InvalidArgumentError, UnsupportedError

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["fix", "skip", "ask"]},
        "file": {"type": "string", "minLength": 1, "maxLength": 24},
        "line": {"type": "integer", "minimum": 1, "maximum": 9999},
        "risky": {"type": "boolean"},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["verdict", "file", "line"],
    "additionalProperties": False,
}
TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 30}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        }
    ]
)
EXIT_TOOLS = json.dumps(
    [
        {
            "name": "NEEDS_EXTERNAL_INFO",
            "parameters": {
                "type": "object",
                "properties": {"what": {"type": "string", "maxLength": 20}},
                "required": ["what"],
                "additionalProperties": False,
            },
        }
    ]
)


def needs(h: Harness, session: Session, *kinds: str) -> None:
    have = session.info.capabilities.constraints
    if not set(kinds) <= set(have):
        pytest.skip(
            f"{h.name} enforces {have or 'no'} constraints yet (decode-loop integration, blueprints/0018)"
        )


def decode(session: Session, config: DecodeConfig) -> list[StreamChunk]:
    with session.decode(config) as stream:
        return list(stream)


def runs(h: Harness) -> int:
    return 200 if h.name in ("memory-local", "llama-local") else 20


def test_schema_constrained_decodes_all_parse_and_validate(harness: Harness) -> None:
    with harness.open() as s:
        needs(harness, s, "json_schema")
        answers = set()
        for seed in range(runs(harness)):
            s.ensure_prefix(
                PrefixInput(text="Review the patch and answer in JSON.\n")
            )  # drops the last answer
            s.prefill_suffix(SuffixInput(text="The test in tests/test_app.py fails.\n"))
            config = DecodeConfig(
                max_tokens=800,
                temperature=1.0,
                seed=seed,
                constraint=Constraint("json_schema", json.dumps(SCHEMA)),
            )
            chunks = decode(s, config)
            text = "".join(c.text for c in chunks)
            assert chunks[-1].finish_reason == "stop", (seed, text)
            jsonschema.validate(json.loads(text), SCHEMA)
            answers.add(text)
        assert len(answers) > runs(harness) // 4  # seeds change the (valid) answers


def test_a_regex_constraint_always_matches(harness: Harness) -> None:
    pattern = r"(PASS|FAIL) [a-z_]{3,12}\.py:[1-9][0-9]{0,3}"
    with harness.open() as s:
        needs(harness, s, "regex")
        for seed in range(20):
            s.ensure_prefix(PrefixInput(text="Which test failed?\n"))
            chunks = decode(
                s,
                DecodeConfig(
                    max_tokens=60, temperature=1.0, seed=seed, constraint=Constraint("regex", pattern)
                ),
            )
            assert chunks[-1].finish_reason == "stop"
            assert re.fullmatch(pattern, "".join(c.text for c in chunks))


def test_tool_choice_required_always_yields_a_parsed_call_with_valid_arguments(harness: Harness) -> None:
    with harness.open(prompt_format="chat") as s:
        needs(harness, s, "grammar")
        schema = json.loads(TOOLS)[0]["function"]["parameters"]
        for seed in range(20):
            s.ensure_prefix(PrefixInput(text="You can read files.\n", tools_json=TOOLS))
            s.prefill_suffix(SuffixInput(text="Open the config.\n"))
            chunks = decode(
                s, DecodeConfig(max_tokens=400, temperature=1.0, seed=seed, tool_choice="required")
            )
            final = chunks[-1]
            assert final.finish_reason == "tool_calls"
            assert [c.name for c in final.tool_calls] == ["read_file"]
            jsonschema.validate(json.loads(final.tool_calls[0].arguments), schema)
            assert "".join(c.text for c in chunks) == ""  # the call is not content
            assert final.tool_text.startswith("<tool_call>")


def test_an_exit_tool_forced_by_tool_choice_becomes_a_signal(harness: Harness) -> None:
    with harness.open(prompt_format="chat") as s:
        needs(harness, s, "grammar")
        s.ensure_prefix(PrefixInput(text="Ask when unsure.\n", tools_json=TOOLS))
        s.prefill_suffix(SuffixInput(text="What is the deploy password?\n"))
        chunks = decode(
            s, DecodeConfig(max_tokens=400, exit_tools_json=EXIT_TOOLS, tool_choice="NEEDS_EXTERNAL_INFO")
        )
        final = chunks[-1]
        assert final.finish_reason == "signal"
        assert final.signal is not None and final.signal.name == "NEEDS_EXTERNAL_INFO"
        assert set(json.loads(final.signal.arguments)) == {"what"}
        assert final.tool_calls == ()


def test_a_grammar_that_forces_a_repeated_line_is_stopped_by_the_guard(harness: Harness) -> None:
    line = "self.assertEqual(result, expected)\n"
    grammar = f"root ::= ({json.dumps(line)}){{30}}"
    with harness.open() as s:
        needs(harness, s, "grammar")
        s.ensure_prefix(PrefixInput(text="Write the test.\n"))
        chunks = decode(s, DecodeConfig(max_tokens=600, constraint=Constraint("grammar", grammar)))
        assert chunks[-1].finish_reason == "repeated_line"
        assert "".join(c.text for c in chunks).count(line) == 8
        off = decode(
            s, DecodeConfig(max_tokens=1200, repeated_line_max=0, constraint=Constraint("grammar", grammar))
        )
        assert off[-1].finish_reason == "stop"


def test_invalid_schemas_and_grammars_are_refused_with_positions(harness: Harness) -> None:
    with harness.open() as s:
        needs(harness, s, "json_schema", "grammar")
        s.ensure_prefix(PrefixInput(text="x"))
        with pytest.raises(InvalidArgumentError) as err:
            decode(
                s,
                DecodeConfig(constraint=Constraint("json_schema", '{"type": "object",\n  "properties": [}')),
            )
        assert (err.value.details["line"], err.value.details["column"]) == ("2", "18")
        with pytest.raises(InvalidArgumentError) as err:
            decode(s, DecodeConfig(constraint=Constraint("grammar", 'root ::= "a" missing')))
        assert err.value.details["column"] == "14"
        with pytest.raises(UnsupportedError):
            decode(s, DecodeConfig(constraint=Constraint("json_schema", '{"not": {"type": "null"}}')))
        assert decode(s, DecodeConfig(max_tokens=2))[-1].finish_reason in ("length", "stop")  # still usable


def test_a_backend_refuses_what_it_cannot_enforce(harness: Harness) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text="x"))
        missing = [
            k for k in ("json", "json_schema", "regex", "grammar") if k not in s.info.capabilities.constraints
        ]
        for kind in missing:
            with pytest.raises(UnsupportedError) as err:
                decode(s, DecodeConfig(constraint=Constraint(kind, "" if kind == "json" else "a")))
            assert err.value.field == "constraint.kind"
