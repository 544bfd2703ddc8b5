"""Speculation from the context (blueprint 0021): prompt-lookup drafts verified in one batch.

The drafter and the draft length are checked on their own; the reference backend proves the
rule keeps the output (greedy and seeded sampling token for token, and the sampled
distribution by a chi-square test against the distribution it reports); llama.cpp proves
greedy output identical to plain decoding on a fresh, a warm and a restored context, on a
unified and a split KV, and that speculation stacks with the rest of a decode.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from modeld.backends.base import LoadOptions
from modeld.backends.memory import MemoryBackend, MemoryRuntime
from modeld.contract import DecodeConfig, OpenSessionRequest
from modeld.decoding.speculation import (
    DRAFT_MAX,
    DRAFT_START,
    MATCH_LONG,
    MATCH_MAX,
    WAIT_MAX,
    Drafter,
    DraftLength,
)

# --- the drafter -------------------------------------------------------------------------------


def test_a_draft_copies_what_followed_the_latest_longest_match() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13
    history = [5, 1, 2, 3, 9, 9, 7, 2, 3, 8, 8, 1, 2, 3]
    # The end (2, 3) occurred at 2-3 and at 7-8; (1, 2, 3) only at 1-3: the longer match wins.
    assert Drafter(history).draft(3) == [9, 9, 7]
    # With equal matches the most recent occurrence is copied.
    assert Drafter([4, 2, 3, 6, 4, 2, 3, 7, 4, 2, 3]).draft(2) == [7, 4]
    d = Drafter(history)
    d.append(9)  # the history goes on as the occurrence did: the draft follows it
    assert d.draft(2) == [9, 7]
    assert d.draft(0) == []


def test_a_long_match_allows_a_draft_as_long_as_the_match() -> None:
    history = [*range(100, 140), 7, 8, *range(100, 130)]
    d = Drafter(history)
    cycle = [*range(130, 140), 7, 8, *range(100, 130)]  # what followed, then the same again
    assert d.draft(64) == (cycle * 2)[:64]
    assert d.matched == 30  # the whole tail: 100..129 (the history starts before it)
    lengths = DraftLength()
    assert lengths.budget(d.matched) == 30  # a decode's first draft: as long as the match
    assert lengths.budget(MATCH_LONG - 1) == DRAFT_START  # a short match: the usual length
    lengths.record(DRAFT_START, DRAFT_START)  # a draft fully accepted: the copy holds
    assert lengths.budget(d.matched) == DRAFT_MAX  # a long match now gets the longest draft
    assert lengths.budget(MATCH_LONG - 1) == 2 * DRAFT_START
    lengths.record(DRAFT_MAX, 3)  # a draft failed: a long match allows as much as it matched
    assert lengths.budget(d.matched) == 30
    again = Drafter(list(range(40)) * 2)
    assert again.draft(1) == [0] and again.matched == MATCH_MAX  # compared up to MATCH_MAX
    assert lengths.budget(MATCH_MAX + 100) == min(DRAFT_MAX, MATCH_MAX + 100)
    assert lengths.budget(MATCH_LONG - 1) == lengths.length
    lengths.record(lengths.length, lengths.length)  # fully accepted again: the copy holds
    assert lengths.budget(MATCH_LONG) == DRAFT_MAX
    assert Drafter([1, 2, 3]).draft(4) == [] and Drafter([1, 2, 3]).matched == 0


def test_repeated_text_is_drafted_with_its_period() -> None:
    assert Drafter([1, 2, 3, 1, 2, 3, 1, 2]).draft(7) == [3, 1, 2, 3, 1, 2, 3]
    assert Drafter([7, 7, 7]).draft(4) == [7, 7, 7, 7]


def test_no_draft_without_the_last_two_tokens_seen_before() -> None:
    assert Drafter([]).draft(4) == []
    assert Drafter([1, 2]).draft(4) == []
    assert Drafter([1, 2, 3, 4, 5, 3]).draft(4) == []  # one token of match is not enough
    assert Drafter([1, 2, 9, 1, 2]).draft(8) == [9, 1, 2, 9, 1, 2, 9, 1]


def test_the_draft_length_grows_on_acceptance_and_falls_to_zero_when_drafts_keep_failing() -> None:
    lengths = DraftLength()
    start = lengths.budget()
    lengths.record(start, start)
    assert lengths.budget() == 2 * start
    for _ in range(8):
        lengths.record(lengths.length, lengths.length)
    assert lengths.budget() == DRAFT_MAX
    lengths.record(DRAFT_MAX, 5)  # an edit: halved
    assert lengths.budget() == DRAFT_MAX // 2
    lengths.record(DRAFT_MAX // 2, 20)  # but never below what was accepted, plus one
    assert lengths.budget() == 21
    budgets = []
    for _ in range(400):  # fresh text: every draft fails at its first token
        budget = lengths.budget()
        budgets.append(budget)
        lengths.record(budget, 0)
    # It halves to zero, then pauses for 1, 2, 4 ... WAIT_MAX steps between one-token probes.
    assert budgets[:6] == [21, 10, 5, 2, 1, 0]
    assert max(budgets[100:]) == 1 and budgets[100:].count(1) <= 400 // WAIT_MAX
    probes = [i for i, b in enumerate(budgets) if b]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps) and gaps[-1] == WAIT_MAX + 1
    while not lengths.budget():
        pass
    lengths.record(1, 1)  # a probe is accepted: drafting resumes at once and grows again
    assert [lengths.budget() for _ in range(3)] == [2, 2, 2]


# --- the reference backend ---------------------------------------------------------------------


def _memory() -> MemoryRuntime:
    request = OpenSessionRequest(type="memory", path="speculation")
    info = MemoryBackend().describe(request)
    return MemoryRuntime(info, request.config, LoadOptions(n_seq=1, window=4096, pool_tokens=4096))


def _generate(rt: MemoryRuntime, prompt: list[int], config: DecodeConfig, n: int) -> list[int]:
    list(rt.sync(0, 0, prompt))
    return list(rt.generate(0, config, n))


REPEATING = [
    256,
    *b"def area(w, h):\n    return w * h\n\nprint(area(2, 3))\n[print(area(2, 3))] zq\nprint(area(2, 3))",
]


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(),
        DecodeConfig(temperature=1.0, seed=11),
        DecodeConfig(temperature=0.7, top_k=5, top_p=0.9, seed=3, repeat_penalty=1.2),
        DecodeConfig(presence_penalty=0.4, frequency_penalty=0.3, logit_bias={97: 1.5}, seed=5),
    ],
)
def test_the_reference_backend_gives_the_same_tokens_with_speculation(config: DecodeConfig) -> None:
    """Each position's token is chosen exactly as without a draft (the same random draw): the
    output is the same token for token, and the echo of an earlier line is drafted and kept."""
    rt = _memory()
    plain = _generate(rt, REPEATING, replace(config, speculation="off"), 60)
    assert rt.decode_stats(0).drafted == 0
    drafted = _generate(rt, REPEATING, replace(config, speculation="ngram"), 60)
    stats = rt.decode_stats(0)
    assert drafted == plain
    assert stats.accepted >= 10 and stats.verifies >= 1, stats


def _chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable with ``df`` degrees of freedom (the regularized upper
    incomplete gamma function Q(df/2, x/2): a series below a + 1, a continued fraction above)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1:
        term = total = 1.0 / a
        n = a
        while term > total * 1e-15:
            n += 1
            term *= z / n
            total += term
        return 1.0 - total * math.exp(log_front)
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def test_the_chi_square_tail_matches_known_values() -> None:
    assert _chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert _chi2_sf(15.507, 8) == pytest.approx(0.05, abs=1e-4)
    assert _chi2_sf(2.0, 10) == pytest.approx(0.99634, abs=1e-4)


def test_speculative_sampling_keeps_the_output_distribution() -> None:
    """Sampled with top_k=3 at temperature 1: the echo ``[go] `` is drafted from the first line
    together with the ``a`` that followed it there, which the model samples with probability
    ~0.3 at the first free position. 3000 seeded decodes with speculation: the first two free
    bytes follow the distribution the backend reports (its log-probabilities), and the drafted
    ``a`` is accepted in some decodes and rejected in the others."""
    rt = _memory()
    prompt = [256, *b"[go] aax\n!\ngo"]
    at = len(b"[go] ")
    config = DecodeConfig(temperature=1.0, top_k=3, logprobs=True, top_logprobs=3)

    def dist(lp: object) -> dict[int, float]:
        weights = {t.token: math.exp(t.logprob) for t in lp.top}  # type: ignore[attr-defined]
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}

    # The exact joint distribution of the first two free bytes, from plain decodes' own reports.
    first: dict[int, float] = {}
    second: dict[int, dict[int, float]] = {}
    for seed in range(200):
        out = _generate(rt, prompt, replace(config, seed=seed, speculation="off"), at + 2)
        first = dist(out[at].logprob)  # type: ignore[attr-defined]
        second.setdefault(out[at], dist(out[at + 1].logprob))  # type: ignore[attr-defined]
        if len(second) == len(first):
            break
    assert len(first) == 3 and set(second) == set(first)
    assert 0.15 < first[ord("a")] < 0.85
    expected = {(a, b): pa * pb for a, pa in first.items() for b, pb in second[a].items()}

    runs = 3000
    seen: Counter[tuple[int, int]] = Counter()
    outcomes: Counter[int] = Counter()
    for seed in range(runs):
        rt._drafters.clear()  # no recall of the last run's answer: the draft is the prompt's
        out = _generate(rt, prompt, replace(config, seed=10_000 + seed, speculation="ngram"), at + 2)
        seen[(out[at], out[at + 1])] += 1
        stats = rt.decode_stats(0)
        assert stats.drafted == 4  # "o] a" after "[g": three echo bytes and the "a"
        outcomes[stats.accepted] += 1
    assert set(seen) <= set(expected)
    chi2 = sum((seen[cell] - runs * p) ** 2 / (runs * p) for cell, p in expected.items())
    assert _chi2_sf(chi2, len(expected) - 1) > 1e-3, (chi2, seen, expected)
    # The draft's "a" was kept in about p(a) of the decodes, rejected in the rest.
    assert outcomes[4] / runs == pytest.approx(first[ord("a")], abs=0.04)
    assert outcomes[3] + outcomes[4] == runs


def test_a_draft_the_grammar_forbids_is_not_verified_and_forced_bytes_are_counted() -> None:
    from modeld.contract import Constraint

    rt = _memory()
    prompt = [256, *b'{"name": "area", "unit": "m"}\n{"name": "area", "unit": "m"}\n']
    schema = '{"type": "object", "properties": {"name": {"const": "area"}, "unit": {"type": "string"}}, "required": ["name", "unit"], "additionalProperties": false}'
    config = DecodeConfig(constraint=Constraint("json_schema", schema))
    plain = _generate(rt, prompt, replace(config, speculation="off"), 80)
    drafted = _generate(rt, prompt, replace(config, speculation="ngram"), 80)
    stats = rt.decode_stats(0)
    assert drafted == plain
    assert stats.forced >= len('"name":"area"'), stats  # the schema's fixed text


# --- llama.cpp -----------------------------------------------------------------------------------

FILE = """import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Config:
    name: str
    width: int = 80
    height: int = 24

    def area(self) -> int:
        return self.width * self.height


