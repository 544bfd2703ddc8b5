"""Every family's forcing grammar on OpenVINO GenAI (its grammar engine takes our GBNF as is):
greedy forced calls on TINY (random weights), each parsed back by the family's parser with
arguments valid under the tool's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.openvino

og = pytest.importorskip("openvino_genai")
np = pytest.importorskip("numpy")
ov = pytest.importorskip("openvino")

from test_formats import SCHEMAS, TOOLS  # noqa: E402

from modeld.backends.openvino_constraints import apply_sampling  # noqa: E402
from modeld.contract import DecodeConfig  # noqa: E402
from modeld.decoding.constraints import compile_constraint  # noqa: E402
from modeld.decoding.formats import FORMATS, make_parser  # noqa: E402
from modeld.decoding.tools import forced_call_constraint  # noqa: E402
from modeld.testmodels import TINY, ensure_model  # noqa: E402


@pytest.fixture(scope="module")
def pipe() -> og.LLMPipeline:
    return og.LLMPipeline(str(ensure_model(TINY)), "CPU", INFERENCE_PRECISION_HINT="f32")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_forced_call_in_each_family_parses_on_openvino(pipe: og.LLMPipeline, fmt: str) -> None:
    compiled = compile_constraint(forced_call_constraint(TOOLS, "read_file", fmt))
    for seed in range(2):
        gen = og.GenerationConfig()
        gen.max_new_tokens = 200
        gen.do_sample = False
        apply_sampling(gen, DecodeConfig(), compiled)
        prompt = ov.Tensor(np.array([[4093, 137 + 41 * seed, 701, 33]], dtype=np.int64))
        text = pipe.get_tokenizer().decode(list(pipe.generate(prompt, gen).tokens[0]))
        parser = make_parser(fmt, SCHEMAS)
        assert parser is not None
        step, end = parser.feed(text), parser.finish()
        assert not step.malformed and not end.malformed, (text, step.malformed or end.malformed)
        assert [c.name for c in parser.calls] == ["read_file"], text
        jsonschema.validate(json.loads(parser.calls[0].arguments), SCHEMAS["read_file"])
