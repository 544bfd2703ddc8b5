"""OpenVINO glue: the compiled GBNF through StructuredOutputConfig on TINY (random weights)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.openvino

jsonschema = pytest.importorskip("jsonschema")
og = pytest.importorskip("openvino_genai")
np = pytest.importorskip("numpy")
ov = pytest.importorskip("openvino")

from modeld.backends.openvino_constraints import CONSTRAINTS, apply_sampling  # noqa: E402
from modeld.contract import Constraint, DecodeConfig  # noqa: E402
from modeld.decoding.constraints import compile_constraint  # noqa: E402
from modeld.errors import UnsupportedError  # noqa: E402
from modeld.testmodels import TINY, ensure_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["read_file", "run_tests"]},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 20},
                "line": {"type": "integer", "minimum": 1},
            },
            "required": ["path", "line"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def test_every_constraint_kind_maps_onto_structured_output() -> None:
    assert CONSTRAINTS == ("json", "json_schema", "regex", "grammar")


def test_schema_constrained_greedy_decodes_validate() -> None:
    pipe = og.LLMPipeline(str(ensure_model(TINY)), "CPU", INFERENCE_PRECISION_HINT="f32")
    compiled = compile_constraint(Constraint("json_schema", json.dumps(SCHEMA)))
    answers = set()
    for seed in range(6):
        gen = og.GenerationConfig()
        gen.max_new_tokens = 120
        gen.do_sample = False
        apply_sampling(gen, DecodeConfig(), compiled)
        prompt = ov.Tensor(np.array([[4093, 100 + 37 * seed, 700 + seed, 33]], dtype=np.int64))
        result = pipe.generate(prompt, gen)
        text = pipe.get_tokenizer().decode(list(result.tokens[0]))
        jsonschema.validate(json.loads(text), SCHEMA)
        answers.add(text)
    assert len(answers) >= 2


def test_logit_bias_and_logprobs_are_refused_and_penalties_are_passed() -> None:
    gen = og.GenerationConfig()
    apply_sampling(gen, DecodeConfig(presence_penalty=0.5, frequency_penalty=0.25))
    assert (gen.presence_penalty, gen.frequency_penalty) == (0.5, 0.25)
    for config, field in (
        (DecodeConfig(logit_bias={5: 1.0}), "logit_bias"),
        (DecodeConfig(logprobs=True, top_logprobs=3), "logprobs"),
    ):
        with pytest.raises(UnsupportedError) as err:
            apply_sampling(og.GenerationConfig(), config)
        assert err.value.field == field
