"""Reasons and counters that say what happened (issue 21, item 4), each with the case that was wrong.

* A turn a refused snapshot file would have served says ``snapshot_rejected``, for every kind of
  damage: before, 9 of these 12 (the files refused while the disk tier was indexed at start)
  said ``cold / empty_cache``.
* A new conversation that shares only the chat template's head (7 tokens of TINY's template for
  a conversation opening with a system message) with a warm context is cold, naming that head:
  before, ``partial / diverged``.
* ``modeld status``, ``/metrics`` and the turns themselves count the same tokens after a scripted
  sequence of gRPC and HTTP turns: before, status counted a prefix's reused tokens again at its
  suffix and its decode ("reused from kv 171" after two chat turns that reused 32), and the
  metrics counted a suffix the last turn had left in place as prefilled.
* The list of ``explain-context`` says how many of a session's tokens are in the KV (before: a
  RESIDENT 1898/4096 column for a session whose detail said 0 in the KV now), and a snapshot is
  listed under one loaded model, not under every model of its file (per-model bytes doubled).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from modeld.cache.snapfile import FORMAT_VERSION, SUFFIX, read_header, write_atomic
from modeld.cache.tiers import entry_key
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.settings import Residency

testmodels = pytest.importorskip("modeld.testmodels")

TEXT = "You are a careful engineer.\nrepo: lib/parser.c parse() lex()\nlib/ast.h node_t\n" * 4
_TAIL = struct.Struct("<IH8s")  # a snapshot file ends with: header length, version, magic


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testmodels.ensure_model(testmodels.TINY))


def _request(path: str, **config: Any) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=path, config=Config(**{"num_ctx": 2048, "num_batch": 32, **config})
    )


# --- every refused snapshot file names itself in the turn it would have served ------------------


def _layout(raw: bytes) -> tuple[int, int, int]:
    """Where a snapshot file's tokens and header start, and the header's length (the payload
    comes first, then the tokens, the JSON header and the fixed tail)."""
    header_len = int(_TAIL.unpack(raw[-_TAIL.size :])[0])
    at = len(raw) - _TAIL.size - header_len
    fields = json.loads(raw[at : at + header_len])
    return int(fields["payload_bytes"]), at, header_len


def _flip(raw: bytearray, at: int) -> bytes:
    raw[at] ^= 0xFF
    return bytes(raw)


def _engine_refuses(path: Path) -> None:
    """Checksums that hold over a payload llama.cpp cannot load (a broken engine wrote it)."""
    header, tokens = read_header(path)
    path.unlink()
    key = entry_key(header.model_digest, header.identity, header.snapshot_format, tokens)
    write_atomic(
        path.with_name(f"{key}{SUFFIX}"),
        model_digest=header.model_digest,
        identity=header.identity,
        snapshot_format=header.snapshot_format,
        tokens=tokens,
        prefix_tokens=header.prefix_tokens,
        payload=b"\x00" * header.payload_bytes,
    )


def _rewrite(change: Callable[[bytearray], bytes]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        path.write_bytes(change(bytearray(path.read_bytes())))

    return apply


def _version(raw: bytearray) -> bytes:
    raw[-10:-8] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    return bytes(raw)


def _magic(raw: bytearray) -> bytes:
    raw[-8:] = b"NOTMODEL"
    return bytes(raw)


def _header_json(raw: bytearray) -> bytes:
    _, at, _ = _layout(raw)
    assert raw[at : at + 1] == b"{"
    raw[at : at + 1] = b"X"  # no longer JSON
    return bytes(raw)


def _tokens(raw: bytearray) -> bytes:
    return _flip(raw, _layout(raw)[0] + 5)


def _cut_payload(raw: bytearray) -> bytes:
    return bytes(raw[:50] + raw[150:])


def _cut_tokens(raw: bytearray) -> bytes:
    return bytes(raw[: _layout(raw)[0] + 6])


def _cut_header(raw: bytearray) -> bytes:
    _, at, header_len = _layout(raw)
    return bytes(raw[: at + header_len // 2])


def _rename(path: Path) -> None:  # foreign, or renamed by hand: its name claims other contents
    path.rename(path.with_name("0" * 16 + path.name[16:]))


DAMAGES: dict[str, Callable[[Path], None]] = {
    "payload byte flipped": _rewrite(lambda raw: _flip(raw, 100)),
    "payload the engine refuses": _engine_refuses,
    "payload cut short": _rewrite(_cut_payload),
    "padded": _rewrite(lambda raw: bytes(raw) + b"\0" * 64),
    "cut inside the tokens": _rewrite(_cut_tokens),
    "cut inside the header": _rewrite(_cut_header),
    "empty": _rewrite(lambda raw: b""),
    "another format version": _rewrite(_version),
    "not a snapshot file": _rewrite(_magic),
    "header not JSON": _rewrite(_header_json),
    "tokens corrupted": _rewrite(_tokens),
    "name does not match": _rename,
}


@pytest.fixture
def persisted(tmp_path: Path, tiny: str) -> tuple[Path, int]:
    """A data directory holding the disk snapshot of one tiny-model prefix."""
    data = tmp_path / "data"
    with Engine(backends=("llama",), data_dir=data, residency=Residency(persist_min_tokens=8)) as engine:
        size = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=TEXT)).prefix_tokens
    (only,) = (data / "kv").glob(f"*{SUFFIX}")
    header, _ = read_header(only)
    assert json.loads(json.dumps(header.n_tokens)) == size
    return data, size


@pytest.mark.llama
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_turn_a_refused_snapshot_would_have_served_says_snapshot_rejected(
    persisted: tuple[Path, int], tiny: str, damage: str
) -> None:
    data, size = persisted
    (path,) = (data / "kv").glob(f"*{SUFFIX}")
    DAMAGES[damage](path)
    with Engine(backends=("llama",), data_dir=data) as engine:
        status = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=TEXT))
        assert (status.reuse.outcome, status.reuse.reason) == ("cold", "snapshot_rejected"), status.reuse
        assert status.prefilled_tokens == size
        (model,) = engine.status().models
        assert model.counters["snapshots_rejected"] == 1
        tiers = engine.status().tiers
        assert tiers is not None and tiers.rejected == 1
        again = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=TEXT))
        assert again.reuse.outcome == "warm"  # said once; the turn's own context serves now


@pytest.mark.llama
def test_a_refused_file_of_another_text_does_not_explain_a_cold_turn(
    persisted: tuple[Path, int], tiny: str
) -> None:
    data, _ = persisted
    (path,) = (data / "kv").glob(f"*{SUFFIX}")
    DAMAGES["payload cut short"](path)
    with Engine(backends=("llama",), data_dir=data) as engine:
        other = "Nothing in common with that workspace at all.\n" * 8
        status = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=other))
        assert (status.reuse.outcome, status.reuse.reason) == ("cold", "empty_cache")
        status = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=TEXT))
        assert status.reuse.reason == "snapshot_rejected"


# --- a new conversation sharing only the template's head is cold ------------------------------


def _chat(path: str) -> OpenSessionRequest:
    return _request(path, prompt_format="chat")


@pytest.mark.llama
def test_a_new_conversation_sharing_only_the_template_head_is_cold_and_says_so(tiny: str) -> None:
    with Engine(backends=("llama",)) as engine:
        first = engine.open_session(_chat(tiny))
        system = "You are a careful engineer working on lib/parser.c and its tests.\n"
        assert first.ensure_prefix(PrefixInput(text=system)).reuse.outcome == "cold"

        other = engine.open_session(_chat(tiny))
        status = other.ensure_prefix(PrefixInput(text="Zebra crossings of Oslo, a field manual.\n"))
        reuse = status.reuse
        assert (reuse.outcome, reuse.reason) == ("cold", "diverged"), reuse
        (model,) = engine.models()
        heads = model.prefix_heads(True, True)
        assert 0 < status.reused_tokens == reuse.diverged_at_token == len(heads[1]) < 20
        assert "a new conversation: it shares only the chat template's head" in reuse.message
        assert f"prefilled {status.prefilled_tokens} of {status.prefix_tokens} tokens" in reuse.message

        # Sharing the system text too is a partial hit, as before.
        same = engine.open_session(_chat(tiny))
        status = same.ensure_prefix(PrefixInput(text=system + "Also read lib/lexer.c.\n"))
        assert (status.reuse.outcome, status.reuse.reason) == ("partial", "diverged"), status.reuse
        assert status.reused_tokens > len(heads[1])

        # Raw text: the head is the BOS token.
        raw = engine.open_session(_request(tiny))
        raw.ensure_prefix(PrefixInput(text=TEXT))
        again = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text="Nothing alike.\n" * 4))
        assert (again.reuse.outcome, again.reuse.reason, again.reused_tokens) == ("cold", "diverged", 1)
        assert "shares only the BOS token" in again.reuse.message


# --- status, metrics and the turns count the same tokens ------------------------------------------


def _metric_sums(text: str) -> dict[tuple[str, str], float]:
    """``(series, model)`` -> value for the counters status shows; ``hits`` per source as
    ``hits:<source>``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    names = {
        "modeld_prefix_cache_queries": "queries",
        "modeld_prompt_tokens_prefilled": "prefilled",
        "modeld_snapshots_rejected": "snapshots_rejected",
        "modeld_recomputed_tokens": "recomputed",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            base = sample.name[: -len("_total")]
            model = sample.labels.get("model", "")
            if base in names:
                key = names[base]
            elif base == "modeld_prefix_cache_hits":
                key = f"reused_{sample.labels['source']}"
            elif base == "modeld_evictions":
                to = sample.labels["to"]
                key = "evicted_dropped" if to == "dropped" else f"evicted_to_{to}"
            else:
                continue
            out[(key, model)] = out.get((key, model), 0.0) + sample.value
    return out


_COMPARED = (
    "queries",
    "reused_kv",
    "reused_ram",
    "reused_disk",
    "reused_shared",
    "prefilled",
    "evicted_to_ram",
    "evicted_to_disk",
    "evicted_dropped",
    "snapshots_rejected",
)


def _human_counters(text: str) -> dict[str, dict[str, int]]:
    """The counters ``modeld status`` prints, per model, read back from its text."""
    import re

    out: dict[str, dict[str, int]] = {}
    model = ""
    for line in text.splitlines():
        head = re.match(r"^  (\S+)  \S+ · digest ", line)
        if head:
            model = head.group(1)
            continue
        got = re.match(
            r"^    prefixes  (\d+) tokens looked up · reused from kv (\d+), ram (\d+), disk (\d+), shared (\d+)$",
            line,
        )
        if got:
            q, kv, ram, disk, shared = map(int, got.groups())
            out.setdefault(model, {}).update(
                queries=q, reused_kv=kv, reused_ram=ram, reused_disk=disk, reused_shared=shared
            )
        got = re.match(r"^    prefill   (\d+) prompt tokens computed ", line)
        if got:
            out.setdefault(model, {})["prefilled"] = int(got.group(1))
        got = re.match(
            r"^    evicted   to ram (\d+), disk (\d+), dropped (\d+) · snapshots taken \d+, rejected (\d+) ",
            line,
        )
        if got:
            ram, disk, dropped, rejected = map(int, got.groups())
            out.setdefault(model, {}).update(
                evicted_to_ram=ram, evicted_to_disk=disk, evicted_dropped=dropped, snapshots_rejected=rejected
            )
    return out


@pytest.mark.llama
@pytest.mark.wire
def test_status_metrics_and_the_turns_count_the_same_tokens(tmp_path: Path, tiny: str) -> None:
    import httpx
    from daemon_proc import modeld, serve_http, stop

    import runtime_client as rc
    from modeld.observe.metrics import model_label

    data = tmp_path / "d"
    proc, record = serve_http(data, "--sequences", "2", "--persist-min-tokens", "8", backend="llama")
    url = record.http_endpoint
    turns: dict[tuple[str, str], int] = {}  # (counter, model label) -> what the turns said

    def add(key: str, model: str, n: int) -> None:
        turns[(key, model)] = turns.get((key, model), 0) + n

    def prefix_said(
        model: str, prefix_tokens: int, reused: int, reason: str, outcome: str, tier: str
    ) -> None:
        source = tier if reused and tier in ("ram", "disk", "shared") and outcome != "cold" else "kv"
        add("queries", model, prefix_tokens)
        add(f"reused_{source}", model, reused)

    try:
        with rc.connect(data_dir=data) as client:
            # Its own name: unnamed, the file would be served as the HTTP endpoint names it
            # (modeld-tiny), and the two runtimes' lines of ``modeld status`` would share it.
            agent = dataclasses.replace(_request(tiny), model_name="agent-tiny")
            name = model_label(client.open_session(agent).info.model_name)

            def turn(session: Any, prefix: str, suffix: str) -> None:
                p = session.ensure_prefix(PrefixInput(text=prefix))
                prefix_said(
                    name, p.prefix_tokens, p.reused_tokens, p.reuse.reason, p.reuse.outcome, p.reuse.tier
                )
                session.prefill_suffix(SuffixInput(text=suffix))
                with session.decode(DecodeConfig(max_tokens=6)) as stream:
                    (usage,) = [c.usage for c in stream if c.usage is not None]
                add("prefilled", name, usage.prompt_tokens - usage.cached_tokens)

            a, b, c = (client.open_session(agent) for _ in range(3))
            other = "Unrelated workspace: docs/guide.md chapters 1-9.\n" * 4
            turn(a, TEXT, "fix the failing test\n")  # cold
            turn(a, TEXT, "why does migrate() hang?\n")  # warm: full match
            turn(a, TEXT, "why does migrate() hang?\n")  # the same request again: its suffix stays
            turn(b, TEXT + "lib/extra.c\n", "go on\n")  # partial: a copy of a's prefix
            turn(
                c, other, "summarize\n"
            )  # a third sequence: a's context (the least recently used) is evicted
            turn(a, TEXT, "and now?\n")  # back: from the KV or the RAM tier
            turn(b, TEXT + "lib/extra.c\n", "go on\n")

            chat = {"model": "modeld-tiny", "max_tokens": 6, "temperature": 0}
            messages = [{"role": "user", "content": "Why does main() crash?"}]
            http_model = ""
            for _ in range(2):
                r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "messages": messages}, timeout=120)
                assert r.status_code == 200, r.text
                body = r.json()
                ext, usage = body["modeld"], body["usage"]
                http_model = http_model or model_label(body["model"])
                prefix_tokens = ext["reused_tokens"] + ext["prefilled_tokens"]
                prefix_said(
                    http_model,
                    prefix_tokens,
                    ext["reused_tokens"],
                    ext["reason"],
                    ext["reuse"],
                    ext.get("tier", ""),
                )
                add(
                    "prefilled",
                    http_model,
                    usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"],
                )
                messages += [body["choices"][0]["message"], {"role": "user", "content": "And then?"}]
            # Each answer left the next turn's prefix computed ahead (--prefill-ahead, the
            # default): no turn says that work, its own request record does (finish "ahead").
            aheads: list[dict[str, Any]] = []
            for _ in range(600):
                records = httpx.get(f"{url}/v1/requests", params={"limit": 100}, timeout=30).json()["data"]
                aheads = [r for r in records if r["finish"] == "ahead"]
                if len(aheads) == 2 and all(r["state"] == "done" for r in aheads):
                    break
                time.sleep(0.1)
            assert len(aheads) == 2, aheads
            for r in aheads:
                add("queries", http_model, r["prefix_tokens"])
                for source in ("kv", "ram", "disk", "shared"):
                    add(f"reused_{source}", http_model, r[f"reused_{source}"])
                add("prefilled", http_model, r["prefilled_tokens"])

            reasons = [s.last_outcome for s in client.list_sessions()]
            assert "partial" in reasons or "warm" in reasons

            status = json.loads(modeld("status", "--json", data_dir=data).stdout)
            human = _human_counters(modeld("status", data_dir=data).stdout)
            metrics = _metric_sums(httpx.get(f"{url}/metrics", timeout=30).text)

        by_model: dict[str, dict[str, int]] = {}
        for m in status["models"]:
            label = model_label(m["model_name"])
            counters = by_model.setdefault(label, dict.fromkeys(_COMPARED, 0))
            for key in _COMPARED:
                counters[key] += m["counters"][key]
        assert set(by_model) == {name, http_model}
        for m in status["models"]:  # the count of tokens computed again (issue 30) is a metric too
            label = model_label(m["model_name"])
            assert metrics.get(("recomputed", label), 0) == m["counters"]["recomputed"], (label, metrics)
        for label, counters in by_model.items():
            for key in _COMPARED:
                assert metrics.get((key, label), 0) == counters[key], (label, key, counters, metrics)
                assert human[label][key] == counters[key], (label, key, human[label])
                if key in ("queries", "reused_kv", "reused_ram", "reused_disk", "reused_shared", "prefilled"):
                    assert turns.get((key, label), 0) == counters[key], (label, key, counters, turns)
        agent_counters = by_model[name]
        # The scripted eviction happened: a's prefix, already on disk (written behind), goes nowhere else.
        assert agent_counters["evicted_to_ram"] + agent_counters["evicted_to_disk"] >= 1
        assert 0 < agent_counters["reused_kv"] < agent_counters["queries"]
    finally:
        _, err = stop(proc)
        assert "Traceback" not in err, err[-3000:]


