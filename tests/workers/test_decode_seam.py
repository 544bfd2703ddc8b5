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
import threading
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
from modeld.engine.jobs import GenerateEnd, RoomAsked, Sampled
from modeld.engine.model import GenerateCall
from modeld.workers.host import InlineHost
from modeld.workers.protocol import (
    Close,
    Finished,
    Generate,
    Load,
    Message,
    Progress,
    ProtocolError,
    Sync,
    Tokens,
    decode_frame,
    encode_frame,
)
from modeld.workers.scheduler import GROW_MARGIN, Scheduler


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
    h = InlineHost(lambda load: (DeadEndRuntime(load.info, load.request.config, load.options), 0))
    h.load(Load("memory", request, info, options))
    yield h
    h.close()


def run(
    host: InlineHost, prompt: Sequence[int], config: DecodeConfig
) -> tuple[list[StreamChunk], list[int | None]]:
    host.sync(0, 0, prompt).wait()
    plan = plan_decode(config)
    call = GenerateCall(host.start_generate(0, plan.engine_config(config), config.max_tokens))
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


def test_a_generate_job_reads_as_the_engines_own_events(host: InlineHost) -> None:
    """The decode stream reads no worker message: ``GenerateCall`` turns a job's ``Tokens``,
    ``Room`` and ``Finished`` into ``Sampled``, ``RoomAsked`` and ``GenerateEnd``; a job with a
    cell limit pauses once, and a grant of no limit lets it finish."""
    prompt = [256, *b"Count with me.\n"]
    host.sync(0, 0, prompt).wait()
    job = GenerateCall(host.start_generate(0, DecodeConfig(max_tokens=12), 12, cells=GROW_MARGIN + 3))
    events: list[object] = []
    while not (events and isinstance(events[-1], GenerateEnd)):
        event = job.next_event(timeout=10)
        assert event is not None
        events.append(event)
        if isinstance(event, RoomAsked):
            job.grant(-1)
    assert all(isinstance(e, Sampled | RoomAsked | GenerateEnd) for e in events)
    (at,) = [i for i, e in enumerate(events) if isinstance(e, RoomAsked)]
    before = sum(len(e.tokens) for e in events[:at] if isinstance(e, Sampled))
    room = events[at]
    assert isinstance(room, RoomAsked) and 0 < before < 12
    assert room.resident == len(prompt) + before  # every token it sent, evaluated
    assert sum(len(e.tokens) for e in events if isinstance(e, Sampled)) == 12
    end = events[-1]
    assert isinstance(end, GenerateEnd) and not end.canceled and end.resident > room.resident


def generate_replies(host: InlineHost, max_tokens: int, interval: float) -> list[Message]:
    host.sync(0, 0, [256, *b"Count with me.\n"]).wait()
    return list(host.start_generate(0, DecodeConfig(max_tokens=max_tokens), max_tokens, interval).events())


def test_tokens_that_come_faster_than_the_stream_interval_travel_together(host: InlineHost) -> None:
    each = generate_replies(host, 20, 0.0)
    assert [len(m.tokens) for m in each if isinstance(m, Tokens)] == [1] * 20
    held = generate_replies(host, 20, 9.0)
    # The first token goes at once (time to first token), the rest within the interval together.
    assert [len(m.tokens) for m in held if isinstance(m, Tokens)] == [1, 19]
    assert isinstance(held[-1], Finished) and isinstance(each[-1], Finished)
    tokens = [[t for m in replies if isinstance(m, Tokens) for t in m.tokens] for replies in (each, held)]
    assert tokens[0] == tokens[1]


