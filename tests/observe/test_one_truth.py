"""One truth: the records, the page, ``modeld status`` and ``/metrics`` count the same tokens.

A real daemon (llama.cpp, the generated tiny model, two KV sequences, prefixes written to disk
as soon as they are computed) serves a scripted mix over gRPC and HTTP: cold, warm, an edit
inside the prefix, a third workspace that evicts the first one's context, the first one back
(restored), a request refused (its prompt over the window) and one for a model that does not
exist; then it is restarted and the first workspace comes back from disk. After each life, per
model: the records' sums equal ``/metrics`` and the cache's counters in ``modeld status
--json``, and the page's state says the same; per conversation: the page's sums equal its
records'; per gRPC session: its last record's prefix equals ``explain-context``'s last prefix and
its records' speculation sums equal the session's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from daemon_proc import modeld, serve_http, stop
from prometheus_client.parser import text_string_to_metric_families

import runtime_client as rc
from modeld import testmodels
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.observe.records import COUNTED

pytestmark = [pytest.mark.llama, pytest.mark.wire]

TEXT = "You are a careful engineer.\nrepo: lib/parser.c parse() lex()\nlib/ast.h node_t\n" * 4
EDITED = TEXT.replace("lib/ast.h node_t\n", "lib/ast.h node_t tree_t\n", 2)
OTHER = "Unrelated workspace: docs/guide.md chapters 1-9.\n" * 4
THIRD = "A third workspace: tools/release.py bump() tag() publish().\n" * 4
STATUS_NAMES = {
    "prefix_tokens": "queries",
    "reused_kv": "reused_kv",
    "reused_ram": "reused_ram",
    "reused_disk": "reused_disk",
    "reused_shared": "reused_shared",
    "prefilled_tokens": "prefilled",
}
"""The records' counts that ``modeld status`` prints too (the cache's counters), by its names."""


def _metrics(text: str) -> dict[str, dict[str, int]]:
    """``/metrics`` per model under the records' names."""
    names = {
        "modeld_prefix_cache_queries": "prefix_tokens",
        "modeld_prompt_tokens_prefilled": "prefilled_tokens",
        "modeld_prompt_tokens": "prompt_tokens",
        "modeld_prompt_tokens_cached": "cached_tokens",
        "modeld_generation_tokens": "generated_tokens",
        "modeld_requests": "decodes",
        "modeld_spec_decode_num_drafts": "draft_batches",
        "modeld_spec_decode_num_draft_tokens": "drafted_tokens",
        "modeld_spec_decode_num_accepted_tokens": "accepted_tokens",
        "modeld_spec_decode_num_forced_tokens": "forced_tokens",
    }
    out: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.removesuffix("_total")
            model = sample.labels.get("model")
            if not sample.name.endswith("_total") or model is None:
                continue
            if base == "modeld_prefix_cache_hits":
                key = f"reused_{sample.labels['source']}"
            elif base in names:
                key = names[base]
            else:
                continue
            out.setdefault(model, dict.fromkeys(COUNTED, 0))[key] += int(sample.value)
    return out