# --- what explain-context's list and status list say they hold ----------------------------------


def test_the_session_list_says_what_is_in_the_kv_and_a_snapshot_is_listed_under_one_model(
    tmp_path: Path,
) -> None:
    """Memory backend, one sequence per model: the second session's prefix evicts the first
    one's context to the RAM tier. Two loaded models of one file (two context sizes)."""
    from modeld.settings import Residency

    a_text, b_text = "alpha beta gamma " * 40, "one two three four " * 40
    with Engine(backends=("memory",), data_dir=tmp_path, residency=Residency(sequences=1)) as engine:
        big = OpenSessionRequest(type="memory", path="coder", config=Config(num_ctx=4096))
        small = OpenSessionRequest(type="memory", path="coder", config=Config(num_ctx=2048))
        a = engine.open_session(big)
        n = a.ensure_prefix(PrefixInput(text=a_text)).prefix_tokens
        engine.open_session(big).ensure_prefix(PrefixInput(text=b_text))  # evicts a's context
        engine.open_session(small).ensure_prefix(PrefixInput(text=b_text))
        engine.tiers.flush(10)

        (listed,) = [s for s in engine.list_sessions() if s.session_id == a.session_id]
        assert (listed.resident_tokens, listed.kv_tokens) == (n, 0)
        assert a.explain_context().kv_tokens == 0

        models = engine.status().models
        assert len(models) == 2 and models[0].model_digest == models[1].model_digest
        snapshots = [(m.n_ctx, c.id) for m in models for c in m.contexts if c.tier != "kv"]
        assert snapshots and len({i for _, i in snapshots}) == len(snapshots), snapshots
        ram = engine.status().tiers
        assert ram is not None
        listed_bytes = sum(c.bytes for m in models for c in m.contexts if c.tier == "ram")
        assert listed_bytes <= ram.ram_bytes
