"""Every family's tool-call format, defined once and used three ways.

What: a :class:`ToolFormat` per family, holding the three uses of one definition:

* ``parser(schemas)``: a streaming parser of the model's output (:mod:`.toolcalls`);
* ``call(rules, tools)``: the GBNF of one call of any of ``tools``, written as the family writes
  it, to force a call under ``tool_choice`` (:func:`modeld.decoding.tools.forced_call_constraint`);
* ``write(calls)``: the text the family writes for calls, to show a model its own earlier calls
  in a history its template does not render (:func:`modeld.decoding.tools.format_calls`).

:func:`detect_format` recognises the family from the chat template's text (the most specific
markers first; a model's override wins over it: ``DecodeConfig.tool_format``, the model's
``ModelInfo.tool_format``). The table (``blueprints/0018-constraints-and-tool-calls.md``)::

    hermes        <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
                  Hermes, Qwen 2.5, Qwen3, Granite 4
    qwen3_coder   <tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>
                  Qwen3-Coder, Qwen3.5, Qwen3.6, Nemotron 3 Nano
    harmony       <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}      gpt-oss
    llama3        {"name": ..., "parameters": {...}} (after <|python_tag|>, ";" between)  Llama 3.1-3.3
    mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]       Mistral v3, Nemo
    mistral_args  [TOOL_CALLS]NAME[ARGS]{...}                                       Devstral, Magistral
    mistral_ids   [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}                            Mistral Small 3.2
    glm45         <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>   GLM 4.5, 4.6
    glm47         the same without the newlines                                     GLM 4.7
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>{...}
                  <|tool_call_end|><|tool_calls_section_end|>                       Kimi K2
    deepseek_v31  <|tool_calls_begin|><|tool_call_begin|>NAME<|tool_sep|>{...}<|tool_call_end|><|tool_calls_end|>
                  (DeepSeek's bars and underscores are U+FF5C and U+2581)             DeepSeek V3.1
    deepseek_r1   ...<|tool_call_begin|>function<|tool_sep|>NAME\\n```json\\n{...}\\n```<|tool_call_end|>...   DeepSeek R1
    minimax_m2    <minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n</invoke>\\n</minimax:tool_call>
    seed_oss      <seed:tool_call>\\n<function=NAME>\\n<parameter=K>V</parameter>\\n</function>\\n</seed:tool_call>
    nemotron      <TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>           Nemotron Nano v2
    gemma4        <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>         Gemma 4
    lfm2          <|tool_call_start|>[NAME(key="v", n=1)]<|tool_call_end|>          LFM2, LFM2.5
    granite       <|tool_call|>[{"name": ..., "arguments": {...}}]                  Granite 3.x
    command_r     <|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]<|END_ACTION|>

What not: no reasoning (:mod:`.reasoning`), no tools' definitions (:mod:`.tools`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from modeld.contract import ToolCall
from modeld.decoding import callbodies as b
from modeld.decoding.callgrammar import Rules, Tool, gemma_call, json_arguments, lit, parameters
from modeld.decoding.harmony import HarmonyParser, harmony_calls
from modeld.decoding.jsoncalls import GraniteParser, Llama3Parser, MistralParser
from modeld.decoding.toolcalls import DelimitedParser, Markup, Schemas, ToolCallParser

__all__ = ["FORMATS", "MARKERS", "ToolFormat", "detect_format", "make_parser"]


CallRule = Callable[[Rules, Sequence[Tool]], str]


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format (see the module's table)."""

    name: str
    parser: Callable[[Schemas], ToolCallParser]
    call: CallRule
    write: Callable[[Sequence[ToolCall]], str]
    detect: Callable[[str], bool]


def _args(call: ToolCall) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _json_alts(rules: Rules, tools: Sequence[Tool], head: Callable[[str], str], tail: str) -> str:
    """One alternative per tool: ``head(name)`` (literal text), its JSON arguments, ``tail``."""
    alts = []
    for i, tool in enumerate(tools):
        args = json_arguments(rules, f"t{i}-", tool.name, tool.parameters)
        alts.append(f"{lit(head(tool.name))} {args}" + (f" {lit(tail)}" if tail else ""))
    return "( " + " | ".join(alts) + " )"