def _sums(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in records:
        group = out.setdefault(r["model"], dict.fromkeys(COUNTED, 0))
        for key in COUNTED:
            group[key] += r[key]
    return {m: s for m, s in out.items() if any(s.values())}


def _records(url: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = httpx.get(f"{url}/v1/requests", params={"limit": 1000}, timeout=60).json()[
        "data"
    ]
    return data


def _check(url: str, data: Path, since: float, sessions: dict[str, Any]) -> dict[str, Any]:
    """Every view agrees (module docstring); returns the page's state."""
    for _ in range(600):  # a chat turn's prefill ahead of the next turn runs after its answer
        records = httpx.get(f"{url}/v1/requests", params={"limit": 1000}, timeout=60).json()["data"]
        if all(r["state"] == "done" for r in records):
            break
        time.sleep(0.1)
    assert all(r["state"] == "done" for r in records)
    assert any(r["finish"] == "ahead" for r in records)  # counted below like any record
    mine = [r for r in records if r["started_at"] >= since]
    metrics = _metrics(httpx.get(f"{url}/metrics", timeout=60).text)
    assert _sums(mine) == {m: s for m, s in metrics.items() if any(s.values())}

    status = json.loads(modeld("status", "--json", data_dir=data).stdout)
    for model, totals in _sums(mine).items():
        counters: dict[str, int] = {}
        for m in status["models"]:
            if m["model_name"] == model or m["model_name"].rsplit("/", 1)[-1] == model:
                for name in STATUS_NAMES.values():
                    counters[name] = counters.get(name, 0) + m["counters"][name]
        assert {k: totals[k] for k in STATUS_NAMES} == {k: counters[v] for k, v in STATUS_NAMES.items()}, (
            model
        )

    state = httpx.get(f"{url}/ui/state", timeout=60).json()
    page_models = {m: s for m, s in state["records_by_model"].items() if any(s.values())}
    assert page_models == _sums(mine)
    assert {m: s for m, s in state["metrics"].items() if any(s.values())} == _sums(mine)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for r in state["records"]:
        by_key.setdefault(r["conversation"], []).append(r)
    for row in state["conversations"]:
        records_of = by_key.get(row["key"], [])  # its turns and their prefills ahead
        assert row["turns"] == sum(r["finish"] != "ahead" for r in records_of)
        assert row["sums"] == {k: sum(t[k] for t in records_of) for k in COUNTED}, row["key"]

    with rc.connect(data_dir=data) as client:
        for sid in sessions:
            report = client.explain_context(sid)
            own = [r for r in mine if r["session"] == sid]
            last = own[-1]
            assert report.last_prefix is not None and report.last_reuse is not None
            reused = last["reused_kv"] + last["reused_ram"] + last["reused_disk"] + last["reused_shared"]
            assert (last["prefix_tokens"], reused, last["reason"], last["diverged_at_token"]) == (
                report.last_prefix.prefix_tokens,
                report.last_prefix.reused_tokens,
                report.last_reuse.reason,
                report.last_reuse.diverged_at_token,
            )
            assert (sum(r["drafted_tokens"] for r in own), sum(r["accepted_tokens"] for r in own)) == (
                report.drafted_tokens,
                report.accepted_tokens,
            )
    return state


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testmodels.ensure_model(testmodels.TINY))


def test_records_page_status_metrics_and_explain_context_agree(tmp_path: Path, tiny: str) -> None:
    data = tmp_path / "d"
    flags = ("--sequences", "2", "--persist-min-tokens", "8", "--num-ctx", "512")
    request = OpenSessionRequest(
        type="llama", path=tiny, model_name="agent-tiny", config=Config(num_ctx=2048)
    )

    def turn(session: Any, prefix: str, suffix: str) -> None:
        session.ensure_prefix(PrefixInput(text=prefix))
        session.prefill_suffix(SuffixInput(text=suffix))
        with session.decode(DecodeConfig(max_tokens=6)) as stream:
            list(stream)

    proc, record = serve_http(data, *flags, backend="llama")
    url = record.http_endpoint
    try:
        with rc.connect(data_dir=data, job="truth-grpc") as client:
            a, b, c = (client.open_session(request) for _ in range(3))
            sessions = {s.session_id: s for s in (a, b, c)}
            turn(a, TEXT, "fix the failing test\n")  # cold
            turn(a, TEXT, "why does migrate() hang?\n")  # warm
            turn(a, EDITED, "and the header?\n")  # edited inside the prefix: partial
            turn(b, OTHER, "summarize\n")  # a second sequence
            turn(c, THIRD, "release it\n")  # a third: the least recently used context is evicted
            turn(a, EDITED, "and now?\n")  # back: from the KV or restored
            chat = {"model": "modeld-tiny", "max_tokens": 6, "temperature": 0}
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Why does main() crash?"}]
            for _ in range(2):
                r = httpx.post(
                    f"{url}/v1/chat/completions",
                    json={**chat, "messages": messages},
                    headers={"X-Modeld-Job": "truth-http"},
                    timeout=120,
                )
                assert r.status_code == 200, r.text
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "And then?"}]
            too_long = httpx.post(
                f"{url}/v1/chat/completions",
                json={**chat, "messages": [{"role": "user", "content": "word " * 900}]},
                headers={"X-Modeld-Job": "truth-http"},
                timeout=120,
            )
            assert too_long.status_code == 400, too_long.text
            missing = httpx.post(
                f"{url}/v1/chat/completions", json={**chat, "model": "nope", "messages": messages}, timeout=60
            )
            assert missing.status_code == 404
            records = _records(url)
            reasons = [r["reason"] for r in records if r["job"] == "truth-grpc"]
            assert reasons[:3] == ["empty_cache", "full_match", "diverged"]
            refused = [r for r in records if r["error"]]
            assert {r["error"] for r in refused} == {"context_length_exceeded", "model_not_found"}
            state = _check(url, data, 0.0, sessions)
            assert [r["error"] for r in state["refusals"]] == ["context_length_exceeded"]
            status = json.loads(modeld("status", "--json", data_dir=data).stdout)
            evicted = sum(
                m["counters"]["evicted_to_ram"] + m["counters"]["evicted_to_disk"] for m in status["models"]
            )
            assert evicted >= 1
            a_id = a.session_id
    finally:
        _, err = stop(proc)
        assert "Traceback" not in err, err[-3000:]

    # A restart: the first workspace comes back from disk.
    proc, record = serve_http(data, *flags, backend="llama")
    url = record.http_endpoint
    try:
        started = json.loads(modeld("status", "--json", data_dir=data).stdout)["started_at"]
        with rc.connect(data_dir=data, job="truth-grpc") as client:
            again = client.open_session(request)
            turn(again, EDITED, "after the restart\n")
            turn(again, EDITED, "warm again\n")
            records = _records(url)
            after = [r for r in records if r["started_at"] >= started]
            assert after[0]["reason"] == "restored_from_disk" and after[0]["reused_disk"] > 0
            assert after[1]["reason"] == "full_match"
            _check(url, data, started, {again.session_id: again})
        assert any(r["session"] == a_id for r in records)  # the first life's records are still listed
    finally:
        _, err = stop(proc)
        assert "Traceback" not in err, err[-3000:]
