"""The benchmark's numbers: ratios, the two-run merge, measured causes, and reading the
llama-cpp-python server's own log for its prefill counts.

A two-turn workload on three systems, written out as the run documents ``make bench`` writes.
Then the agent-API loops (``bench/agent_apis.py``): the requests each turn sends, the
per-turn ratios and warm medians, and llama-server's log as the count of last resort.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the bench program is not installed

from bench.agent_apis import (
    Record,
    ResponsesClient,
    messages_bodies,
    responses_first,
    responses_new_items,
    server_log_counts,
)
from bench.analysis import agent_api_summary, agent_api_turns, causes, headline, merge
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


def test_the_daemons_count_of_tokens_computed_again_is_a_goal_of_zero_with_the_turns_named() -> None:
    """The runner reads modeld's ``recomputed`` counter around every turn (``recomputed`` per
    system and workload, and per turn): the headline holds it against 0, and the cause names
    the turns that computed tokens again."""
    doc = _doc("r1", 0.9)
    doc["workloads"][0]["goals"].append("recomputed_tokens")
    doc["turns"][1]["recomputed"] = 1420
    doc["recomputed"] = {"modeld": {"interleaved": 1420}, "modeld-http": {"interleaved": 0}}
    assert headline(doc)["interleaved"]["recomputed_tokens"] == 1420.0  # gRPC's count first
    merged = merge([doc])
    assert merged["interleaved"]["recomputed_tokens"]["met"] is False
    found = {c["ratio"]: c["cause"] for c in causes(doc, merged)}
    assert found["recomputed_tokens"] == (
        "modeld computed 1420 prompt tokens again that a session had computed before (turn 1 1420); "
        "the daemon's log and explain-context say where they went."
    )
    doc["recomputed"]["modeld"]["interleaved"] = 0
    assert merge([doc])["interleaved"]["recomputed_tokens"]["met"] is True
    assert headline(_doc("r0", 0.9))["interleaved"]["recomputed_tokens"] is None  # not read: not measured


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


# --- the agent-API loops -----------------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"


def test_the_messages_loop_grows_claude_codes_request_by_a_tool_call_its_result_and_an_ask() -> None:
    captured = json.loads((FIXTURES / "claude_messages_first.json").read_text())["body"]
    bodies = messages_bodies(4, 32)
    assert len(bodies) == 4
    for body in bodies:
        # every captured tool stays, in order, with its schema's properties; descriptions trimmed
        assert [t["name"] for t in body["tools"]] == [t["name"] for t in captured["tools"]]
        assert [sorted(t["input_schema"].get("properties", {})) for t in body["tools"]] == [
            sorted(t["input_schema"].get("properties", {})) for t in captured["tools"]
        ]
        assert max(len(t["description"]) for t in body["tools"]) <= 200
        assert body["metadata"] == captured["metadata"]  # Claude Code's session: the conversation key
        assert (body["model"], body["max_tokens"], body["temperature"], body["stream"]) == (
            "bench",
            32,
            0,
            True,
        )
    for before, after in itertools.pairwise(bodies):
        assert len(after["messages"]) == len(before["messages"]) + 2
        assistant, user = after["messages"][-2:]
        call = assistant["content"][-1]
        assert call["type"] == "tool_use" and call["name"] in {"Read", "Bash", "Edit"}
        assert user["content"][0] == {**user["content"][0], "type": "tool_result", "tool_use_id": call["id"]}
        # as Claude Code: cache_control only on the last block of the last message
        marked = [
            b
            for m in after["messages"]
            if isinstance(m["content"], list)
            for b in m["content"]
            if "cache_control" in b
        ]
        assert marked == [user["content"][-1]]
    assert isinstance(bodies[1]["messages"][1]["content"], str)  # the environment message, as a string


def test_the_responses_loop_sends_only_the_new_items_after_a_stored_response_or_everything_echoed() -> None:
    first = responses_first(32)
    names = [t["name"] for t in first["tools"]]
    assert all(t["type"] == "function" for t in first["tools"])
    assert len(names) == 12 and "spawn_agent" in names  # the namespace's five functions, flattened
    new = responses_new_items(3)
    assert [[i["type"] for i in items] for items in new] == [
        ["function_call", "function_call_output", "message"]
    ] * 2
    assert all(items[0]["call_id"] == items[1]["call_id"] for items in new)

    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
    stored, resend = ResponsesClient(first, previous_id=True), ResponsesClient(first, previous_id=False)
    for k, client in enumerate((stored, resend)):
        assert client.body([]) is first
        client.answered(_record(f"resp_{k}"), [answer])
    assert stored.body(new[0]) == {**first, "input": new[0], "previous_response_id": "resp_0"}
    assert resend.body(new[0]) == {**first, "input": [*first["input"], answer, *new[0]]}
    stored.answered(_record("resp_2"), [answer])
    resend.answered(_record("resp_3"), [answer])
    assert stored.body(new[1])["input"] == new[1]
    assert resend.body(new[1])["input"] == [*first["input"], answer, *new[0], answer, *new[1]]


def _record(response_id: str) -> Record:
    return Record(
        "responses", "x", 0, 0.1, 0.2, 100, 10, 10, 0, 8, "ok", "response.output_text.delta", response_id
    )


def _agent(system: str, turn: int, ttft: float, computed: int, sent: int, error: str = "") -> dict[str, Any]:
    return {
        "system": system,
        "turn": turn,
        "ttft_s": ttft,
        "computed_tokens": computed,
        "bytes_sent": sent,
        "error": error,
    }


def test_agent_loop_ratios_per_turn_and_medians_over_the_warm_turns() -> None:
    loop = {
        "records": [
            _agent("modeld", 0, 8.0, 9000, 20000),
            _agent("llama-server", 0, 10.0, 9000, 20000),
            _agent("modeld", 1, 1.0, 500, 13000),
            _agent("llama-server", 1, 2.0, 500, 21000),
            _agent("llama-server", 2, 1.0, 400, 22000),
            _agent("modeld", 2, 1.5, 400, 13000),
            _agent("modeld", 3, 0.9, 450, 13100),
            _agent("llama-server", 3, 0.0, 0, 0, error="HTTP 500"),  # failed: no ratio on this turn
        ]
    }
    rows = agent_api_turns(loop)
    assert [r["turn"] for r in rows] == [0, 1, 2, 3]
    assert [r["ttft_ratio"] for r in rows] == [0.8, 0.5, 1.5, None]
    assert rows[1]["bytes_ratio"] == 13000 / 21000 and rows[2]["computed_ratio"] == 1.0
    assert rows[3]["llama-server"] is None
    summary = agent_api_summary(loop)
    assert summary["warm_turns"] == 3  # the first turn is cold
    assert summary["ttft_ratio_median"] == 1.0  # median of 0.5 and 1.5; turn 3 has no pair
    assert (summary["ttft_ratio_min"], summary["ttft_ratio_max"]) == (0.5, 1.5)
    assert summary["modeld_ttft_s_median"] == 1.0  # turns 1-3
    assert summary["llama-server_ttft_s_median"] == 1.5  # turns 1-2
    assert summary["modeld_bytes_median"] == 13000


LLAMA_SERVER_LOG = """0.18.219.504 I slot print_timing: id  0 | task 0 | prompt eval time =   16886.13 ms /  9122 tokens (    1.85 ms per token,   540.21 tokens per second)
0.18.219.510 I slot print_timing: id  0 | task 0 |        eval time =    1058.38 ms /     8 tokens (  151.20 ms per token,     6.61 tokens per second)
0.18.219.511 I slot print_timing: id  0 | task 0 |       total time =   17944.51 ms /  9130 tokens
0.18.219.973 I slot      release: id  0 | task 0 | stop processing: n_tokens = 9129, truncated = 0
0.18.251.836 I slot get_availabl: id  0 | task -1 | selected slot by LCP similarity, f_sim_best = 0.947 (> 0.100 thold), f_keep = 0.999
0.21.955.327 I slot print_timing: id  0 | task 26 | prompt eval time =    1001.48 ms /   511 tokens (    1.96 ms per token,   510.24 tokens per second)
0.21.955.331 I slot print_timing: id  0 | task 26 |        eval time =    2700.62 ms /     8 tokens (  385.80 ms per token,     2.59 tokens per second)
0.21.955.910 I slot      release: id  0 | task 26 | stop processing: n_tokens = 9640, truncated = 0
0.26.301.786 I slot print_timing: id  0 | task 35 | prompt eval time =    1364.15 ms /   384 tokens (    3.55 ms per token,   281.49 tokens per second)
"""


def test_llama_servers_log_gives_each_finished_requests_computed_and_prompt_tokens() -> None:
    # The prompt is the slot's size at release minus the generated tokens plus the one never
    # evaluated; the last request has not been released yet, so it is not counted.
    assert server_log_counts(LLAMA_SERVER_LOG) == [(9122, 9122), (511, 9633)]


def _speculation_row(tps: list[float], ratios: list[float], same: bool | None) -> dict[str, Any]:
    return {
        "tps": tps,
        "ratio_to_modeld_off": ratios,
        "drafted": 100,
        "accepted": 90,
        "batches": 4,
        "forced": 0,
        "tokens": [64] * len(tps),
        "identical_to_reference": same,
    }


def _speculation_table(
    rewrite_ngram: list[float], differs: bool = False, theirs_differ: bool = False
) -> dict[str, Any]:
    """Three rounds: modeld ngram's rewrite tok/s given; modeld off decodes 10 tok/s every round,
    llama-server's n-gram modes 30 (simple) and 40 (mod). ``differs``: modeld ngram's greedy text
    parted from modeld off's; ``theirs_differ``: ngram-mod's from llama-server's."""
    return {
        "rewrite": {
            "modeld ngram": _speculation_row(rewrite_ngram, [x / 10 for x in rewrite_ngram], not differs),
            "modeld off": _speculation_row([10.0] * 3, [1.0] * 3, None),
            "llama-server": _speculation_row([11.0] * 3, [1.1] * 3, None),
            "llama-server ngram-simple": _speculation_row([30.0] * 3, [3.0] * 3, True),
            "llama-server ngram-mod": _speculation_row([40.0] * 3, [4.0] * 3, not theirs_differ),
        },
        "tool_call": {"modeld ngram": _speculation_row([12.0] * 3, [1.2, 1.4, 1.5], True)},
        "prose": {"modeld ngram": _speculation_row([10.0] * 3, [0.9, 1.0, 1.1], True)},
    }