def _param_alts(
    rules: Rules,
    tools: Sequence[Tool],
    head: Callable[[str], str],
    spell: Callable[[str, str], str],
    closing: str | None,
    tail: str,
    sep: str = "",
) -> str:
    alts = []
    for i, tool in enumerate(tools):
        params = parameters(rules, f"t{i}-", tool.name, tool.parameters, spell, closing, sep)
        alts.append(" ".join(p for p in (lit(head(tool.name)), params, lit(tail)) if p))
    return "( " + " | ".join(alts) + " )"


def _tags(before: str, after: str) -> Callable[[str, str], str]:
    """A parameter between markup: ``before`` (``{k}`` is the parameter's name), the value, ``after``."""
    return lambda key, value: f"{lit(before.format(k=key))} {value} {lit(after)}"


def _delimited(markup: Markup) -> Callable[[Schemas], ToolCallParser]:
    return lambda schemas: DelimitedParser(markup, schemas)


def _json_obj(name: str, args_key: str, call: ToolCall, extra: str = "") -> str:
    return (
        f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{args_key}": {call.arguments or "{}"}{extra}}}'
    )


# --- the families ------------------------------------------------------------------------------

HERMES = ToolFormat(
    "hermes",
    _delimited(Markup("<tool_call>", "</tool_call>", b.hermes_body)),
    lambda r, t: (
        lit("<tool_call>\n")
        + " "
        + _json_alts(r, t, lambda n: f'{{"name":{json.dumps(n)},"arguments":', "}")
        + " "
        + lit("\n</tool_call>")
    ),
    lambda calls: "\n".join(f"<tool_call>\n{_json_obj(c.name, 'arguments', c)}\n</tool_call>" for c in calls),
    lambda t: "<tool_call>" in t,
)

QWEN3_CODER = ToolFormat(
    "qwen3_coder",
    _delimited(
        Markup(
            "<tool_call>",
            "</tool_call>",
            b.qwen3_coder_body,
            b.function_name,
            aliases=("<function=",),
            close_optional=True,
        )
    ),
    lambda r, t: _param_alts(
        r,
        t,
        lambda n: f"<tool_call>\n<function={n}>\n",
        _tags("<parameter={k}>\n", "\n</parameter>\n"),
        "\n</parameter>",
        "</function>\n</tool_call>",
    ),
    lambda calls: "\n".join(
        f"<tool_call>\n<function={c.name}>\n"
        + "".join(f"<parameter={k}>\n{_text(v)}\n</parameter>\n" for k, v in _args(c).items())
        + "</function>\n</tool_call>"
        for c in calls
    ),
    lambda t: "<function=" in t and "<parameter=" in t and "<tool_call>" in t,
)

SEED_OSS = ToolFormat(
    "seed_oss",
    _delimited(
        Markup("<seed:tool_call>", "</seed:tool_call>", b.seed_body, b.function_name, close_optional=True)
    ),
    lambda r, t: _param_alts(
        r,
        t,
        lambda n: f"<seed:tool_call>\n<function={n}>\n",
        _tags("<parameter={k}>", "</parameter>\n"),
        "</parameter>",
        "</function>\n</seed:tool_call>",
    ),
    lambda calls: "\n".join(
        f"<seed:tool_call>\n<function={c.name}>\n"
        + "".join(f"<parameter={k}>{_text(v)}</parameter>\n" for k, v in _args(c).items())
        + "</function>\n</seed:tool_call>"
        for c in calls
    ),
    lambda t: "<seed:tool_call>" in t,
)

GLM45 = ToolFormat(
    "glm45",
    _delimited(Markup("<tool_call>", "</tool_call>", b.glm_body, b.glm_name)),
    lambda r, t: _param_alts(
        r,
        t,
        lambda n: f"<tool_call>{n}\n",
        _tags("<arg_key>{k}</arg_key>\n<arg_value>", "</arg_value>\n"),
        "</arg_value>",
        "</tool_call>",
    ),
    lambda calls: "\n".join(
        f"<tool_call>{c.name}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_text(v)}</arg_value>\n" for k, v in _args(c).items())
        + "</tool_call>"
        for c in calls
    ),
    lambda t: "<arg_key>" in t,
)