def load(path: Path) -> Config:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return Config(name=data["name"], width=data.get("width", 80), height=data.get("height", 24))


def save(config: Config, path: Path) -> None:
    path.write_text(json.dumps({"name": config.name, "width": config.width, "height": config.height}))
"""
PREFIX = "Rewrite this file with one change:\n```python\n" + FILE + "```\n"
SUFFIX = "Here it is:\n```python\n"


@pytest.fixture(scope="module")
def models() -> dict[str, str]:
    testmodels = pytest.importorskip("modeld.testmodels")
    from test_copying_model import SMALL

    return {
        "tiny": str(testmodels.ensure_model(testmodels.TINY)),
        "copying": str(testmodels.ensure_model(SMALL)),
    }


def _llama_request(path: str) -> OpenSessionRequest:
    from modeld.contract import Config

    return OpenSessionRequest(
        type="llama", path=path, config=Config(num_ctx=2048, num_batch=64, num_threads=1)
    )


def _decode(session: object, speculation: str, n: int = 96, **config: object) -> tuple[list[int], object]:
    tokens: list[int] = []
    last = None
    with session.decode(DecodeConfig(max_tokens=n, speculation=speculation, **config)) as stream:  # type: ignore[attr-defined]
        for chunk in stream:
            tokens.extend(chunk.token_ids)
            last = chunk
    assert last is not None
    return tokens, last


@pytest.mark.llama
@pytest.mark.parametrize("unified", [True, False], ids=["kv-unified", "no-kv-unified"])
@pytest.mark.parametrize("model", ["copying", "tiny"])
def test_llama_greedy_output_is_plain_decoding_on_fresh_warm_and_restored_contexts(
    models: dict[str, str], model: str, unified: bool
) -> None:
    from modeld.contract import PrefixInput, SuffixInput
    from modeld.engine import Engine
    from modeld.settings import Residency

    residency = Residency(sequences=1, kv_unified=unified, snapshot_min_tokens=8)
    with Engine(backends=("llama",), residency=residency) as engine:
        a = engine.open_session(_llama_request(models[model]))

        def turn(speculation: str) -> tuple[list[int], Any]:
            status = a.ensure_prefix(PrefixInput(text=PREFIX))
            a.prefill_suffix(SuffixInput(text=SUFFIX))
            tokens, end = _decode(a, speculation)
            return tokens, (status.reuse.reason, end.usage)  # type: ignore[attr-defined]

        fresh, (reason, usage) = turn("ngram")
        assert reason == "empty_cache"
        plain, (reason, plain_usage) = turn("off")  # warm: the prefix reused, the rest evaluated
        assert reason == "full_match" and plain_usage.drafted_tokens == 0
        assert fresh == plain
        if model == "copying":  # the copy is drafted and kept; random weights keep nothing
            assert usage.accepted_tokens >= len(plain) // 2, usage
            assert usage.draft_batches <= len(plain) // 4, usage
        warm, (reason, _) = turn("ngram")
        assert (warm, reason) == (plain, "full_match")
        # Restored: another session takes the only sequence; the first comes back from RAM.
        b = engine.open_session(_llama_request(models[model]))
        b.ensure_prefix(PrefixInput(text="An unrelated prompt, long enough to be kept.\n" * 3))
        b.prefill_suffix(SuffixInput(text="go"))
        _decode(b, "ngram", 8)
        restored, (reason, _) = turn("ngram")
        assert (restored, reason) == (plain, "restored_from_ram")


@pytest.fixture(scope="module")
def copying_runtime(models: dict[str, str]) -> Iterator[Any]:
    """SMALL in llama.cpp, one sequence holding PREFIX + SUFFIX (the model copies FILE next)."""
    from modeld.backends.llama import LlamaBackend

    request = _llama_request(models["copying"])
    backend = LlamaBackend()
    rt = backend.load(
        request, backend.describe(request), LoadOptions(n_seq=1, window=2048, pool_tokens=2048, threads=1)
    )
    yield rt
    rt.close()


def _prompt(rt: Any, text: str = PREFIX + SUFFIX) -> list[int]:
    tokens: list[int] = rt.tokenize(text, add_bos=True)
    return tokens


def _run(rt: Any, prompt: list[int], config: DecodeConfig, n: int) -> list[int]:
    list(rt.sync(0, 0, prompt))
    return list(rt.generate(0, config, n))


@pytest.mark.llama
@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(temperature=0.05, seed=7),  # SMALL's copy margin is ~1.5 logits
        DecodeConfig(temperature=0.05, top_k=8, top_p=0.95, min_p=0.01, seed=3, repeat_penalty=1.05),
        DecodeConfig(presence_penalty=0.3, frequency_penalty=0.1, logit_bias={5: 1.0}),
    ],
    ids=["sampled", "samplers", "penalties"],
)
def test_llama_sampling_and_penalties_choose_as_plain_decoding(
    copying_runtime: Any, config: DecodeConfig
) -> None:
    """Each verified position spends the sampler's random draw as plain decoding does: with a
    seed the tokens are the same, and drafts are still kept."""
    rt = copying_runtime
    prompt = _prompt(rt)
    plain = _run(rt, prompt, replace(config, speculation="off"), 64)
    drafted = _run(rt, prompt, replace(config, speculation="ngram"), 64)
    stats = rt.decode_stats(0)
    assert drafted == plain
    assert stats.accepted >= 32, stats


@pytest.mark.llama
def test_llama_decodes_of_two_sequences_interleaved_read_their_own_rows(models: dict[str, str]) -> None:
    """The worker runs its slots' jobs a step at a time: another sequence's batch is evaluated
    whenever this one hands a token over. Each decode must still give what plain decoding gives
    alone, and keep its drafts: every row of a verify batch is read before the first token is
    handed over (reading them one per step lost each batch to the other job's next one, and
    three concurrent copies paid a verify batch per token)."""
    from modeld.backends.llama import LlamaBackend

    request = _llama_request(models["copying"])
    backend = LlamaBackend()
    rt = backend.load(
        request, backend.describe(request), LoadOptions(n_seq=2, window=2048, pool_tokens=4096, threads=1)
    )
    try:
        prompts = [_prompt(rt), _prompt(rt, PREFIX.replace("json", "yaml") + SUFFIX)]
        plain = []
        for seq, prompt in enumerate(prompts):
            list(rt.sync(seq, 0, prompt))
            plain.append(list(rt.generate(seq, DecodeConfig(speculation="off"), 64)))
        assert plain[0] != plain[1]
        streams = []
        for seq, prompt in enumerate(prompts):
            list(rt.sync(seq, 0, prompt))
            streams.append(rt.generate(seq, DecodeConfig(speculation="ngram"), 64))
        got: list[list[int]] = [[], []]
        live = [0, 1]
        while live:  # one step of each in turn, as the worker's scheduler runs two slots
            for seq in list(live):
                try:
                    got[seq].append(next(streams[seq]))
                except StopIteration:
                    live.remove(seq)
        assert got == plain
        for seq in (0, 1):
            stats = rt.decode_stats(seq)
            assert stats.accepted >= 32, stats
            assert stats.verifies <= 64 // 4, stats  # several tokens kept per batch, as alone
    finally:
        rt.close()


@pytest.mark.llama
def test_llama_logprobs_with_speculation(copying_runtime: Any) -> None:
    rt = copying_runtime
    prompt = _prompt(rt)
    config = DecodeConfig(logprobs=True, top_logprobs=3)
    plain = _run(rt, prompt, replace(config, speculation="off"), 48)
    drafted = _run(rt, prompt, replace(config, speculation="ngram"), 48)
    assert rt.decode_stats(0).accepted >= 24
    assert drafted == plain
    for a, b in zip(plain, drafted, strict=True):
        la, lb = a.logprob, b.logprob  # type: ignore[attr-defined]
        # Verified rows come from a batch: the same numbers to llama.cpp's batch rounding.
        assert lb.logprob == pytest.approx(la.logprob, abs=2e-3)
        assert [t.token for t in lb.top] == [t.token for t in la.top]


@pytest.mark.llama
@pytest.mark.parametrize("after", [1, 5, 17, 40])
def test_llama_a_consumer_that_stops_mid_draft_leaves_what_plain_decoding_would(
    copying_runtime: Any, after: int
) -> None:
    """A cancel (a stop string, the guard, a client) closes the generator after any yielded
    token: drafted tokens verified ahead are cut back, so the sequence holds every yielded
    token but the last, as with plain decoding, and a later decode continues correctly."""
    rt = copying_runtime
    prompt = _prompt(rt)
    plain = _run(rt, prompt, DecodeConfig(speculation="off"), 64)
    list(rt.sync(0, 0, prompt))
    steps = rt.generate(0, DecodeConfig(speculation="ngram"), 64)
    got = [next(steps) for _ in range(after)]
    steps.close()
    assert got == plain[:after]
    assert list(rt.resident(0)) == prompt + got[:-1]
    assert (rt.decode_stats(0).drafted > 0) == (after > 1)  # the first draft follows the first token
    # Decoding on from there gives what plain decoding gives.
    rest = list(rt.generate(0, DecodeConfig(speculation="ngram"), 64 - after + 1))
    assert got[:-1] + rest == plain


@pytest.mark.llama
def test_llama_constrained_output_is_plain_decoding_and_forced_tokens_are_appended(
    copying_runtime: Any,
) -> None:
    """A schema's fixed text (keys, punctuation) is forced: appended in one batch with the
    token before it, never decoded one by one; the copied values are drafted. The output is
    plain constrained decoding's, token for token."""
    from modeld.contract import Constraint
    from modeld.decoding.constraints import compile_constraint

    rt = copying_runtime
    record = '{"name":"load_config","width":80,"height":24,"path":"src/app/config.json"}'
    prompt = _prompt(rt, "Records:\n" + record + "\nRecords:\n")
    schema = (
        '{"type": "object", "properties": {"name": {"type": "string"}, "width": {"type": "integer"},'
        ' "height": {"type": "integer"}, "path": {"type": "string"}},'
        ' "required": ["name", "width", "height", "path"], "additionalProperties": false}'
    )
    compiled = compile_constraint(Constraint("json_schema", schema))
    config = DecodeConfig(constraint=Constraint("grammar", compiled.gbnf))
    plain = _run(rt, prompt, replace(config, speculation="off"), 80)
    assert rt.decode_stats(0).forced == 0
    drafted = _run(rt, prompt, replace(config, speculation="ngram"), 80)
    stats = rt.decode_stats(0)
    assert drafted == plain
    assert stats.forced >= 1 and stats.accepted >= 8, stats
    text = b"".join(rt._piece(t) for t in plain if t not in rt.vocab().eog).decode()
    assert text == record  # copied whole, through the constraint