def test_speculation_figures_take_the_best_llama_server_mode_and_merge_two_runs_with_their_goals() -> None:
    from bench.analysis import extra_figures, merge_extra
    from bench.speculation import summary

    first = summary(_speculation_table([20.0, 44.0, 48.0]))
    assert first["rewrite_over_off"] == 4.4  # the median of 2.0, 4.4, 4.8
    assert first["best_llama_server_ngram"] == "llama-server ngram-mod"  # 40 tok/s against 30
    assert first["rewrite_over_llama_server_ngram"] == 44.0 / 40.0  # paired by round, median
    assert first["tool_call_over_off"] == 1.4
    assert first["prose_over_off"] == 1.0
    assert first["rewrite_acceptance"] == 0.9
    assert first["rewrite_mean_draft"] == 25.0
    assert first["greedy_identical"] is True
    second = summary(_speculation_table([30.0, 30.0, 30.0], differs=True))
    assert second["greedy_identical"] is False  # one turn of modeld's differs: the goal is missed
    # llama-server's own partings are in the table, not in modeld's goal.
    assert summary(_speculation_table([30.0] * 3, theirs_differ=True))["greedy_identical"] is True
    # Where modeld parted, the report says whether it was at a near tie: plain decoding's top two
    # closer than batching moved the log-probabilities before the parting.
    from bench.report import _identical
    from bench.speculation import near_tie

    tie = {"token": 26, "plain": "a", "ngram": "b", "gap_plain": 0.005, "drift": 0.03}
    assert near_tie(tie) is True
    assert near_tie(dict(tie, gap_plain=0.2)) is False  # rounding cannot explain it: a bug
    assert near_tie(dict(tie, gap_plain=None)) is False  # not even in plain's top 5
    assert near_tie(None) is None  # did not part when decoded again
    parted = _speculation_table([30.0] * 3, differs=True)
    parted["rewrite"]["modeld ngram"]["near_tie"] = True
    assert summary(parted)["modeld_partings"] == 1 and summary(parted)["modeld_partings_at_near_ties"] == 1
    assert _identical({"summary": summary(parted)}) == "DIFFERS ✗ (1 of 1 workload(s) parted at a near tie)"
    assert _identical({"summary": first, "realistic": {"summary": first}}) == "identical ✓"
    # REALISTIC's report holds it to its one goal (speculation costs nothing), not COPYING's.
    from bench.speculation import goal_lines

    realistic_goals = "\n".join(goal_lines(summary(_speculation_table([9.6, 10.0, 10.4])), "realistic"))
    assert (
        "the lowest of rewrite, tool call and prose / modeld off: 1.00, goal >= 0.97: met" in realistic_goals
    )
    assert "goal >= 2" not in realistic_goals and "goal >= 1.3" not in realistic_goals

    newest = {"id": "r2", "speculation": {"summary": second}}
    older = {"id": "r1", "speculation": {"summary": first}}
    skipped = {"id": "r0", "speculation": {"skipped": "no reason"}}
    assert set(extra_figures(skipped, "speculation").values()) == {None}
    merged = merge_extra([newest, older, skipped], "speculation")
    rewrite = merged["rewrite_over_off"]
    assert rewrite["runs"] == [3.0, 4.4, None]
    assert abs(rewrite["value"] - 3.7) < 1e-12
    assert rewrite["met"] is True  # >= 2
    against = merged["rewrite_over_llama_server_ngram"]
    assert against["runs"] == [0.75, 1.1, None]
    assert against["met"] is False  # the mean 0.925 is below llama-server's best mode
    assert merged["prose_over_off"]["met"] is True  # 1.0 >= 0.97
    realistic = merged["realistic_worst_over_off"]
    assert realistic["runs"] == [None, None, None] and realistic["met"] is None  # not run

    # REALISTIC (drafts fail): the lowest of the three workloads against the 0.97 goal.
    flat = summary(_speculation_table([9.6, 10.0, 10.4]))  # rewrite 1.0, tool call 1.4, prose 1.0
    slow = dict(flat, prose_over_off=0.9)
    with_realistic = [
        {"id": "r2", "speculation": {"summary": second, "realistic": {"summary": flat}}},
        {"id": "r1", "speculation": {"summary": first, "realistic": {"summary": slow}}},
    ]
    worst = merge_extra(with_realistic, "speculation")["realistic_worst_over_off"]
    assert worst["runs"] == [1.0, 0.9]
    assert worst["met"] is False  # the mean 0.95 is below 0.97