GLM47 = ToolFormat(
    "glm47",
    _delimited(Markup("<tool_call>", "</tool_call>", b.glm_body, b.glm_name)),
    lambda r, t: _param_alts(
        r,
        t,
        lambda n: f"<tool_call>{n}",
        _tags("<arg_key>{k}</arg_key><arg_value>", "</arg_value>"),
        "</arg_value>",
        "</tool_call>",
    ),
    lambda calls: "".join(
        f"<tool_call>{c.name}"
        + "".join(f"<arg_key>{k}</arg_key><arg_value>{_text(v)}</arg_value>" for k, v in _args(c).items())
        + "</tool_call>"
        for c in calls
    ),
    lambda t: "</arg_key><arg_value>" in t,  # GLM 4.7: no newlines between the tags
)

MINIMAX_M2 = ToolFormat(
    "minimax_m2",
    _delimited(
        Markup(
            '<invoke name="',
            "</invoke>",
            b.minimax_body,
            b.minimax_name,
            section=("<minimax:tool_call>", "</minimax:tool_call>"),
        )
    ),
    lambda r, t: _param_alts(
        r,
        t,
        lambda n: f'<minimax:tool_call>\n<invoke name="{n}">\n',
        _tags('<parameter name="{k}">', "</parameter>\n"),
        "</parameter>",
        "</invoke>\n</minimax:tool_call>",
    ),
    lambda calls: (
        "<minimax:tool_call>\n"
        + "".join(
            f'<invoke name="{c.name}">\n'
            + "".join(f'<parameter name="{k}">{_text(v)}</parameter>\n' for k, v in _args(c).items())
            + "</invoke>\n"
            for c in calls
        )
        + "</minimax:tool_call>"
    ),
    lambda t: "<minimax:tool_call>" in t,
)

_KIMI_ID = re.compile(r"functions\.[^\s:<]+:\d+")

KIMI_K2 = ToolFormat(
    "kimi_k2",
    _delimited(
        Markup(
            "<|tool_call_begin|>",
            "<|tool_call_end|>",
            b.kimi_body,
            b.kimi_name,
            section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
            ident=b.kimi_id,
        )
    ),
    lambda r, t: (
        lit("<|tool_calls_section_begin|><|tool_call_begin|>")
        + " "
        + _json_alts(r, t, lambda n: f"functions.{n}:0<|tool_call_argument_begin|>", "<|tool_call_end|>")
        + " "
        + lit("<|tool_calls_section_end|>")
    ),
    lambda calls: (
        "<|tool_calls_section_begin|>"
        + "".join(
            f"<|tool_call_begin|>{c.id if _KIMI_ID.fullmatch(c.id) else f'functions.{c.name}:{i}'}"
            f"<|tool_call_argument_begin|>{c.arguments or '{}'}<|tool_call_end|>"
            for i, c in enumerate(calls)
        )
        + "<|tool_calls_section_end|>"
    ),
    lambda t: "<|tool_calls_section_begin|>" in t,
)

_BAR, _LOW = "\uff5c", "\u2581"
_DS = tuple(
    "<" + _BAR + m.replace("_", _LOW) + _BAR + ">"
    for m in ("tool_calls_begin", "tool_calls_end", "tool_call_begin", "tool_call_end")
)

DEEPSEEK_V31 = ToolFormat(
    "deepseek_v31",
    _delimited(Markup(_DS[2], _DS[3], b.deepseek_v31_body, b.deepseek_v31_name, section=(_DS[0], _DS[1]))),
    lambda r, t: _json_alts(r, t, lambda n: f"{_DS[0]}{_DS[2]}{n}{b.DS_SEP}", f"{_DS[3]}{_DS[1]}"),
    lambda calls: (
        _DS[0] + "".join(f"{_DS[2]}{c.name}{b.DS_SEP}{c.arguments or '{}'}{_DS[3]}" for c in calls) + _DS[1]
    ),
    lambda t: _DS[0][2:-2] in t,
)

DEEPSEEK_R1 = ToolFormat(
    "deepseek_r1",
    _delimited(Markup(_DS[2], _DS[3], b.deepseek_r1_body, b.deepseek_r1_name, section=(_DS[0], _DS[1]))),
    lambda r, t: _json_alts(
        r, t, lambda n: f"{_DS[0]}{_DS[2]}function{b.DS_SEP}{n}\n```json\n", f"\n```{_DS[3]}{_DS[1]}"
    ),
    lambda calls: (
        _DS[0]
        + "".join(
            f"{_DS[2]}function{b.DS_SEP}{c.name}\n```json\n{c.arguments or '{}'}\n```{_DS[3]}" for c in calls
        )
        + _DS[1]
    ),
    lambda t: _DS[0][2:-2] in t and "```json" in t,
)