@pytest.mark.llama
def test_llama_stop_strings_and_the_repeated_line_guard_end_where_plain_decoding_does(
    models: dict[str, str],
) -> None:
    from modeld.contract import PrefixInput, SuffixInput
    from modeld.engine import Engine
    from modeld.settings import Residency

    repeated = "print('tick')\n" * 12
    cases = [
        (FILE, {"stop": ("def save",)}, "stop_sequence"),
        (repeated, {"repeated_line_min_chars": 8, "repeated_line_max": 4}, "repeated_line"),
    ]
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_llama_request(models["copying"]))
        for text, extra, finish in cases:
            results = []
            for speculation in ("off", "ngram", "off"):
                s.ensure_prefix(PrefixInput(text="Rewrite this file:\n```python\n" + text + "```\n"))
                s.prefill_suffix(SuffixInput(text=SUFFIX))
                chunks = []
                with s.decode(DecodeConfig(max_tokens=400, speculation=speculation, **extra)) as stream:  # type: ignore[arg-type]
                    chunks = list(stream)
                results.append(("".join(c.text for c in chunks), chunks[-1].finish_reason))
                if speculation == "ngram":
                    assert chunks[-1].usage.accepted_tokens > 0
            # Plain, speculative, and plain again after the speculative turn's warm state.
            assert results[0] == results[1] == results[2]
            assert results[0][1] == finish


