"""The families benchmark's figures and report section (``bench/families.py``, issue 31).

Per family, over the warm turns (every turn after the first): TTFT medians, the per-turn ratio
modeld / llama-server (median, range) against the goal (<= 0.8), the servers' own prefill ratio,
and the turns where modeld computed more prompt tokens than llama-server (goal: none). Apart from
``bench/families.py`` so that ``bench/report.py`` can show the section without importing the
loops (which import the agent-API loops, which import the report).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["TTFT_GOAL", "families_lines", "family_summary"]

SYSTEMS = ("modeld", "llama-server")
TTFT_GOAL = 0.8


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def family_summary(loop: dict[str, Any]) -> dict[str, Any]:
    """One family's warm-turn figures: TTFT medians, the per-turn ratio modeld / llama-server
    (median, range), tokens computed, the turns where modeld computed more, the goals."""
    counted = {(r["system"], r["turn"]): r for r in loop["records"] if r["computed_tokens"] is not None}
    by = {key: r for key, r in counted.items() if not r.get("error")}  # TTFT: answered turns only
    turns = sorted({r["turn"] for r in loop["records"]})
    warm = [t for t in turns if t > 0]
    out: dict[str, Any] = {"warm_turns": len(warm)}
    ratios, first_ratios, more = [], [], []
    for t in warm:
        m, o = by.get(("modeld", t)), by.get(("llama-server", t))
        if m and o and o["ttft_s"] > 0:
            ratios.append(m["ttft_s"] / o["ttft_s"])
            if o["first_chunk_s"] > 0:
                first_ratios.append(m["first_chunk_s"] / o["first_chunk_s"])
    for t in turns:
        m, o = counted.get(("modeld", t)), counted.get(("llama-server", t))
        mc, oc = (m or {}).get("computed_tokens"), (o or {}).get("computed_tokens")
        if mc is not None and oc is not None and mc > oc:
            more.append(t)
    for system in SYSTEMS:
        mine = [by[(system, t)] for t in warm if (system, t) in by]
        out[f"{system}_ttft_s_median"] = _median([r["ttft_s"] for r in mine])
        out[f"{system}_computed_median"] = _median(
            [float(counted[(system, t)]["computed_tokens"]) for t in warm if (system, t) in counted]
        )
        out[f"{system}_computed_total"] = sum(
            int(r["computed_tokens"]) for t in turns if (r := counted.get((system, t))) is not None
        )
    out["ttft_ratio_median"] = _median(ratios)
    out["ttft_ratio_min"] = min(ratios) if ratios else None
    out["ttft_ratio_max"] = max(ratios) if ratios else None
    out["first_chunk_ratio_median"] = _median(first_ratios)
    out["more_computed_turns"] = more
    compared = [t for t in turns if ("modeld", t) in counted and ("llama-server", t) in counted]
    out["computed_met"] = not more if compared else None
    out["ttft_met"] = out["ttft_ratio_median"] <= TTFT_GOAL if ratios else None
    prefill = [
        counted[("modeld", t)]["prompt_ms"] / counted[("llama-server", t)]["prompt_ms"]
        for t in warm
        if t in compared and counted[("modeld", t)]["prompt_ms"] and counted[("llama-server", t)]["prompt_ms"]
    ]
    out["prefill_ratio_median"] = _median(prefill)
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _int(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _mark(met: bool | None) -> str:
    return "" if met is None else " ✓" if met else " ✗"


def families_lines(result: dict[str, Any]) -> list[str]:
    """The families' section of a report: per family the warm-turn figures, then every turn."""
    lines = [
        "## An agent loop per model family: modeld against llama-server `--jinja` (`bench/families.py`)",
        "",
        f"Each family's template and control tokens on the generated `{result['model']}` model, "
        f"{result['turns']} turns over `/v1/chat/completions`, greedy, {result['max_tokens']}-token answers, "
        f"streamed; the same request bodies to both systems (system prompt of {result['system_chars']} characters, "
        "Claude Code's Read/Bash/Edit tools, a tool call and its result per turn, an answer and a new instruction "
        "every second turn). Both servers started afresh per family. TTFT: request sent to the first chunk with "
        "generated content, client-observed; `first chunk`: to the first chunk of any kind. Computed: prompt "
        "tokens the system evaluated (modeld's usage, llama-server's `timings.prompt_n`). Ratios modeld / "
        f"llama-server over the warm turns (every turn after the first). Goals (issue 31): modeld computes no "
        f"more than llama-server on any turn; warm TTFT ratio <= {TTFT_GOAL}. `load`: the 1-minute load average "
        "when the family's loop ended (a shared machine: read medians and ranges, not single numbers).",
        "",
        "| family | warm TTFT ms modeld | llama-server | ratio median (range) | first chunk ratio | server prefill ms ratio | computed "
        "per warm turn modeld / llama-server (all turns) | turns modeld computed more | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, loop in result["families"].items():
        if not loop["records"]:
            lines.append(f"| {name} | failed: {'; '.join(loop['notes'])[:300]} | | | | | | | |")
            continue
        s = family_summary(loop)
        ratio = (
            "-"
            if s["ttft_ratio_median"] is None
            else f"{s['ttft_ratio_median']:.2f} ({s['ttft_ratio_min']:.2f}-{s['ttft_ratio_max']:.2f}){_mark(s['ttft_met'])}"
        )
        lines.append(
            f"| {name} | {_ms(s['modeld_ttft_s_median'])} | {_ms(s['llama-server_ttft_s_median'])} | {ratio} | "
            f"{_num(s['first_chunk_ratio_median'])} | {_num(s['prefill_ratio_median'])} | "
            f"{_int(s['modeld_computed_median'])} / "
            f"{_int(s['llama-server_computed_median'])} ({s['modeld_computed_total']} / "
            f"{s['llama-server_computed_total']}) | {', '.join(map(str, s['more_computed_turns'])) or 'none'}"
            f"{_mark(s['computed_met'])} | {_num((loop.get('load_average') or [None])[0])} |"
        )
    lines += ["", "Per turn (TTFT ms; computed / prompt tokens; the server's own prefill ms):", ""]
    lines += ["| family | turn | modeld TTFT | llama-server TTFT | modeld computed / prompt | llama-server "
              "computed / prompt | prefill ms modeld / llama-server |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, loop in result["families"].items():
        by = {(r["system"], r["turn"]): r for r in loop["records"]}
        for t in sorted({r["turn"] for r in loop["records"]}):
            m, o = by.get(("modeld", t)) or {}, by.get(("llama-server", t)) or {}
            lines.append(
                f"| {name} | {t}{'' if t else ' (cold)'} | {_ms(m.get('ttft_s'))} | {_ms(o.get('ttft_s'))} | "
                f"{m.get('computed_tokens', '-')} / {m.get('prompt_tokens', '-')} | {o.get('computed_tokens', '-')} / "
                f"{o.get('prompt_tokens', '-')} | {_int(m.get('prompt_ms'))} / {_int(o.get('prompt_ms'))} |"
            )
    notes = [f"- {name}: {note}" for name, loop in result["families"].items() for note in loop["notes"]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return [*lines, ""]