def test_fleet_figures_hold_the_moved_turn_against_the_goal_and_the_report_shows_both_runs(
    tmp_path: Path,
) -> None:
    from bench.analysis import merge_extra
    from bench.report import fleet_lines, speculation_lines

    def fleet(modeld: float, llama: float, over: float | None) -> dict[str, Any]:
        def system(name: str, ratio: float) -> dict[str, Any]:
            return {"system": name, "moved_over_cold": {"median": ratio, "min": ratio, "max": ratio, "n": 2}}

        return {
            "prefix_tokens": 8192,
            "markdown": "# Fleet benchmark (a table)\n",
            "systems": [system("modeld", modeld), system("llama-server", llama)],
            "modeld_moved_over_llama_server_moved": over,
        }

    docs = [
        {"id": "r2", "fleet": fleet(0.08, 0.97, 0.06)},
        {"id": "r1", "fleet": fleet(0.14, 1.01, None)},
    ]
    merged = merge_extra(docs, "fleet")
    assert merged["moved_over_cold"]["runs"] == [0.08, 0.14]
    assert abs(merged["moved_over_cold"]["value"] - 0.11) < 1e-12
    assert merged["moved_over_cold"]["met"] is False  # the mean is above 0.1
    assert merged["modeld_moved_over_llama_server_moved"]["runs"] == [0.06, None]
    assert merged["modeld_moved_over_llama_server_moved"]["met"] is None  # no goal: context
    text = "\n".join(fleet_lines(docs))
    assert "| modeld: moved turn TTFT / cold re-prefill | ≤ 0.1 | 0.11 [0.08, 0.14] ✗ |" in text
    assert "Fleet benchmark (a table)" in text

    failed = [{"id": "r3", "speculation": {"error": "RuntimeError: modeld: HTTP 500"}}]
    text = "\n".join(speculation_lines(failed))
    assert "- Run r3: FAILED: RuntimeError: modeld: HTTP 500" in text
    assert "| file rewrite, decode tok/s modeld ngram / modeld off | ≥ 2 | - |" in text