@pytest.mark.llama
def test_llama_a_canceled_speculative_decode_leaves_a_context_that_decodes_on_correctly(
    models: dict[str, str],
) -> None:
    from modeld.contract import PrefixInput, SuffixInput
    from modeld.engine import Engine
    from modeld.settings import Residency

    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_llama_request(models["copying"]))
        s.ensure_prefix(PrefixInput(text=PREFIX))
        s.prefill_suffix(SuffixInput(text=SUFFIX))
        plain, _ = _decode(s, "off", 64)
        s.ensure_prefix(PrefixInput(text=PREFIX))
        s.prefill_suffix(SuffixInput(text=SUFFIX))
        with s.decode(DecodeConfig(max_tokens=64, speculation="ngram")) as stream:
            got = list(next(stream).token_ids)
            stream.cancel()
            for chunk in stream:
                got.extend(chunk.token_ids)
                last = chunk
        assert last.finish_reason == "canceled" and got == plain[: len(got)]
        # What the sequence holds is the truth: decoding on continues the plain output.
        report = s.explain_context()
        # As with plain decoding: every emitted token is the session's, the last one not yet in
        # the KV (nothing verified ahead stayed there).
        assert report.resident_tokens - report.kv_tokens in (0, 1)
        rest, _ = _decode(s, "ngram", 64 - report.generated_tokens)
        assert plain[: report.generated_tokens] + rest == plain


