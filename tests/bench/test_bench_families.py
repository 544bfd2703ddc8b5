"""The families benchmark (``bench/families.py``, issue 31): the requests every family's loop
sends, and its figures.

The requests: the same bodies to both systems, each turn the previous conversation plus a
scripted tool call and its result (an answer and a new instruction every second turn), and every
turn renders with the family's own template (modeld's renderer, as the daemon renders it): a
template that refused the bench's conversation would make the family's figures an error. The
figures: the warm-turn TTFT ratio (median, range), the turns where modeld computed more than
llama-server, and a llama-server turn whose output its parser refused (the prefill counts, the
TTFT is not compared).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the bench program is not installed

from bench.families import FAMILY_TURNS, bodies, merge_runs
from bench.families_exactness import compare_answers
from bench.families_report import families_lines, family_summary, spread_lines
from modeld.engine.chat import ChatRenderer, Message
from modeld.testmodels.families import FAMILIES, Family


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_every_turn_extends_the_last_and_renders_with_the_familys_template(fam: Family) -> None:
    turns = bodies(fam.name, FAMILY_TURNS, 8)
    assert len(turns) == FAMILY_TURNS
    assert bodies(fam.name, FAMILY_TURNS, 8) == turns  # deterministic: both systems get these bytes
    renderer = ChatRenderer(fam.template, bos_token=fam.bos or "<|endoftext|>", eos_token=fam.eos)
    previous: list[dict[str, Any]] = []
    for k, body in enumerate(turns):
        messages = body["messages"]
        assert messages[: len(previous)] == previous
        added = messages[len(previous) :]
        if k == 0:
            assert [m["role"] for m in added] == ["system", "user"]
        elif fam.tools:
            roles = ["assistant", "tool"] + (["assistant", "user"] if k % 2 == 0 else [])
            assert [m["role"] for m in added] == roles
            (call,) = added[0]["tool_calls"]
            assert len(call["id"]) == 9 and call["id"].isalnum()  # Mistral's rule
            assert added[1]["tool_call_id"] == call["id"]
            assert json.loads(call["function"]["arguments"])
        else:  # Gemma 3: no tools; the step's output in the user's message
            assert [m["role"] for m in added] == ["assistant", "user"]
            assert "tools" not in body
        previous = messages
        given = body.get("tools")
        text = renderer.render(
            [Message(m["role"], m["content"], (), json.dumps(m)) for m in messages],
            given,
            add_generation_prompt=True,
        )
        word = max(re.findall(r"[A-Za-z_]+", messages[-1]["content"]), key=len)
        assert word in text  # the newest message is in the prompt (some templates quote it as JSON)
    assert {t["function"]["name"] for t in turns[0].get("tools", [])} == (
        {"Read", "Bash", "Edit"} if fam.tools else set()
    )


def _record(system: str, turn: int, ttft: float, computed: int | None, error: str = "") -> dict[str, Any]:
    return {
        "family": "qwen3",
        "system": system,
        "turn": turn,
        "ttft_s": ttft,
        "first_chunk_s": ttft,
        "total_s": ttft + 0.5,
        "bytes_sent": 1000,
        "prompt_tokens": 2000 + 400 * turn,
        "computed_tokens": computed,
        "cached_tokens": None,
        "output_tokens": 8,
        "prompt_ms": ttft * 900,
        "counted_by": "usage",
        "first_event": "content",
        "error": error,
    }


def _loop() -> dict[str, Any]:
    return {
        "family": "qwen3",
        "notes": [],
        "load_average": [1.5, 1.0, 1.0],
        "records": [
            _record("modeld", 0, 9.0, 2000),
            _record("llama-server", 0, 8.0, 2000),
            _record("llama-server-reuse", 0, 8.0, 2000),
            _record("modeld", 1, 0.6, 400),
            _record("llama-server", 1, 1.0, 400),
            _record("llama-server-reuse", 1, 1.0, 400),
            _record("modeld", 2, 1.8, 800),  # the template re-rendered: both exact systems compute 800
            _record("llama-server", 2, 1.2, 800),
            _record("llama-server-reuse", 2, 0.9, 380),  # --cache-reuse shifted a chunk
            _record("modeld", 3, 0.7, 300),
            _record("llama-server", 3, 1.0, 300),
            _record("llama-server-reuse", 3, 1.4, 300),
        ],
    }


def test_warm_ratio_median_and_range_against_both_llama_servers_and_the_turns_modeld_computed_more() -> None:
    loop = _loop()
    s = family_summary(loop)
    assert s["warm_turns"] == 3
    # against llama-server's default (the goal's baseline)
    assert s["ttft_ratio_median"] == pytest.approx(0.7)  # 0.6, 1.5, 0.7: the cold turn left out
    assert (s["ttft_ratio_min"], s["ttft_ratio_max"]) == (pytest.approx(0.6), pytest.approx(1.5))
    assert s["ttft_met"] is True
    assert s["more_computed_turns"] == [] and s["computed_met"] is True
    # against --cache-reuse 256
    reuse = s["reuse"]
    assert reuse["ttft_ratio_median"] == pytest.approx(0.6)  # 0.6, 2.0, 0.5
    assert reuse["more_computed_turns"] == [2] and reuse["computed_met"] is False
    assert s["modeld_computed_total"] == 3500 and s["llama-server_computed_total"] == 3500
    assert s["llama-server-reuse_computed_total"] == 3080
    lines = "\n".join(families_lines(_result(loop)))
    assert "| qwen3 | 700 | 1000 | 1000 | 0.70 (0.60-1.50) ✓ | 0.60 (0.50-2.00) ✓ |" in lines
    assert "| 400 / 400 / 380 (3500 / 3500 / 3080) | none ✓ | 2 ✗ | 1.50 |" in lines


def test_runs_merged_give_each_familys_spread_over_the_runs() -> None:
    second = _loop()
    for r in second["records"]:
        if r["system"] == "modeld":
            r["ttft_s"] *= 2  # ratios 1.2, 3.0, 1.4 against the default: median 1.4
    merged = merge_runs([_result(_loop()), _result(second)])
    assert [len(v) for v in merged["repeats"].values()] == [2]
    lines = "\n".join(families_lines(merged))
    assert (
        "| qwen3 | 1.05 (0.70-1.40; spread 0.70; 2 runs) ✗ | 0.90 (0.60-1.20; spread 0.60; 2 runs) |" in lines
    )


def test_a_shifted_answer_is_told_apart_from_an_exact_one() -> None:
    def answer(*top: tuple[str, float]) -> dict[str, Any]:
        content = [{"token": t, "logprob": p, "top_logprobs": [{"token": t, "logprob": p}]} for t, p in top]
        return {"choices": [{"logprobs": {"content": content}}]}

    fresh = answer(("a", -0.5), ("b", -1.0), ("c", -0.2))
    assert compare_answers(fresh, fresh) == {
        "positions": 3,
        "tokens_agree": 3,
        "first_logprob_gap": 0.0,
        "max_logprob_gap": 0.0,
        "top5_same_at_first": True,
    }
    shifted = compare_answers(answer(("a", -0.49), ("b", -1.1), ("x", -0.3)), fresh)
    assert shifted["tokens_agree"] == 2
    assert shifted["first_logprob_gap"] == pytest.approx(0.01)
    assert shifted["max_logprob_gap"] == pytest.approx(0.1)


def test_a_turn_llama_servers_parser_refused_counts_its_prefill_but_not_its_ttft() -> None:
    refused = "stream error: The model produced output that does not match the expected format"
    loop = {
        "family": "gpt-oss",
        "notes": [],
        "records": [
            _record("modeld", 0, 9.0, 2000),
            _record("llama-server", 0, 0.0, 2000, refused),
            _record("modeld", 1, 0.5, 400),
            _record("llama-server", 1, 0.0, 400, refused),
        ],
    }
    s = family_summary(loop)
    assert s["ttft_ratio_median"] is None and s["ttft_met"] is None  # nothing to compare
    assert s["computed_met"] is True and s["more_computed_turns"] == []
    assert s["llama-server_computed_total"] == 2400
    assert s["judged_on"] is None and s["goal_met"] is None  # no prefill time either
    # its own prefill time (from its log): the goal is judged on the servers' prefill ratio
    for r in loop["records"]:
        if r["system"] == "llama-server":
            r["prompt_ms"] = 500.0 + 500.0 * r["turn"]
    s = family_summary(loop)
    assert s["ttft_ratio_median"] is None and s["prefill_ratio_median"] == pytest.approx(0.45)  # 450 / 1000
    assert s["judged_on"] == "prefill" and s["goal_met"] is True
    lines = "\n".join(families_lines(_result(loop)))
    assert "| 0.45 ✓ (judged on it: no TTFT compares) |" in lines
    slow = [dict(r, prompt_ms=r["prompt_ms"] * 2) if r["system"] == "modeld" else r for r in loop["records"]]
    merged = spread_lines({"gpt-oss": [loop, dict(loop, records=slow)]})
    assert "| gpt-oss | prefill: 0.68 (0.45-0.90; spread 0.45; 2 runs) ✓ | - |" in "\n".join(merged)


def _result(loop: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "realistic",
        "turns": 4,
        "max_tokens": 8,
        "system_chars": 2000,
        "load_average": (1.0, 1.0, 1.0),
        "families": {loop["family"]: loop},
        "errors": 0,
        "duration_s": 1.0,
    }


def test_the_exactness_lines_show_each_system_against_a_fresh_server() -> None:
    from bench.families_report import exactness_lines

    pair = {"computed_warm": 384, "computed_fresh": 3099, "positions": 16, "tokens_agree": 0}
    row = {
        "model": "realistic",
        "family": "qwen3",
        "llama-server --cache-reuse 256": {
            **pair,
            "first_logprob_gap": float("inf"),
            "max_logprob_gap": None,
        },
        "modeld": {
            **pair,
            "computed_warm": 818,
            "tokens_agree": 16,
            "first_logprob_gap": 0.0,
            "max_logprob_gap": 0.0,
        },
    }
    lines = exactness_lines([json.loads(json.dumps(row))])  # as read back from exactness.jsonl
    assert (
        "| realistic | qwen3 | llama-server --cache-reuse 256 | 384 / 3099 | 0 of 16 | no top-5 token in common | - |"
        in lines
    )
    assert "| realistic | qwen3 | modeld | 818 / 3099 | 16 of 16 | 0 | 0 |" in lines
    assert exactness_lines([]) == []