NEMOTRON = ToolFormat(
    "nemotron",
    _delimited(Markup("<TOOLCALL>", "</TOOLCALL>", b.json_list_body)),
    lambda r, t: _json_alts(
        r, t, lambda n: f'<TOOLCALL>[{{"name":{json.dumps(n)},"arguments":', "}]</TOOLCALL>"
    ),
    lambda calls: (
        "<TOOLCALL>[" + ", ".join(_json_obj(c.name, "arguments", c) for c in calls) + "]</TOOLCALL>"
    ),
    lambda t: "<TOOLCALL>" in t,
)

COMMAND_R = ToolFormat(
    "command_r",
    _delimited(Markup("<|START_ACTION|>", "<|END_ACTION|>", b.command_r_body)),
    lambda r, t: _json_alts(
        r,
        t,
        lambda n: f'<|START_ACTION|>[{{"tool_call_id":"0","tool_name":{json.dumps(n)},"parameters":',
        "}]<|END_ACTION|>",
    ),
    lambda calls: (
        "<|START_ACTION|>[\n"
        + ",\n".join(
            f'    {{"tool_call_id": "{i}", "tool_name": {json.dumps(c.name)}, "parameters": {c.arguments or "{}"}}}'
            for i, c in enumerate(calls)
        )
        + "\n]<|END_ACTION|>"
    ),
    lambda t: "<|START_ACTION|>" in t,
)

GRANITE = ToolFormat(
    "granite",
    lambda schemas: GraniteParser(),
    lambda r, t: _json_alts(r, t, lambda n: f'<|tool_call|>[{{"name":{json.dumps(n)},"arguments":', "}]"),
    lambda calls: "<|tool_call|>[" + ", ".join(_json_obj(c.name, "arguments", c) for c in calls) + "]",
    lambda t: "<|tool_call|>" in t,
)


GEMMA4 = ToolFormat(
    "gemma4",
    _delimited(Markup("<|tool_call>", "<tool_call|>", b.gemma4_body, b.gemma4_name)),
    gemma_call,
    lambda calls: "".join(f"<|tool_call>call:{c.name}{b.gemma_literal(_args(c))}<tool_call|>" for c in calls),
    lambda t: "<|tool_call>" in t,
)


LFM2 = ToolFormat(
    "lfm2",
    _delimited(Markup("<|tool_call_start|>", "<|tool_call_end|>", b.lfm2_body, b.lfm2_name)),
    lambda r, t: _param_alts(
        r,
        t,
        lambda n: f"<|tool_call_start|>[{n}(",
        lambda k, v: f"{lit(k + '=')} {v}",
        None,
        ")]<|tool_call_end|>",
        ", ",
    ),
    lambda calls: (
        "<|tool_call_start|>["
        + ", ".join(
            f"{c.name}(" + ", ".join(f"{k}={b.python_literal(v)}" for k, v in _args(c).items()) + ")"
            for c in calls
        )
        + "]<|tool_call_end|>"
    ),
    lambda t: "<|tool_call_start|>" in t or "List of tools: " in t or "<|tool_list_start|>" in t,
)

HARMONY = ToolFormat(
    "harmony",
    lambda schemas: HarmonyParser(),
    lambda r, t: _json_alts(
        r, t, lambda n: f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>", ""
    ),
    lambda calls: harmony_calls(list(calls)),
    lambda t: "<|channel|>" in t,
)

LLAMA3 = ToolFormat(
    "llama3",
    lambda schemas: Llama3Parser(),
    lambda r, t: _json_alts(r, t, lambda n: f'{{"name":{json.dumps(n)},"parameters":', "}"),
    lambda calls: "; ".join(_json_obj(c.name, "parameters", c) for c in calls),
    lambda t: "<|python_tag|>" in t or ("<|start_header_id|>" in t and "parameters" in t),
)

