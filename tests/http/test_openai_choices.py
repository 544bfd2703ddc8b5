"""``n`` > 1 on llama.cpp: the prompt's KV forked into ``n`` sequences and the choices decoded
together, one batch per step (blueprint 0019, "Choices").

Against a real ``modeld serve --http`` on the generated tiny llama model: every choice is what
the one-choice request gives (greedy, decoded once; seeded sampling with seed + i, stop strings,
a constraint), the warm state afterwards is what a one-choice turn leaves (no fork is left in the
pool), and where the forks do not fit (too few free sequences, too few free cells) the choices
are decoded one after another and the answer says why.

What holds exactly and what holds up to rounding, on every CPU: choices decoded together go
through llama.cpp's kernels for a batch of several rows, whose rounding differs from a one-token
step's, so their log-probabilities equal the one-choice request's within :data:`SPREAD` and a
draw landing near a boundary can part the texts (blueprint 0019); their first token comes from
the prompt's own logits and is exact. Choices decoded one after another are one-choice decodes
and equal the one-choice requests exactly. The one-choice references are decoded with
``speculation`` off, as choices are: a speculating decode verifies drafts in batches (its
rounding differs again, blueprint 0021) and drafts from the previous answer of its sequence, so
what it rounds depends on the request before it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from daemon_proc import serve_http, stop

import runtime_client as rc

pytestmark = [pytest.mark.llama, pytest.mark.slow, pytest.mark.wire]

MESSAGES = [
    {"role": "system", "content": "You are terse.\n"},
    {"role": "user", "content": "Why does the build fail?\n"},
]

SPREAD = 0.03
"""How far a log-probability of a choice decoded together may lie from the one-choice request's.
Measured (300 choices of 24 tokens, seeds 100-397, the tokens before any parting): AVX2 without
AVX-512 (a -DGGML_NATIVE=OFF -DGGML_AVX2=ON build, the kernels an AMD EPYC runs) median 7e-5, p99
0.0046, max 0.0114; AVX-512 with AMX median 0, p99 0.0037, max 0.0114. The first token was exact
on both (300/300); 23% and 13% of the choices parted from the one-choice text within 24 tokens. A
choice drawn from another choice's row or with another seed differs in its first token or by
whole units of log-probability."""

PLAIN = {"speculation": "off"}  # one-choice references decode as choices do (module docstring)


class Served:
    def __init__(self, *extra: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="mdn"))
        self.proc, record = serve_http(self.tmp, *extra, backend="llama", timeout=300)
        self.url = record.http_endpoint

    def ask(self, conversation: str = "", **body: Any) -> dict[str, Any]:
        headers = {"X-Modeld-Conversation": conversation} if conversation else {}
        reply = httpx.post(
            f"{self.url}/v1/chat/completions",
            json={"model": "modeld-tiny", "messages": MESSAGES, "max_tokens": 24, **body},
            headers=headers,
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        data: dict[str, Any] = reply.json()
        return data

    def close(self) -> None:
        stop(self.proc)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    # Without the prefill ahead (the default; tests/http/test_prefill_ahead.py): a one-choice
    # turn would leave one (n > 1 never does), changing the state these tests compare.
    s = Served("--no-prefill-ahead")
    try:
        yield s
    finally:
        s.close()


def texts(answer: dict[str, Any]) -> list[str]:
    return [c["message"]["content"] for c in answer["choices"]]


def assert_follows(mine: list[dict[str, Any]], alone: list[dict[str, Any]]) -> None:
    """A choice decoded together against the one-choice decode with its seed (``logprobs``
    content): the same first token exactly, then the same tokens with log-probabilities within
    :data:`SPREAD` until a draw parts them (if one does)."""
    assert mine[0] == alone[0]
    common = next(
        (k for k, (x, y) in enumerate(zip(mine, alone, strict=True)) if x["token"] != y["token"]), len(mine)
    )
    assert [t["logprob"] for t in mine[:common]] == pytest.approx(
        [t["logprob"] for t in alone[:common]], abs=SPREAD
    )


def test_greedy_choices_are_decoded_once_and_are_the_one_choice_answer(served: Served) -> None:
    four = served.ask(n=4, temperature=0)
    note = four["timings"]["choices"]
    assert note["n"] == 4 and note["decoded"] == "once" and "greedy" in note["why"]
    assert four["modeld"]["choices"] == note
    one = served.ask(n=1, temperature=0)
    assert "choices" not in one["timings"]
    assert texts(four) == texts(one) * 4
    assert [c["finish_reason"] for c in four["choices"]] == ["length"] * 4
    assert four["usage"]["completion_tokens"] == 4 * one["usage"]["completion_tokens"] == 96


def test_sampled_choice_i_is_the_one_choice_request_with_seed_plus_i(served: Served) -> None:
    """Each choice draws with its own sampler, seeded seed + i, from the prompt's own logits:
    its first token is the one-choice request's, and its log-probabilities follow it (equal up
    to the rounding of a batch of several sequences, which may move a later draw: 0019)."""
    sampled = {"temperature": 1.0, "logprobs": True, **PLAIN}
    three = served.ask(n=3, seed=5, **sampled)
    assert three["timings"]["choices"] == {"n": 3, "decoded": "together"}
    assert len(set(texts(three))) == 3
    for i in range(3):
        alone = served.ask(n=1, seed=5 + i, **sampled)["choices"][0]["logprobs"]["content"]
        mine = three["choices"][i]["logprobs"]["content"]
        assert len(mine) == len(alone) == 24
        assert_follows(mine, alone)
    # A constraint and a bias edit each choice's own logits (the first step's row, shared by
    # every choice, is restored before each edits it).
    for edit in ({"response_format": {"type": "json_object"}}, {"logit_bias": {"100": 4.0}}):
        body = {"temperature": 1.0, "max_tokens": 16, "logprobs": True, **edit}
        two = served.ask(n=2, seed=8, **body)
        assert two["timings"]["choices"]["decoded"] == "together"
        firsts = [
            served.ask(n=1, seed=8 + i, **body)["choices"][0]["logprobs"]["content"][0] for i in range(2)
        ]
        assert [c["logprobs"]["content"][0] for c in two["choices"]] == firsts
        if "response_format" in edit:
            assert all(t.lstrip().startswith("{") for t in texts(two))


def test_completions_choices_are_decoded_together_too(served: Served) -> None:
    def complete(n: int, seed: int) -> dict[str, Any]:
        body = {"model": "modeld-tiny", "prompt": "def main():\n", "max_tokens": 16, "n": n}
        body |= {"seed": seed, "temperature": 1.0, "logprobs": 1}
        reply = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        data: dict[str, Any] = reply.json()
        return data

    two = complete(2, 9)
    assert two["timings"]["choices"] == {"n": 2, "decoded": "together"}
    assert [len(c["logprobs"]["tokens"]) for c in two["choices"]] == [16, 16]
    # Each choice draws with seed + i from the prompt's own logits: the first token is the
    # one-choice request's (later ones may part by the batch's rounding: blueprint 0019).
    alone = [complete(1, 9 + i)["choices"][0]["logprobs"] for i in range(2)]
    assert [c["logprobs"]["tokens"][0] for c in two["choices"]] == [a["tokens"][0] for a in alone]
    assert [c["logprobs"]["token_logprobs"][0] for c in two["choices"]] == [
        a["token_logprobs"][0] for a in alone
    ]


def test_each_choice_stops_on_its_own(served: Served) -> None:
    """A stop string ends one choice (the engine stops that choice alone); the others go on."""
    body = {"temperature": 1.0, "stop": ["e"], "max_tokens": 40}
    four = served.ask(n=4, seed=11, **body)
    assert four["timings"]["choices"]["decoded"] == "together"
    got = texts(four)
    finishes = [c["finish_reason"] for c in four["choices"]]
    assert all("e" not in t for t in got) and set(finishes) <= {"stop", "length"}
    stopped = [len(t) for t, f in zip(got, finishes, strict=True) if f == "stop"]
    assert stopped and max(len(t) for t in got) > min(stopped)  # another choice went on past it


def test_the_warm_state_after_choices_is_what_one_choice_leaves(served: Served) -> None:
    many = served.ask("many", n=4, temperature=1.0, seed=3)
    assert many["timings"]["choices"]["decoded"] == "together"
    one = served.ask("one", n=1, temperature=1.0, seed=3)
    with rc.connect(data_dir=served.tmp) as client:
        a = client.explain_context(many["modeld"]["session_id"])
        b = client.explain_context(one["modeld"]["session_id"])
    # The same prompt and 24 tokens of choice 0, held as a one-choice turn holds its own.
    assert (a.prefix_tokens + a.suffix_tokens, a.generated_tokens) == (b.prefix_tokens + b.suffix_tokens, 24)
    assert (a.resident_tokens, a.kv_tokens) == (b.resident_tokens, b.kv_tokens)
    assert many["choices"][0]["message"]["content"] != many["choices"][1]["message"]["content"]
    assert a.speculation == "off" and b.speculation == "ngram"  # choices decode plainly
    kv = [c for c in b.contexts if c.tier == "kv"]
    assert not [c for c in kv if "fork" in c.id]  # the forks were given back
    mine = {c.session_id: c for c in kv}
    assert mine[a.session_id].tokens == mine[b.session_id].tokens
    # The next turn of the conversation is warm as after a one-choice turn.
    follow = [
        *MESSAGES,
        {"role": "assistant", "content": texts(many)[0]},
        {"role": "user", "content": "More?\n"},
    ]
    again = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={"model": "modeld-tiny", "messages": follow, "max_tokens": 4, "temperature": 0},
        headers={"X-Modeld-Conversation": "many"},
        timeout=60,
    ).json()
    assert again["modeld"]["reuse"] == "warm"


def test_choices_that_do_not_fit_are_decoded_one_after_another_and_say_why() -> None:
    s = Served("--sequences", "2", "--num-ctx", "256")
    sampled = {"temperature": 1.0, "max_tokens": 120, "logprobs": True, **PLAIN}
    try:
        answers = [s.ask(n=1, seed=20 + i, **sampled) for i in range(4)]
        alone = [texts(a)[0] for a in answers]
        # Three more choices need three more sequences; the pool has two.
        four = s.ask(n=4, seed=20, **sampled)
        note = four["timings"]["choices"]
        assert note["decoded"] == "one by one" and "more KV sequences" in note["why"]
        assert four["modeld"]["choices"] == note
        assert texts(four) == alone  # one-choice decodes, exactly
        # One more choice has a sequence but not the cells: a window of 256 holds the prompt
        # and 120 tokens of the first choice, not 120 more for the second.
        two = s.ask(n=2, seed=20, **sampled)
        note = two["timings"]["choices"]
        assert note["decoded"] == "one by one" and "KV cells" in note["why"]
        assert texts(two) == alone[:2]
        # Fewer tokens fit (the other sequence's idle context makes room): decoded together.
        short = s.ask(n=2, seed=20, **(sampled | {"max_tokens": 60}))
        assert short["timings"]["choices"] == {"n": 2, "decoded": "together"}
        for choice, answer in zip(short["choices"], answers, strict=False):
            mine = choice["logprobs"]["content"]
            assert_follows(mine, answer["choices"][0]["logprobs"]["content"][: len(mine)])
    finally:
        s.close()