# --- the daemon's choice, per-request control, what is reported -----------------------------------


def test_the_daemon_default_applies_when_a_decode_leaves_it_unset_and_a_request_overrides_it() -> None:
    from modeld.contract import PrefixInput, SuffixInput
    from modeld.engine import Engine
    from modeld.errors import InvalidArgumentError

    prompt = bytes(REPEATING[1:]).decode()

    def turn(engine: Engine, speculation: str) -> tuple[list[int], Any, Any]:
        s = engine.open_session(OpenSessionRequest(type="memory", path="speculation"))
        s.ensure_prefix(PrefixInput(text=prompt))
        s.prefill_suffix(SuffixInput(text=""))
        with s.decode(DecodeConfig(max_tokens=40, speculation=speculation)) as stream:
            chunks = list(stream)
        return [t for c in chunks for t in c.token_ids], chunks[-1].usage, s.explain_context()

    with Engine() as engine:  # the default: ngram
        assert engine.speculation == "ngram" and engine.status().settings["speculation"] == "ngram"
        tokens, usage, report = turn(engine, "")
        assert usage.accepted_tokens > 0 and usage.draft_batches > 0
        assert (report.speculation, report.drafted_tokens, report.accepted_tokens) == (
            "ngram",
            usage.drafted_tokens,
            usage.accepted_tokens,
        )
        plain, usage, report = turn(engine, "off")
        assert plain == tokens and usage.drafted_tokens == 0 and report.speculation == "off"
    with Engine(speculation="off") as engine:
        assert turn(engine, "")[1].drafted_tokens == 0
        assert turn(engine, "ngram")[1].accepted_tokens > 0  # the request chooses
    with pytest.raises(InvalidArgumentError, match="speculation"):
        Engine(speculation="eagle")


