"""The metrics decorator counts exactly what the contract reports, in process (the transports
are covered by tests/http/test_openai.py): prefix-cache queries and hits, prefilled and generated
tokens, and the tier a hit came from."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from modeld.contract import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.observe.metrics import Metrics, model_label, source_of
from modeld.settings import Residency


def _values(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_turn_is_counted_token_for_token() -> None:
    with Engine(backends=("memory",)) as engine:
        metrics = Metrics(engine.status)
        session = metrics.observe(engine.open_session(OpenSessionRequest(path="repo", model_name="coder")))
        session.ensure_prefix(PrefixInput(text="system prompt\n"))  # 15 tokens with BOS, all new
        session.prefill_suffix(SuffixInput(text="question\n"))  # 9 tokens
        final = list(session.decode(DecodeConfig(max_tokens=5)))[-1]
        session.ensure_prefix(PrefixInput(text="system prompt\nmore\n"))  # extends what is resident
        v = _values(metrics)
        m = (("model", "coder"),)
        assert v[("modeld_prefix_cache_queries_total", m)] == 15 + 20
        assert v[("modeld_prefix_cache_hits_total", (("model", "coder"), ("source", "kv")))] == 15
        assert v[("modeld_prompt_tokens_prefilled_total", m)] == 15 + 9 + 5
        assert final.usage is not None and (final.usage.prompt_tokens, final.usage.cached_tokens) == (24, 0)
        assert v[("modeld_prompt_tokens_total", m)] == 24
        assert v[("modeld_generation_tokens_total", m)] == 5
        assert v[("modeld_requests_total", (("finish_reason", "length"), ("model", "coder")))] == 1
        assert v[("modeld_time_to_first_token_seconds_count", m)] == 1
        assert v[("modeld_inter_token_latency_seconds_count", m)] == 4
        assert v[("modeld_sessions_open", ())] == 1
        assert v[("modeld_resident_tokens", (("backend", "memory"), ("model", "coder")))] == 20
        session.close()


def test_a_prefix_restored_after_displacement_counts_as_prefilled() -> None:
    # One sequence per model and no RAM tier: the second session displaces the first one's KV.
    with Engine(backends=("memory",), residency=Residency(sequences=1, ram_tier_bytes=0)) as engine:
        metrics = Metrics(engine.status)
        request = OpenSessionRequest(path="repo", model_name="coder")
        a = metrics.observe(engine.open_session(request))
        b = metrics.observe(engine.open_session(request))
        a.ensure_prefix(PrefixInput(text="aaaa\n"))  # 6 tokens
        b_status = b.ensure_prefix(PrefixInput(text="bbbb\n"))
        suffix = a.prefill_suffix(SuffixInput(text="q\n"))  # a's prefix again, and 2
        assert suffix.restored_tokens == 6
        v = _values(metrics)
        prefilled = 6 + b_status.prefilled_tokens + suffix.restored_tokens + suffix.suffix_tokens
        assert v[("modeld_prompt_tokens_prefilled_total", (("model", "coder"),))] == prefilled


def test_tiers_and_labels() -> None:
    from modeld.contract import PrefixStatus, ReuseDecision

    status = PrefixStatus(10, 0, 0, 10, 10, 0, "", "", "", ReuseDecision("warm", "restored_from_ram", ""))
    assert source_of(status) == "ram"
    assert source_of(replace(status, reuse=ReuseDecision("warm", "restored_from_disk", ""))) == "disk"
    assert source_of(replace(status, reuse=ReuseDecision("warm", "extended", ""))) == "kv"
    assert model_label("/home/me/models/qwen.gguf") == "qwen.gguf"
    metrics = Metrics()
    labels = {metrics.label(f"model-{i}") for i in range(40)}
    assert len(labels) == 33 and "other" in labels  # at most 32 distinct model labels
