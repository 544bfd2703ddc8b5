"""The benchmark's numbers: ratios, the two-run merge, measured causes, and reading the
llama-cpp-python server's own log for its prefill counts.

A two-turn workload on three systems, written out as the run documents ``make bench`` writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench program is not installed

from bench.analysis import causes, headline, merge
from bench.systems.lcp_server import parse_prefills


def _turn(system: str, turn: int, ttft: float, prefilled: int, tps: float = 40.0) -> dict[str, Any]:
    return {
        "system": system,
        "workload": "interleaved",
        "turn": turn,
        "ttft_s": ttft,
        "total_s": ttft + 1.0,
        "completion_tokens": 32,
        "decode_tps": tps,
        "prefilled": prefilled,
        "prompt_tokens": 1700,
        "error": "",
    }


def _doc(run_id: str, modeld_warm_ttft: float) -> dict[str, Any]:
    """Turn 0 opens workspace 0 (cold everywhere); turn 1 returns to it (warm)."""
    return {
        "id": run_id,
        "workloads": [
            {
                "name": "interleaved",
                "turns": 2,
                "warm": [1],
                "ideal_prefill": [1700, 140],
                "restart_before": [],
                "continues": "",
                "goals": ["modeld_over_limit", "modeld_over_llama_server", "decode_over_limit"],
                "fix": "several warm sequences per model",
            }
        ],
        "turns": [
            _turn("modeld", 0, 10.0, 1700),
            _turn("modeld", 1, modeld_warm_ttft, 1560, tps=39.0),
            _turn("limit", 0, 10.0, 1700),
            _turn("limit", 1, 0.8, 140),
            _turn("llama-server", 0, 9.0, 1700),
            _turn("llama-server", 1, 0.5, 140),
        ],
    }


def test_warm_ratios_and_decode_ratio_of_one_run() -> None:
    row = headline(_doc("r1", 8.0))["interleaved"]
    assert row["modeld_over_limit"] == 10.0  # 8.0 / 0.8 on the one warm turn
    assert row["modeld_over_llama_server"] == 16.0  # 8.0 / 0.5
    assert row["modeld_over_lcp_server"] is None  # lcp-server did not run
    assert row["decode_over_limit"] == (1.0 + 39.0 / 40.0) / 2  # median of two per-turn ratios
    assert row["http_overhead_ms"] is None


def test_two_runs_merge_into_a_mean_with_the_spread_and_a_measured_cause() -> None:
    newest, older = _doc("r2", 8.8), _doc("r1", 8.0)
    merged = merge([newest, older])
    cell = merged["interleaved"]["modeld_over_limit"]
    assert cell["runs"] == [11.0, 10.0]
    assert cell["value"] == 10.5
    assert abs(cell["spread"] - 0.1) < 1e-12
    assert cell["met"] is False
    assert merged["interleaved"]["modeld_over_lcp_server"]["met"] is None  # not measured
    assert merged["interleaved"]["restart_over_cold"]["goal"] is None  # not a goal here

    found = {c["ratio"]: c["cause"] for c in causes(newest, merged)}
    assert found["modeld_over_limit"] == (
        "modeld prefilled 1560 tokens per warm turn (median), limit 140, a perfect system 140. "
        "modeld recomputes what limit reuses. What would fix it: several warm sequences per model."
    )
    assert set(found) == {"modeld_over_limit", "modeld_over_llama_server"}  # decode 0.99 meets >= 0.97


LCP_LOG = """\
Llama._create_completion: cache miss
llama_perf_context_print: prompt eval time =     812.00 ms /  1700 tokens
llama_perf_context_print:       total time =    1650.00 ms /  1732 tokens
Llama._create_completion: cache save
Llama._create_completion: cache hit
Llama.generate: 1560 prefix-match hit, remaining 140 prompt tokens to eval
llama_perf_context_print: prompt eval time =      70.00 ms /   140 tokens
llama_perf_context_print:       total time =     900.00 ms /   172 tokens
Llama.generate: full prompt already cached, skipping reset
llama_perf_context_print:       total time =     800.00 ms /    32 tokens
Llama.generate: 12 prefix-match hit, remaining 3 prompt tokens to eval
"""


def test_the_lcp_server_log_gives_one_prefill_count_per_finished_request() -> None:
    # A request without a prefix-match line evaluated the whole prompt (None); the last request
    # has not printed its timings yet, so it is not counted.
    assert parse_prefills(LCP_LOG) == [None, 140, 0]
