"""Constraints, logit bias and log-probabilities across the daemon/worker seam, and a dead end.

The worker protocol carries a decode's constraint compiled (``Constraint("grammar", gbnf)``),
its ``logit_bias`` (JSON object keys are strings: ``Generate`` restores the ints) and the
sampled tokens' log-probabilities (``Tokens.logprobs``). A constraint that can no longer be met
ends the generate job early and cleanly; the daemon's decode loop then reports
``constraint_failed`` and the engine keeps serving.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence

import pytest

from modeld.backends.base import LoadOptions
from modeld.backends.memory import MemoryBackend, MemoryRuntime
from modeld.contract import (
    Constraint,
    DecodeConfig,
    OpenSessionRequest,
    StreamChunk,
    TokenLogprob,
    TopLogprob,
)
from modeld.decoding.output import plan_decode
from modeld.engine.decode import DecodeRun, EngineDecodeStream
from modeld.workers.host import InlineHost
from modeld.workers.protocol import Generate, Load, ProtocolError, Tokens, decode_frame, encode_frame


def roundtrip(message: Generate | Tokens) -> object:
    _, header, payload = encode_frame(7, message)
    op, back = decode_frame(bytes(header), bytes(payload))
    assert op == 7
    return back


def test_a_generate_message_keeps_its_grammar_and_integer_logit_bias() -> None:
    plan = plan_decode(DecodeConfig(constraint=Constraint("regex", "[ab]{3}")))
    config = plan.engine_config(DecodeConfig(logit_bias={97: 2.5, 4095: -100.0}, seed=3))
    assert config.constraint is not None and config.constraint.kind == "grammar"
    back = roundtrip(Generate(2, config, 40))
    assert isinstance(back, Generate)
    assert back == Generate(2, config, 40)
    assert list(back.config.logit_bias) == [97, 4095]  # ints again, not the JSON's strings


def test_a_generate_message_with_a_bad_bias_key_is_a_protocol_error() -> None:
    _, header, _ = encode_frame(1, Generate(0, DecodeConfig(logit_bias={5: 1.0}), 4))
    bad = json.loads(bytes(header))
    bad["config"]["logit_bias"] = {"five": 1.0}
    with pytest.raises(ProtocolError):
        decode_frame(json.dumps(bad).encode(), b"")


def test_tokens_carry_their_logprobs() -> None:
    lp = TokenLogprob(97, -0.25, (TopLogprob(97, -0.25), TopLogprob(98, -1.5)))
    assert roundtrip(Tokens((97,), (lp,))) == Tokens((97,), (lp,))
    assert roundtrip(Tokens((97, 98))) == Tokens((97, 98))


class DeadEndRuntime(MemoryRuntime):
    """A model whose vocabulary cannot write what its grammar needs after three tokens: its
    constrained generate ends early, as a real runtime's does at a dead end."""

    def generate(self, seq: int, config: DecodeConfig, max_tokens: int) -> Iterator[int]:
        tokens = super().generate(seq, config, max_tokens)
        return itertools.islice(tokens, 3) if config.constraint is not None else tokens


@pytest.fixture
def host() -> Iterator[InlineHost]:
    request = OpenSessionRequest(type="memory", path="dead-end")
    info = MemoryBackend().describe(request)
    options = LoadOptions(n_seq=1, window=4096, pool_tokens=4096)
    h = InlineHost(lambda load: DeadEndRuntime(load.info, load.request.config, load.options))
    h.load(Load("memory", request, info, options))
    yield h
    h.close()


def run(
    host: InlineHost, prompt: Sequence[int], config: DecodeConfig
) -> tuple[list[StreamChunk], list[int | None]]:
    host.sync(0, 0, prompt)
    plan = plan_decode(config)
    call = host.start_generate(0, plan.engine_config(config), config.max_tokens)
    ended: list[int | None] = []
    assert host.vocab is not None
    stream = EngineDecodeStream(
        DecodeRun(
            call=call,
            vocab=host.vocab,
            config=config,
            plan=plan,
            requested=config.max_tokens,
            prompt=len(prompt),
            cached=0,
            prefill_ms=0.0,
            restore_ms=0.0,
            idle_seconds=0.0,
            deadline=None,
            interrupted=lambda: None,
            finish=lambda emitted, sampled, resident, exc: ended.append(resident),
        )
    )
    return list(stream), ended


def test_a_dead_end_of_the_constraint_is_constraint_failed_and_the_engine_goes_on(host: InlineHost) -> None:
    prompt = [256, *b"Answer in JSON.\n"]
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    chunks, ended = run(
        host, prompt, DecodeConfig(max_tokens=50, constraint=Constraint("json_schema", schema))
    )
    final = chunks[-1]
    assert final.finish_reason == "constraint_failed"
    assert "".join(c.text for c in chunks) == '{"o'
    assert ended == [len(prompt) + 2]  # the third token was sampled, never evaluated
    # Cut off by max_tokens inside the answer is "length" (the truth), not a failure.
    chunks, _ = run(host, prompt, DecodeConfig(max_tokens=2, constraint=Constraint("json_schema", schema)))
    assert chunks[-1].finish_reason == "length"
    chunks, _ = run(host, prompt, DecodeConfig(max_tokens=8))  # free text still decodes
    assert chunks[-1].finish_reason == "length"
