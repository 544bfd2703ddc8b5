"""Each family's reasoning format: thinking split from the answer (whole and streamed at every
cut point), recognised from the template, the prompt's own opener read from the rendered prompt
(never guessed from the template's text), markup inside the thinking never parsed as a call.

Outputs are written here after the families' templates and llama.cpp's ``tests/test-chat.cpp``.
"""

from __future__ import annotations

import json

import pytest

from modeld.contract import DecodeConfig
from modeld.decoding.output import OutputProcessor, plan_decode
from modeld.decoding.reasoning import REASONING_FORMATS, detect_reasoning, make_splitter

SPLITS = [
    # (family, output, reasoning, answer)
    (
        "think",
        "<think>I'm\nthinking</think>\n\nHello, world!\nWhat's up?",
        "I'm\nthinking",
        "Hello, world!\nWhat's up?",
    ),
    ("think", "<think>\nI'm thinking\n</think>", "I'm thinking\n", ""),
    ("think", "No thinking here: <think> is a tag.", "", "No thinking here: <think> is a tag."),
    ("think", "  <think></think>Answer", "", "Answer"),
    (
        "seed",
        "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!",
        "I'm thinking about the answer",
        "Hello, world!",
    ),
    ("magistral", "[THINK]Hmm.[/THINK]Yes.", "Hmm.", "Yes."),
    ("granite", "<think>Plan.</think><response>Done.</response>", "Plan.", "Done."),
    (
        "command_r",
        "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hello, world!<|END_RESPONSE|>",
        "I'm\nthinking",
        "Hello, world!",
    ),
    ("gemma4", "<|channel>thought\nI'm\nthinking<channel|>Hello, world!", "I'm\nthinking", "Hello, world!"),
    (
        "harmony",
        "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hello, world!",
        "I'm\nthinking",
        "Hello, world!",
    ),
    (
        "harmony",  # a preamble on the commentary channel is shown; a stray header is dropped
        "<|channel|>commentary to=assistant<|channel|>analysis<|message|>A<|end|><|start|>assistant"
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>B",
        "A",
        "Checking.B",
    ),
    (
        "harmony",  # a built-in tool's message (no such function) shows nothing
        "<|channel|>analysis<|message|>Run it.<|end|><|start|>assistant<|channel|>commentary to=python "
        "<|constrain|>code<|message|>print(1)",
        "Run it.",
        "",
    ),
]


def split(family: str, pieces: list[str]) -> tuple[str, str]:
    splitter = make_splitter(REASONING_FORMATS[family])
    reasoning = answer = ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize(("family", "output", "reasoning", "answer"), SPLITS)
def test_each_family_splits_whole_and_streamed_at_every_cut_point(
    family: str, output: str, reasoning: str, answer: str
) -> None:
    for pieces in [[output], list(output), *([output[:i], output[i:]] for i in range(1, len(output)))]:
        assert split(family, pieces) == (reasoning, answer), pieces


TEMPLATES = {
    "think": "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}{{ '</think>' }}",
    "seed": "<seed:bos>{{ '<seed:think>' }}...{{ '</seed:think>' }}",
    "magistral": "[SYSTEM_PROMPT]...[THINK]...[/THINK]",
    "granite": "<|start_of_role|>assistant<|end_of_role|><think>...</think><response>...</response>",
    "command_r": "<|START_THINKING|>...<|END_THINKING|>",
    "gemma4": "{{ '<|channel>thought' }}...{{ '<channel|>' }}",
    "harmony": "<|start|>assistant<|channel|>analysis<|message|>",
}


def test_each_reasoning_family_is_recognised_from_its_template() -> None:
    assert set(TEMPLATES) == set(REASONING_FORMATS)
    for family, template in TEMPLATES.items():
        found = detect_reasoning(template)
        assert found is not None and found.name == family, family
    assert detect_reasoning("{{ messages }}") is None