def test_the_socket_row_reports_bytes_per_turn_and_their_cumulative_ratio() -> None:
    """``bench/agent_socket.py``'s section: per turn the HTTP and socket bytes, their ratio, and
    the ratio of all turns so far."""
    from bench.agent_socket import socket_lines

    rows = [
        {
            "turn": k,
            "http_bytes": h,
            "socket_bytes": s,
            "prompt_tokens": 100 * (k + 1),
            "cached_tokens": 100 * k,
        }
        | {"ttft_s": 0.5, "total_s": 1.0}
        for k, (h, s) in enumerate([(1000, 1000), (2000, 500), (3000, 500)])
    ]
    lines = socket_lines({"rows": rows})
    table = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert table == [
        "| 0 | 1000 | 1000 | 1.0x | 1.00x | 0 / 100 | 500.0 |",
        "| 1 | 2000 | 500 | 4.0x | 2.00x | 100 / 200 | 500.0 |",
        "| 2 | 3000 | 500 | 6.0x | 3.00x | 200 / 300 | 500.0 |",
    ]
    stopped = socket_lines({"rows": [], "error": "refused"})
    assert "- Note: the loop stopped: refused" in stopped


def test_a_failed_run_names_each_failure_once_in_its_last_lines() -> None:
    """What a CI summary shows of a run is its end: each failure, where it was and why, once
    (a turn's error is also a note; a Claude Code run's reason is its outcome)."""
    from bench.__main__ import failures

    why = "no modeld daemon is running: the owner record says 'starting'"
    doc: dict[str, Any] = {
        "notes": {"loop_small": ["modeld-http: pool flags", "llama-server failed to start: no binary"]},
        "turns": [{"system": "modeld", "workload": "loop_small", "turn": 1, "error": ""}],
        "agent_apis": {
            "loops": {
                "responses": {
                    "notes": [f"modeld failed at turn 0: {why}"],
                    "records": [{"loop": "responses", "system": "modeld", "turn": 0, "error": why}],
                }
            },
            "socket": None,
        },
        "claude_code": {"outcome": {"modeld": ["", "timed out after 600 s"]}},
        "families": {"families": {"glm": {"records": [], "notes": ["failed: a 500"], "errors": 1}}},
        "speculation": {"error": "the copying model did not load"},
        "fleet": None,
    }
    assert failures(doc) == [
        f"agent_apis (system modeld loop responses turn 0): {why}",
        "speculation: the copying model did not load",
        "workloads: llama-server failed to start: no binary",
        "families: failed: a 500",
        "claude_code (modeld run 1): timed out after 600 s",
    ]
    assert failures({"turns": [{"system": "modeld", "turn": 0}], "notes": {}}) == []
