"""Prefix-cache hits are counted by the tier they came from, and the warm state is visible in
the metrics, in process with real tiers: a context evicted to the RAM tier and restored, then
(after a restart of the engine on the same data directory) restored from the disk tier. Parsed
with prometheus_client's own parser."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from modeld.contract import OpenSessionRequest, PrefixInput, PrefixStatus, ReuseDecision
from modeld.engine import Engine
from modeld.observe.metrics import Metrics, source_of
from modeld.settings import Residency

CODER = (("model", "coder"),)
A = "a" * 200 + "\n"  # 202 tokens with BOS: above snapshot_min_tokens (64)
B = "b" * 200 + "\n"


def _values(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _hits(v: dict[tuple[str, tuple[tuple[str, str], ...]], float], source: str) -> float:
    return v.get(("modeld_prefix_cache_hits_total", (("model", "coder"), ("source", source))), 0.0)


def test_hits_from_the_ram_tier_then_the_disk_tier_are_labelled_so() -> None:
    data = Path(tempfile.mkdtemp(prefix="mdm"))
    request = OpenSessionRequest(path="repo", model_name="coder")
    # One sequence: session b's prefix evicts a's warm context to the RAM tier.
    with Engine(backends=("memory",), residency=Residency(sequences=1), data_dir=data) as engine:
        metrics = Metrics(engine.status)
        a = metrics.observe(engine.open_session(request))
        b = metrics.observe(engine.open_session(request))
        assert a.ensure_prefix(PrefixInput(text=A)).reuse.outcome == "cold"
        assert b.ensure_prefix(PrefixInput(text=B)).reuse.outcome == "cold"
        again = a.ensure_prefix(PrefixInput(text=A))
        assert (again.reuse.reason, again.reused_tokens, again.restore_ms > 0) == (
            "restored_from_ram",
            202,
            True,
        )
        v = _values(metrics)
        assert _hits(v, "ram") == 202
        assert _hits(v, "kv") == 0
        assert v[("modeld_prefix_cache_queries_total", CODER)] == 3 * 202
        assert v[("modeld_evictions_total", (("model", "coder"), ("to", "ram")))] == 2  # a's, then b's
        assert v[("modeld_evictions_total", (("model", "coder"), ("to", "dropped")))] == 0
        assert v[("modeld_warm_contexts", (("model", "coder"), ("tier", "kv")))] == 1
        assert v[("modeld_warm_contexts", (("model", "coder"), ("tier", "ram")))] == 2
        assert v[("modeld_tier_entries", (("tier", "ram"),))] == 2
        assert (
            v[("modeld_tier_bytes", (("tier", "ram"),))]
            == v[("modeld_warm_context_bytes", (("model", "coder"), ("tier", "ram")))]
        )
        assert v[("modeld_worker_state", (("model", "coder"), ("state", "ready")))] == 1
        assert v[("modeld_slots", CODER)] == 1
    # The engine persisted its warm contexts on shutdown; a new one finds them on disk.
    with Engine(backends=("memory",), residency=Residency(sequences=1), data_dir=data) as engine:
        metrics = Metrics(engine.status)
        a = metrics.observe(engine.open_session(request))
        restored = a.ensure_prefix(PrefixInput(text=A))
        assert (restored.reuse.reason, restored.reused_tokens) == ("restored_from_disk", 202)
        v = _values(metrics)
        assert _hits(v, "disk") == 202
        assert _hits(v, "ram") == 0
        assert v[("modeld_tier_entries", (("tier", "disk"),))] >= 1


def test_a_partial_reuse_of_a_restored_snapshot_counts_for_its_tier() -> None:
    status = PrefixStatus(
        150, 52, 0, 202, 202, 0, "", "", "", ReuseDecision("partial", "diverged", "", tier="disk")
    )
    assert source_of(status) == "disk"
    assert source_of(replace(status, reuse=ReuseDecision("partial", "diverged", "", tier="kv"))) == "kv"
    evicted = ReuseDecision("cold", "evicted", "", tier="ram")  # where it went, not where hits came from
    assert source_of(replace(status, reused_tokens=0, reuse=evicted)) == "kv"