QWEN3_GENERATION = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def test_the_opener_is_read_from_the_rendered_prompt_not_from_the_template() -> None:
    """Qwen3's generation block holds <think> only in its thinking-off branch: a turn-1 answer
    was taken for reasoning ("Understood." as reasoning_content, empty content)."""
    think = REASONING_FORMATS["think"]
    assert think.opened_by("<|im_start|>assistant\n") == ""  # Qwen3, thinking on: the model opens it
    assert think.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ""  # thinking off
    assert think.opened_by("<|im_start|>assistant\n<think>\n") == "<think>\n"  # Qwen3.5: opened
    assert REASONING_FORMATS["harmony"].opened_by("<|start|>assistant") == ""
    plan = plan_decode(DecodeConfig(), chat_template=QWEN3_GENERATION, prompt_tail="<|im_start|>assistant\n")
    out = OutputProcessor(DecodeConfig(), plan)
    shown = out.feed("Understood.").text + out.finish("stop").text
    assert shown == "Understood."
    splitter = make_splitter(REASONING_FORMATS["think"])
    assert splitter.feed(shown) == ("", "Understood.")


def test_an_output_that_starts_inside_the_thinking_begins_with_the_prompts_opener() -> None:
    """The text is the assistant turn whole: the opener the prompt ended with, then the output."""
    plan = plan_decode(
        DecodeConfig(), chat_template=TEMPLATES["think"], prompt_tail="<|im_start|>assistant\n<think>\n"
    )
    assert plan.opened == "<think>\n"
    out = OutputProcessor(DecodeConfig(), plan)
    shown = (
        out.feed("Reading the request</think>\n\n").text
        + out.feed("Understood.").text
        + out.finish("stop").text
    )
    assert shown == "<think>\nReading the request</think>\n\nUnderstood."
    splitter = make_splitter(REASONING_FORMATS["think"])
    r, a = splitter.feed(shown)
    r2, a2 = splitter.finish()
    assert (r + r2, a + a2) == ("Reading the request", "Understood.")
    nothing = OutputProcessor(DecodeConfig(), plan)
    assert nothing.finish("length").text == "<think>\n"  # no token: the opener is still the turn's


TOOLS = json.dumps(
    [{"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
)


def test_markup_inside_the_thinking_is_never_a_call() -> None:
    template = TEMPLATES["think"] + "<tool_call>"
    plan = plan_decode(
        DecodeConfig(tools_json=TOOLS), chat_template=template, prompt_tail="assistant\n<think>\n"
    )
    assert plan.tool_format == "hermes"
    out = OutputProcessor(DecodeConfig(tools_json=TOOLS), plan)
    text = ""
    for piece in [
        "I could write <tool_call>\n{",
        '"name": "read_file", "arguments": {}}\n</tool_call> here.</think>\n\n',
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>',
    ]:
        text += out.feed(piece).text
    final = out.finish("stop")
    assert final.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in final.tool_calls] == [("read_file", {"path": "a"})]
    assert text + final.text == (
        '<think>\nI could write <tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call> here.</think>\n\n'
    )


def test_a_forced_call_after_an_opened_thinking_block_closes_it_and_parses() -> None:
    template = TEMPLATES["think"] + "<tool_call>"
    config = DecodeConfig(tools_json=TOOLS, tool_choice="read_file")
    plan = plan_decode(config, chat_template=template, prompt_tail="assistant\n<think>\n")
    assert plan.constraint is not None and plan.constraint.gbnf.startswith('root ::= "</think>\\n\\n" ')
    out = OutputProcessor(config, plan)
    shown = out.feed(
        '</think>\n\n<tool_call>\n{"name":"read_file","arguments":{"path":"x"}}\n</tool_call>'
    ).text
    final = out.finish("stop")
    assert final.finish_reason == "tool_calls" and shown + final.text == "<think>\n</think>\n\n"


def test_a_call_cut_off_at_its_start_marker_never_leaks_it() -> None:
    """The cut point that leaked ``<tool_call`` into the content: max_tokens inside the marker."""
    config = DecodeConfig(tools_json=TOOLS)
    plan = plan_decode(config, chat_template="<tool_call>")
    for cut in range(1, len("<tool_call>")):
        out = OutputProcessor(config, plan)
        shown = out.feed("Let me look.\n" + "<tool_call>"[:cut]).text
        final = out.finish("length")
        assert shown + final.text == "Let me look.\n", cut
        assert final.finish_reason == "length" and final.tool_text == "<tool_call>"[:cut]