def test_a_mode_the_backend_does_not_offer_is_refused_by_name() -> None:
    from modeld.contract import Capabilities
    from modeld.engine.validate import validate_decode
    from modeld.errors import InvalidArgumentError, UnsupportedError
    from modeld.settings import Limits

    plain_only = Capabilities(speculation=("off",))
    validate_decode(DecodeConfig(speculation="off"), Limits(), plain_only, 4096)
    validate_decode(DecodeConfig(), Limits(), plain_only, 4096)  # unset: falls back to off
    with pytest.raises(UnsupportedError) as err:
        validate_decode(DecodeConfig(speculation="ngram"), Limits(), plain_only, 4096)
    assert err.value.details["field"] == "speculation"
    with pytest.raises(InvalidArgumentError):
        validate_decode(DecodeConfig(speculation="eagle"), Limits(), plain_only, 4096)


def test_the_counts_travel_over_the_wire(wire: Any) -> None:
    from modeld.contract import PrefixInput, SuffixInput

    s = wire.open()
    s.ensure_prefix(PrefixInput(text=bytes(REPEATING[1:]).decode()))
    s.prefill_suffix(SuffixInput(text=""))
    with s.decode(DecodeConfig(max_tokens=40, speculation="ngram")) as stream:
        usage = list(stream)[-1].usage
    assert usage.accepted_tokens > 0 and usage.drafted_tokens >= usage.accepted_tokens
    report = s.explain_context()
    assert (report.speculation, report.drafted_tokens, report.accepted_tokens, report.draft_batches) == (
        "ngram",
        usage.drafted_tokens,
        usage.accepted_tokens,
        usage.draft_batches,
    )
    assert wire.service.describe(wire.request()).capabilities.speculation == ("off", "ngram")