MISTRAL = ToolFormat(
    "mistral",
    lambda schemas: MistralParser(),
    lambda r, t: (
        lit("[TOOL_CALLS][")
        + " "
        + _json_alts(r, t, lambda n: f'{{"name":{json.dumps(n)},"arguments":', "}")
        + " "
        + lit("]")
    ),
    lambda calls: (
        "[TOOL_CALLS]["
        + ", ".join(
            _json_obj(c.name, "arguments", c, f', "id": {json.dumps(c.id)}' if c.id else "") for c in calls
        )
        + "]"
    ),
    lambda t: "[TOOL_CALLS]" in t,
)

MISTRAL_ARGS = ToolFormat(
    "mistral_args",
    lambda schemas: MistralParser(),
    lambda r, t: _json_alts(r, t, lambda n: f"[TOOL_CALLS]{n}[ARGS]", ""),
    lambda calls: "".join(f"[TOOL_CALLS]{c.name}[ARGS]{c.arguments or '{}'}" for c in calls),
    lambda t: "[TOOL_CALLS]" in t and "[ARGS]" in t,
)


def _mistral_id(call: ToolCall) -> str:
    return (
        call.id
        if re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
        else re.sub(r"[^A-Za-z0-9]", "", call.id)[-9:].rjust(9, "0")
    )


MISTRAL_IDS = ToolFormat(
    "mistral_ids",
    lambda schemas: MistralParser(),
    lambda r, t: _mistral_ids_call(r, t),
    lambda calls: "".join(
        f"[TOOL_CALLS]{c.name}[CALL_ID]{_mistral_id(c)}[ARGS]{c.arguments or '{}'}" for c in calls
    ),
    lambda t: "[TOOL_CALLS]" in t and "[ARGS]" in t and "[CALL_ID]" in t,
)


def _mistral_ids_call(rules: Rules, tools: Sequence[Tool]) -> str:
    alts = []
    for i, tool in enumerate(tools):
        args = json_arguments(rules, f"t{i}-", tool.name, tool.parameters)
        alts.append(f"{lit(f'[TOOL_CALLS]{tool.name}[CALL_ID]')} [A-Za-z0-9]{{9}} {lit('[ARGS]')} {args}")
    return "( " + " | ".join(alts) + " )"


MARKERS: frozenset[str] = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        "<|channel|>",
        "<|constrain|>",
        "<|message|>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        *_DS,
        b.DS_SEP,
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        "<seed:tool_call>",
        "</seed:tool_call>",
        "<TOOLCALL>",
        "</TOOLCALL>",
        "<|tool_call>",
        "<tool_call|>",
        b.GEMMA_QUOTE,
        "<|tool_call_start|>",
        "<|tool_call|>",
        "<|START_ACTION|>",
        "<|END_ACTION|>",
        "</think>",
        "</seed:think>",
        "[/THINK]",
        "<|END_THINKING|>",
        "<channel|>",
    }
)
"""The families' markers a vocabulary may hold as tokens of their own (special or added): the
forcing grammars write them as text, and a backend that keeps special tokens out of grammar
text must let these through (``backends/llama_constraints.py``), so a forced call is written
with the model's own marker tokens, as it writes calls unforced and as its template's text is
tokenized in the next turn's history."""

# Detection order: the most specific markers first (several families share <tool_call>).
FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        HARMONY,
        KIMI_K2,
        DEEPSEEK_R1,
        DEEPSEEK_V31,
        GEMMA4,
        LFM2,
        MINIMAX_M2,
        SEED_OSS,
        GLM47,
        GLM45,
        QWEN3_CODER,
        NEMOTRON,
        COMMAND_R,
        GRANITE,
        MISTRAL_IDS,
        MISTRAL_ARGS,
        MISTRAL,
        HERMES,
        LLAMA3,
    )
}


def detect_format(chat_template: str) -> str:
    """The tool-call format a chat template writes, or ``""`` if not recognised."""
    for fmt in FORMATS.values():
        if fmt.detect(chat_template):
            return fmt.name
    return ""


def make_parser(fmt: str, schemas: Schemas | None = None) -> ToolCallParser | None:
    """A fresh parser for one decode's output (``schemas``: tool name -> parameters schema, for
    the families whose values are untyped text), or None for ``none``/unknown formats."""
    family = FORMATS.get(fmt)
    return family.parser(schemas or {}) if family is not None else None
