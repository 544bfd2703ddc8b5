"""A forced call is written with the model's own marker token, on llama.cpp.

Real vocabularies hold the families' markers as tokens of their own (Qwen's ``<tool_call>`` is an
added token, gpt-oss's ``<|channel|>`` a control token). The forcing grammar writes markers as
text; llguidance's view of the vocabulary keeps special tokens out of grammar text (an
end-of-generation token inside a JSON string would end the decode), and so the call was spelled
``<``, ``tool``, ``_call``, ``>``: tokens the model was not trained to write there, and not the
ones the next turn's history (its template's text, tokenized) holds. Worse, llguidance's lexer
takes the literal's canonical tokens (the marker token) and found none allowed: before this,
a forced call on such a vocabulary ended at once, ``constraint_failed`` with no token written.
The families' markers are now let through (``decoding.formats.MARKERS``), unless they end
generation.

The model: the generated tiny llama model (random weights, ChatML with Hermes tool calls), its
last merged token replaced by an added token ``<tool_call>`` (and that merge dropped), in the
in-process engine. Random weights do not prefer the marker token as a trained model does, so
the test biases it (``logit_bias``): the grammar decides whether it may be written at all.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from gguf_craft import load

from modeld.contract import Config, DecodeConfig, OpenSessionRequest
from modeld.engine import Engine
from modeld.testmodels import TINY, ensure_model
from runtime_client import ContextBuilder

pytestmark = pytest.mark.llama

USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED
TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "maxLength": 12}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        }
    ]
)


@pytest.fixture(scope="module")
def model() -> Iterator[tuple[Path, int]]:
    tmp = Path(tempfile.mkdtemp(prefix="mdtok"))
    tiny = load(ensure_model(TINY))
    tokens = list(tiny.get("tokenizer.ggml.tokens").value)
    types = list(tiny.get("tokenizer.ggml.token_type").value)
    merges = list(tiny.get("tokenizer.ggml.merges").value)
    # The vocabulary lays out one token per merge, in merge order, before the control tokens:
    # the last merge makes the last token before them.
    last = len(tokens) - 4
    assert merges[-1].replace(b" ", b"") == tokens[last]
    tokens[last], types[last] = b"<tool_call>", USER_DEFINED
    path = (
        tiny.set("tokenizer.ggml.tokens", tokens)
        .set("tokenizer.ggml.token_type", types)
        .set("tokenizer.ggml.merges", merges[:-1])
        .write(tmp / "tiny-marker.gguf")
    )
    try:
        yield path, last
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("bias", [0.0, 30.0])
def test_a_forced_call_writes_the_models_own_marker_token(model: tuple[Path, int], bias: float) -> None:
    path, marker = model
    engine = Engine(backends=("llama",))
    try:
        request = OpenSessionRequest(
            type="llama", path=str(path), config=Config(num_ctx=1024, prompt_format="chat")
        )
        with engine.open_session(request) as session:
            ctx = (
                ContextBuilder(identity=session.identity, tools_json=TOOLS)
                .system("You read files.\n")
                .user_turn("Open the config.\n")
                .build()
            )
            session.ensure_prefix(ctx.prefix_input())
            session.prefill_suffix(ctx.suffix_input())
            config = DecodeConfig(
                max_tokens=80, tool_choice="read_file", logit_bias={marker: bias} if bias else {}
            )
            chunks = list(session.decode(config))
    finally:
        engine.shutdown()
    tokens = [t for c in chunks for t in c.token_ids]
    final = chunks[-1]
    assert final.finish_reason == "tool_calls", final
    assert [c.name for c in final.tool_calls] == ["read_file"]
    assert final.tool_text.startswith("<tool_call>\n{")
    if bias:
        assert tokens[0] == marker  # the call opens with the model's own <tool_call> token