def test_a_token_is_not_held_while_another_job_waits_its_turn() -> None:
    """Two decodes share the engine: neither holds a token across the other's step (a prefill
    batch of another session could keep it for seconds); the one left alone holds again."""
    request = OpenSessionRequest(type="memory", path="two")
    info = MemoryBackend().describe(request)
    options = LoadOptions(n_seq=2, window=4096, pool_tokens=8192)
    runtime = MemoryRuntime(info, request.config, options)
    for seq in (0, 1):
        list(runtime.sync(seq, 0, [256, *f"Sequence {seq}.\n".encode()]))
    replies: dict[int, list[Message]] = {1: [], 2: []}
    both_done = threading.Event()

    def send(op: int, message: Message) -> None:
        if op in replies:
            replies[op].append(message)
            if all(r and isinstance(r[-1], Finished) for r in replies.values()):
                both_done.set()

    scheduler = Scheduler(send, lambda load: (runtime, 0))
    scheduler.submit(0, Load("memory", request, info, options))
    scheduler.submit(1, Generate(0, DecodeConfig(max_tokens=5), 5, 9.0))
    scheduler.submit(2, Generate(1, DecodeConfig(max_tokens=20), 20, 9.0))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()  # every request is queued before the engine thread takes the first
    assert both_done.wait(30)
    scheduler.submit(3, Close())
    thread.join(30)
    short = [len(m.tokens) for m in replies[1] if isinstance(m, Tokens)]
    long = [len(m.tokens) for m in replies[2] if isinstance(m, Tokens)]
    assert short == [1] * 5
    assert long[:5] == [1] * 5 and sum(long) == 20 and len(long) < 20


def test_prefills_that_arrive_together_go_shortest_first_then_in_arrival_order() -> None:
    """Three prefills queued at once (1024, 512 and 512 tokens) while a decode runs: the 512s
    go first, in the order they came, each to its end before the next evaluates a token, then
    the 1024. Round robin ended all three together, so the first answered only after all
    three's work. The decode keeps its turns between the prefills' batches throughout."""
    request = OpenSessionRequest(type="memory", path="four")
    info = MemoryBackend().describe(request)
    options = LoadOptions(n_seq=4, window=4096, pool_tokens=8192)
    runtime = MemoryRuntime(info, request.config, options)
    list(runtime.sync(3, 0, [256, *b"Decode here.\n"]))
    events: list[tuple[int, Message]] = []
    done = threading.Event()

    def send(op: int, message: Message) -> None:
        events.append((op, message))
        if sum(isinstance(m, Finished) for _, m in events) == 4:
            done.set()

    scheduler = Scheduler(send, lambda load: (runtime, 0))
    scheduler.submit(0, Load("memory", request, info, options))
    scheduler.submit(1, Generate(3, DecodeConfig(max_tokens=200), 200))
    scheduler.submit(2, Sync(0, 0, tuple(range(300, 1324))))
    scheduler.submit(3, Sync(1, 0, tuple(range(300, 812))))
    scheduler.submit(4, Sync(2, 0, tuple(range(300, 812))))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()  # every request is queued before the engine thread takes the first
    assert done.wait(30)
    assert list(runtime.resident(0)) == list(range(300, 1324)) and len(runtime.resident(2)) == 512
    scheduler.submit(5, Close())
    thread.join(30)
    # Each prefill's batches run together and end before the next one's first batch.
    batches = [op for op, m in events if isinstance(m, Progress) and m.evaluated]
    assert batches == sorted(batches, key=[3, 4, 2].index) and set(batches) == {2, 3, 4}, batches
    assert [op for op, m in events if isinstance(m, Finished) and op > 1] == [3, 4, 2]
    # The decode took steps between the batches of the prefills, not only after them.
    first_end = next(i for i, (op, m) in enumerate(events) if op == 3 and isinstance(m, Finished))
    assert any(op == 1 and isinstance(m, Tokens) for op, m in events[:first_end])


@pytest.mark.parametrize("interval", [-1.0, 10.5, float("nan")])
def test_a_stream_interval_out_of_range_is_a_protocol_error(interval: float) -> None:
    with pytest.raises(ProtocolError):
        Generate(0, DecodeConfig(), 4, interval)
