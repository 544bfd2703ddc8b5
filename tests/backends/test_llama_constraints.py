"""llama.cpp glue for constraints, driven through llama-cpp-python's low-level API on TINY.

Random weights make free text garbage, so a constrained decode that parses and validates is a
strong check that the mask (not the model) produced it. The decode loop here is the minimal
one the backend runs: evaluate, mask the context's logits in place, argmax, accept.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.llama

jsonschema = pytest.importorskip("jsonschema")
np = pytest.importorskip("numpy")
_llama = pytest.importorskip("llama_cpp")

from modeld.backends.llama_constraints import LlamaConstraints  # noqa: E402
from modeld.contract import Constraint, DecodeConfig  # noqa: E402
from modeld.decoding.constraints import ConstraintFailed, compile_constraint  # noqa: E402
from modeld.decoding.output import OutputProcessor, plan_decode  # noqa: E402
from modeld.testmodels import TINY, ensure_model  # noqa: E402

TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["read_file", "write_file", "run_tests"]},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 24},
                "line": {"type": "integer", "minimum": 1, "maximum": 5000},
                "dry_run": {"type": "boolean"},
            },
            "required": ["path", "line"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


class Tiny:
    """TINY loaded with the low-level API: one context, greedy decoding with a constraint."""

    def __init__(self) -> None:
        _llama.llama_backend_init()
        self.model = _llama.llama_model_load_from_file(
            str(ensure_model(TINY)).encode(), _llama.llama_model_default_params()
        )
        params = _llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.no_perf = 512, 128, 128, True
        self.ctx = _llama.llama_init_from_model(self.model, params)
        self.vocab = _llama.llama_model_get_vocab(self.model)
        self.n_vocab = _llama.llama_vocab_n_tokens(self.vocab)
        self.mem = _llama.llama_get_memory(self.ctx)

    def close(self) -> None:
        _llama.llama_free(self.ctx)
        _llama.llama_model_free(self.model)

    def _eval(self, tokens: list[int]) -> None:
        arr = (_llama.llama_token * len(tokens))(*tokens)
        assert _llama.llama_decode(self.ctx, _llama.llama_batch_get_one(arr, len(tokens))) == 0

    def piece(self, token: int) -> bytes:
        buf = (ctypes_char := __import__("ctypes").create_string_buffer(64))
        n = _llama.llama_token_to_piece(self.vocab, token, ctypes_char, 64, 0, False)
        return buf.raw[:n]

    def decode(
        self,
        prompt: list[int],
        constraints: LlamaConstraints,
        compiled: Any,
        max_tokens: int,
        seed: int | None = None,
    ) -> tuple[bytes, str]:
        """Greedy (argmax) decode, or with ``seed`` llama.cpp's temperature-1 sampler chain,
        which reads the masked logits from the context's buffer as the backend's does."""
        _llama.llama_memory_clear(self.mem, True)
        self._eval(prompt)
        tc = constraints.start(compiled)
        chain = None
        if seed is not None:
            chain = _llama.llama_sampler_chain_init(_llama.llama_sampler_chain_default_params())
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_temp(1.0))
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_dist(seed))
        out = b""
        try:
            for _ in range(max_tokens):
                logits = np.ctypeslib.as_array(
                    _llama.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)
                )
                tc.apply(logits)
                if chain is None:
                    token = int(np.argmax(logits))
                else:
                    token = int(_llama.llama_sampler_sample(chain, self.ctx, -1))
                tc.accept(token)
                if _llama.llama_vocab_is_eog(self.vocab, token):
                    return out, "stop"
                out += self.piece(token)
                self._eval([token])
            return out, "length"
        finally:
            tc.close()
            if chain is not None:
                _llama.llama_sampler_free(chain)


@pytest.fixture(scope="module")
def tiny() -> Iterator[Tiny]:
    t = Tiny()
    yield t
    t.close()


def prompts(n: int) -> Iterator[list[int]]:
    """Seeded random prompts of 8-40 ordinary tokens (ids below the control tokens)."""
    for seed in range(n):
        rng = random.Random(seed)
        yield [rng.randrange(0, 4000) for _ in range(rng.randrange(8, 40))]


@pytest.mark.parametrize("engine", ["llguidance", "grammar"])
def test_fifty_greedy_decodes_under_a_tool_call_schema_all_parse_and_validate(
    tiny: Tiny, engine: str
) -> None:
    constraints = LlamaConstraints(tiny.vocab, tiny.n_vocab, engine=engine)
    compiled = compile_constraint(Constraint("json_schema", json.dumps(TOOL_CALL_SCHEMA)))
    outputs = set()
    for prompt in prompts(50):
        text, finish = tiny.decode(prompt, constraints, compiled, max_tokens=120)
        assert finish == "stop", text  # the grammar completed and only the end token was allowed
        document = json.loads(text.decode("utf-8"))
        jsonschema.validate(document, TOOL_CALL_SCHEMA)
        outputs.add(text)
    assert len(outputs) > 10  # different prompts, different (valid) answers: the model still chooses


def test_two_hundred_sampled_decodes_with_different_seeds_all_validate(tiny: Tiny) -> None:
    constraints = LlamaConstraints(tiny.vocab, tiny.n_vocab)
    compiled = compile_constraint(Constraint("json_schema", json.dumps(TOOL_CALL_SCHEMA)))
    prompt = next(prompts(1))
    outputs = set()
    for seed in range(200):
        text, finish = tiny.decode(prompt, constraints, compiled, max_tokens=200, seed=seed)
        assert finish == "stop", (seed, text)
        jsonschema.validate(json.loads(text.decode("utf-8")), TOOL_CALL_SCHEMA)
        outputs.add(text)
    assert len(outputs) > 150  # one prompt, 200 seeds: the sampler really chose


def test_tool_choice_required_always_yields_a_parsed_call_with_valid_arguments(tiny: Tiny) -> None:
    tools_json = json.dumps(
        [
            {"name": "read_file", "parameters": TOOL_CALL_SCHEMA["properties"]["arguments"]},  # type: ignore[index]
            {"name": "LOW_CONFIDENCE", "parameters": {"type": "object", "additionalProperties": False}},
        ]
    )
    config = DecodeConfig(tools_json=tools_json, tool_choice="required")
    plan = plan_decode(config, chat_template="<tool_call>")
    assert plan.constraint is not None
    constraints = LlamaConstraints(tiny.vocab, tiny.n_vocab)
    names = set()
    for seed in range(30):
        text, finish = tiny.decode(next(prompts(1)), constraints, plan.constraint, max_tokens=200, seed=seed)
        assert finish == "stop"
        processor = OutputProcessor(config, plan)
        step = processor.feed(text.decode("utf-8"))
        final = processor.finish(step.stop or "stop")
        assert final.finish_reason == "tool_calls" and len(final.tool_calls) == 1
        call = final.tool_calls[0]
        if call.name == "read_file":
            jsonschema.validate(json.loads(call.arguments), TOOL_CALL_SCHEMA["properties"]["arguments"])  # type: ignore[index]
        else:
            assert json.loads(call.arguments) == {}
        names.add(call.name)
    assert names == {"read_file", "LOW_CONFIDENCE"}


def test_a_regex_constraint_always_matches(tiny: Tiny) -> None:
    pattern = r"(ok|fail): [a-z]{2,8}( [0-9]{1,3})?"
    constraints = LlamaConstraints(tiny.vocab, tiny.n_vocab)
    compiled = compile_constraint(Constraint("regex", pattern))
    for prompt in prompts(20):
        text, finish = tiny.decode(prompt, constraints, compiled, max_tokens=40)
        assert finish == "stop"
        assert re.fullmatch(pattern, text.decode("utf-8")), text


@pytest.mark.parametrize("engine", ["llguidance", "grammar"])
def test_a_token_the_mask_refused_fails_the_constraint(tiny: Tiny, engine: str) -> None:
    # The decode loop must never pick a masked token; if something does (a sampler bug), the
    # constraint reports it instead of letting invalid output through.
    constraints = LlamaConstraints(tiny.vocab, tiny.n_vocab, engine=engine)
    tc = constraints.start(compile_constraint(Constraint("regex", "[0-9]+")))
    logits = np.zeros(tiny.n_vocab, dtype=np.float32)
    tc.apply(logits)
    assert np.isfinite(logits[ord("7")]) and not np.isfinite(logits[ord("x")])  # byte tokens: id == byte
    tc.accept(ord("7"))
    if engine == "llguidance":
        with pytest.raises(ConstraintFailed):
            tc.accept(ord("x"))
    tc.close()