def test_a_rebased_drafter_indexes_what_a_fresh_one_does() -> None:
    """A sequence's drafter lives across decodes (a warm prefix is indexed once): rebased on
    the next decode's history (the prefix kept, a suffix cut or changed, tokens added), its
    index and its drafts are a fresh drafter's, built or not yet built."""
    import random

    from modeld.decoding.speculation import Drafter, drafter_for

    rng = random.Random(7)
    for _ in range(400):
        drafter = Drafter([rng.randrange(6) for _ in range(rng.randrange(60))])
        if rng.random() < 0.7:
            drafter.draft(4)  # the index is built at the first draft
        for _ in range(rng.randrange(5)):
            drafter.append(rng.randrange(6))
        history = list(drafter._h[: rng.randrange(len(drafter) + 1)])
        history += [rng.randrange(6) for _ in range(rng.randrange(30))]
        drafters = {3: drafter}
        assert drafter_for(drafters, 3, history) is drafter
        fresh = Drafter(history)
        drafter._recall = None  # what the cut-off tail adds: test_a_cut_off_answer_is_recalled
        for limit in (1, 3, 8):
            assert (drafter.draft(limit), drafter.matched) == (fresh.draft(limit), fresh.matched)
        assert drafter._built() == fresh._built()


def test_a_cut_off_answer_is_recalled() -> None:
    """The tail a sequence's next decode cuts off (the answer a retry replaces) drafts the
    retry's answer from its first token; the history's own matches win when they are longer,
    and a recall is bounded."""
    from modeld.decoding.speculation import RECALL_MAX, Drafter, drafter_for

    prompt = [*range(1000, 1100)]
    answer = [7, 3, 9, *range(500, 560), 3, 9]
    drafters: dict[int, Drafter] = {}
    drafter = drafter_for(drafters, 0, prompt)
    for token in answer:
        drafter.append(token)
    assert drafter.draft(3) == [500, 501, 502]  # (3, 9) ended at answer[2]: copied from there
    # The retry: the same prompt; the first token chosen is the answer's again.
    drafter_for(drafters, 0, prompt).append(answer[0])
    assert drafter.draft(DRAFT_MAX) == answer[1 : 1 + DRAFT_MAX]
    assert drafter.matched == MATCH_MAX  # the prompt's end leads into it
    fresh = Drafter([*prompt, answer[0]])
    assert fresh.draft(8) == []  # without the recall: nothing to copy
    # Text in the history itself matching longer is preferred (the recall is only a fallback).
    again = drafter_for(drafters, 0, [*prompt, 3, 9, 42, *range(1070, 1100), 3, 9])
    assert again.draft(2) == [42, 1070]
    # A second cut replaces the recall; a long tail is kept up to RECALL_MAX tokens.
    long_tail = [*prompt, *range(10**6, 10**6 + RECALL_MAX + 50)]
    drafter_for(drafters, 0, long_tail)
    drafter_for(drafters, 0, [*prompt, 10**6])
    assert drafter.draft(4) == [10**6 + 1, 10**6 + 2, 10**6 + 3, 10**6 + 4]
    assert len(drafter._recall.tokens) - drafter._recall.lead == RECALL_MAX
