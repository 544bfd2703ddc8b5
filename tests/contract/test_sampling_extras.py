"""The contract suite for the extra sampling parameters and what Describe says about the vocabulary.

``logit_bias``, ``presence_penalty``, ``frequency_penalty``, ``logprobs`` / ``top_logprobs``
(OpenAI's meanings, ``modeld.decoding.sampling``) on every implementation that lists them in
``Capabilities.sampling`` -- in process, in a worker process and over the wire -- and refused by
name where a backend does not (OpenVINO: no logit bias, no streamed log-probabilities).
"""

from __future__ import annotations

import math

import pytest
from harness import Harness

from modeld.contract import Constraint, DecodeConfig, PrefixInput, Session, StreamChunk
from modeld.errors import InvalidArgumentError, UnsupportedError


def decode(session: Session, config: DecodeConfig) -> list[StreamChunk]:
    with session.decode(config) as stream:
        return list(stream)


def lists(session: Session, *fields: str) -> bool:
    return set(fields) <= set(session.info.capabilities.sampling)


def test_describe_reports_the_vocabulary_size_and_its_control_tokens(harness: Harness) -> None:
    with harness.open() as s:
        info = s.info
        assert info.vocab_size == len(harness.loaded().vocab.pieces)
        kinds = {t.kind: t.id for t in info.special_tokens}
        if harness.backend == "memory":
            assert [(t.id, t.kind) for t in info.special_tokens] == [(256, "bos"), (257, "eos")]
        else:  # TINY: <|endoftext|> is BOS, <|im_end|> EOS, <|im_start|> another control token
            assert [(t.text, t.kind) for t in info.special_tokens] == [
                ("<|endoftext|>", "bos"),
                ("<|im_start|>", "control"),
                ("<|im_end|>", "eos"),
            ]
            assert kinds["eos"] == info.vocab_size - 1
        assert info.tool_format == "hermes"  # a ChatML template with <tool_call>


def test_a_logit_bias_decides_between_allowed_tokens(harness: Harness) -> None:
    with harness.open() as s:
        if not lists(s, "logit_bias"):
            s.ensure_prefix(PrefixInput(text="x"))
            with pytest.raises(UnsupportedError) as err:
                decode(s, DecodeConfig(logit_bias={5: 1.0}))
            assert err.value.field == "logit_bias"
            return
        s.ensure_prefix(PrefixInput(text="Answer with a or b.\n"))
        (a,) = harness.tokenize("a", add_bos=False)
        (b,) = harness.tokenize("b", add_bos=False)
        regex = Constraint("regex", "[ab]{12}")
        # Two decodes in a row on one context: the second must not see the first's masked logits.
        for favoured, letter in ((a, "a"), (b, "b")):
            chunks = decode(s, DecodeConfig(max_tokens=40, constraint=regex, logit_bias={favoured: 100.0}))
            assert "".join(c.text for c in chunks) == letter * 12
        with pytest.raises(InvalidArgumentError) as err:
            decode(s, DecodeConfig(logit_bias={s.info.vocab_size: 1.0}))
        assert err.value.field == "logit_bias"


def test_logprobs_come_with_every_token_and_agree_with_greedy_choice(harness: Harness) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text="Write one short line.\n"))
        if not lists(s, "logprobs", "top_logprobs"):
            with pytest.raises(UnsupportedError) as err:
                decode(s, DecodeConfig(max_tokens=4, logprobs=True))
            assert err.value.field == "logprobs"
            return
        chunks = decode(s, DecodeConfig(max_tokens=24, logprobs=True, top_logprobs=3))
        tokens = [t for c in chunks for t in c.token_ids]
        logprobs = [lp for c in chunks for lp in c.logprobs]
        assert [lp.token for lp in logprobs] == tokens
        for c in chunks:
            assert len(c.logprobs) == len(c.token_ids)
        for lp in logprobs:
            assert lp.logprob <= 1e-6
            assert 1 <= len(lp.top) <= 3
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
            assert lp.top[0].token == lp.token  # greedy: the chosen token is the most likely one
            assert math.isclose(lp.top[0].logprob, lp.logprob, abs_tol=1e-6)
        s.ensure_prefix(PrefixInput(text="Write one short line.\n"))  # drops the first answer
        plain = decode(s, DecodeConfig(max_tokens=24))
        assert [t for c in plain for t in c.token_ids] == tokens  # asking for logprobs changes nothing
        assert all(c.logprobs == () for c in plain)


def test_presence_and_frequency_penalties_lower_repeated_tokens_exactly(harness: Harness) -> None:
    with harness.open() as s:
        s.ensure_prefix(PrefixInput(text="Spell it.\n"))
        if not lists(s, "presence_penalty", "frequency_penalty"):
            with pytest.raises(UnsupportedError):
                decode(s, DecodeConfig(max_tokens=4, presence_penalty=1.0))
            return
        if not lists(s, "logit_bias", "logprobs"):  # OpenVINO: accepted (GenerationConfig), not observable
            chunks = decode(s, DecodeConfig(max_tokens=8, frequency_penalty=2.0, presence_penalty=1.0))
            assert chunks[-1].finish_reason in ("length", "stop")
            return
        (a,) = harness.tokenize("a", add_bos=False)
        (b,) = harness.tokenize("b", add_bos=False)

        def gaps(**penalties: float) -> list[float]:
            """Per step: logprob(b) - logprob(a), while a +100 bias makes every token an "a"."""
            s.ensure_prefix(PrefixInput(text="Spell it.\n"))
            config = DecodeConfig(
                max_tokens=20,
                constraint=Constraint("regex", "[ab]{8}"),
                logit_bias={a: 100.0},
                logprobs=True,
                top_logprobs=20,
                **penalties,  # type: ignore[arg-type]
            )
            chunks = decode(s, config)
            assert "".join(c.text for c in chunks) == "a" * 8
            steps = [lp for c in chunks for lp in c.logprobs]
            out = []
            for lp in steps:
                top = {t.token: t.logprob for t in lp.top}
                out.append(top[b] - top[a])
            return out

        plain = gaps()
        frequency = gaps(frequency_penalty=1.5)
        presence = gaps(presence_penalty=2.0)
        # OpenAI's definitions: each earlier "a" lowers a's logit by frequency_penalty; any
        # earlier "a" lowers it once by presence_penalty. "b" never came, so it is not lowered.
        assert [f - p for f, p in zip(frequency, plain, strict=True)] == pytest.approx(
            [1.5 * k for k in range(8)], abs=1e-3
        )
        assert [q - p for q, p in zip(presence, plain, strict=True)] == pytest.approx(
            [0.0] + [2.0] * 7, abs=1e-3
        )
