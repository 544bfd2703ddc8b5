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

__all__ = ["BASELINES", "TTFT_GOAL", "exactness_lines", "families_lines", "family_summary", "spread_lines"]

SYSTEMS = ("modeld", "llama-server", "llama-server-reuse")
BASELINES = ("llama-server", "llama-server-reuse")  # the goal's (llama-server's default), then --cache-reuse
TTFT_GOAL = 0.8


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _against(loop: dict[str, Any], baseline: str) -> dict[str, Any]:
    """modeld against one llama-server configuration over a loop's turns: the per-turn warm TTFT
    ratio (median, range), the servers' prefill ratio, the turns where modeld computed more."""
    counted = {(r["system"], r["turn"]): r for r in loop["records"] if r["computed_tokens"] is not None}
    by = {key: r for key, r in counted.items() if not r.get("error")}  # TTFT: answered turns only
    turns = sorted({r["turn"] for r in loop["records"]})
    warm = [t for t in turns if t > 0]
    ratios, first_ratios, more = [], [], []
    for t in warm:
        m, o = by.get(("modeld", t)), by.get((baseline, t))
        if m and o and o["ttft_s"] > 0:
            ratios.append(m["ttft_s"] / o["ttft_s"])
            if o["first_chunk_s"] > 0:
                first_ratios.append(m["first_chunk_s"] / o["first_chunk_s"])
    for t in turns:
        m, o = counted.get(("modeld", t)), counted.get((baseline, t))
        mc, oc = (m or {}).get("computed_tokens"), (o or {}).get("computed_tokens")
        if mc is not None and oc is not None and mc > oc:
            more.append(t)
    compared = [t for t in turns if ("modeld", t) in counted and (baseline, t) in counted]
    prefill = [
        counted[("modeld", t)]["prompt_ms"] / counted[(baseline, t)]["prompt_ms"]
        for t in warm
        if t in compared and counted[("modeld", t)]["prompt_ms"] and counted[(baseline, t)]["prompt_ms"]
    ]
    prefill_median = _median(prefill)
    return {
        "ttft_ratio_median": _median(ratios),
        "ttft_ratio_min": min(ratios) if ratios else None,
        "ttft_ratio_max": max(ratios) if ratios else None,
        "first_chunk_ratio_median": _median(first_ratios),
        "more_computed_turns": more,
        "computed_met": not more if compared else None,
        "ttft_met": _median(ratios) <= TTFT_GOAL if ratios else None,  # type: ignore[operator]
        "prefill_ratio_median": prefill_median,
        # the goal, judged on the warm TTFT; where no TTFT compares (llama-server's output parser
        # refused every turn, gpt-oss and Command R) on the servers' own prefill time instead
        "judged_on": "ttft" if ratios else "prefill" if prefill_median is not None else None,
        "goal_met": (
            _median(ratios) <= TTFT_GOAL  # type: ignore[operator]
            if ratios
            else prefill_median <= TTFT_GOAL
            if prefill_median is not None
            else None
        ),
    }


def family_summary(loop: dict[str, Any]) -> dict[str, Any]:
    """One family's warm-turn figures: per system the TTFT median and tokens computed; against
    llama-server at its default (the goal's baseline) the ratios at the top level, against
    ``--cache-reuse 256`` the same under ``reuse`` (None when that system did not run)."""
    counted = {(r["system"], r["turn"]): r for r in loop["records"] if r["computed_tokens"] is not None}
    by = {key: r for key, r in counted.items() if not r.get("error")}
    turns = sorted({r["turn"] for r in loop["records"]})
    warm = [t for t in turns if t > 0]
    out: dict[str, Any] = {"warm_turns": len(warm)}
    for system in SYSTEMS:
        mine = [by[(system, t)] for t in warm if (system, t) in by]
        out[f"{system}_ttft_s_median"] = _median([r["ttft_s"] for r in mine])
        out[f"{system}_computed_median"] = _median(
            [float(counted[(system, t)]["computed_tokens"]) for t in warm if (system, t) in counted]
        )
        totals = [int(r["computed_tokens"]) for t in turns if (r := counted.get((system, t))) is not None]
        out[f"{system}_computed_total"] = sum(totals) if totals else None
    out.update(_against(loop, BASELINES[0]))
    ran = {r["system"] for r in loop["records"]}
    out["reuse"] = _against(loop, BASELINES[1]) if BASELINES[1] in ran else None
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _int(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _mark(met: bool | None) -> str:
    return "" if met is None else " ✓" if met else " ✗"


def _ratio(s: dict[str, Any] | None) -> str:
    if not s or s["ttft_ratio_median"] is None:
        return "-"
    return f"{s['ttft_ratio_median']:.2f} ({s['ttft_ratio_min']:.2f}-{s['ttft_ratio_max']:.2f}){_mark(s['ttft_met'])}"


def _prefill(s: dict[str, Any]) -> str:
    """The servers' prefill ratio, marked against the goal where it is what the goal is judged on."""
    mark = _mark(s["goal_met"]) + " (judged on it: no TTFT compares)" if s["judged_on"] == "prefill" else ""
    return _num(s["prefill_ratio_median"]) + mark


def _more(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    return f"{', '.join(map(str, s['more_computed_turns'])) or 'none'}{_mark(s['computed_met'])}"


def families_lines(result: dict[str, Any]) -> list[str]:
    """The families' section of a report: per family the warm-turn figures, then every turn,
    then (a document merging several runs) each family's spread over the runs."""
    spin = result.get("gomp_spincount", "each server's own (llama-server: libgomp's default)")
    reads = sorted({float(loop.get("read_seconds", 0.0)) for loop in result["families"].values()})
    read = (
        f"A request that ends in a new instruction goes to each system at least {'/'.join(f'{r:g}' for r in reads)} s "
        "after that system's previous answer (the user reads it; modeld prefills the next prefix ahead in that "
        "time, `--prefill-ahead`, blueprint 0010; llama-server does nothing). "
        if any(reads)
        else "Every request is sent as soon as the systems are idle (no reading time). "
    )
    lines = [
        "## An agent loop per model family: modeld against llama-server `--jinja` (`bench/families.py`)",
        "",
        f"Each family's template and control tokens on the generated `{result['model']}` model, "
        f"{result['turns']} turns over `/v1/chat/completions`, greedy, {result['max_tokens']}-token answers, "
        f"streamed; the same request bodies to every system (system prompt of {result['system_chars']} characters, "
        "Claude Code's Read/Bash/Edit tools, a tool call and its result per turn, an answer and a new instruction "
        "every second turn). Every server started afresh per family. TTFT: request sent to the first chunk with "
        "generated content, client-observed; `first chunk`: to the first chunk of any kind. Computed: prompt "
        "tokens the system evaluated (modeld's usage, llama-server's `timings.prompt_n`). Two llama-servers: "
        "`default` (no `--cache-reuse`, llama-server's default: the goal's baseline, exact as modeld is) and "
        "`reuse` (`--cache-reuse 256`: after a template re-renders an earlier turn it shifts the KV of the "
        "chunks after the change into their new positions, so it computes fewer tokens, but those cells were "
        "computed attending to tokens that are gone: not what a fresh prefill computes, blueprint 0010). "
        f"{read}OpenMP spin (`GOMP_SPINCOUNT`) of every server: {spin}. Ratios modeld / llama-server over the warm "
        "turns (every turn after the first). Goals (issue 31), judged against `default`: modeld computes no "
        f"more than llama-server on any turn; warm TTFT ratio <= {TTFT_GOAL}. `load`: the 1-minute load average "
        "when the family's loop ended (a shared machine: read medians and ranges, not single numbers).",
        "",
        "| family | warm TTFT ms modeld | default | reuse | ratio vs default, median (range) | vs reuse | "
        "server prefill ratio vs default | computed per warm turn modeld / default / reuse (all turns) | "
        "turns modeld computed more: vs default | vs reuse | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, loop in result["families"].items():
        if not loop["records"]:
            lines.append(f"| {name} | failed: {'; '.join(loop['notes'])[:300]} | | | | | | | | | |")
            continue
        s = family_summary(loop)
        lines.append(
            f"| {name} | {_ms(s['modeld_ttft_s_median'])} | {_ms(s['llama-server_ttft_s_median'])} | "
            f"{_ms(s['llama-server-reuse_ttft_s_median'])} | {_ratio(s)} | {_ratio(s['reuse'])} | "
            f"{_prefill(s)} | {_int(s['modeld_computed_median'])} / "
            f"{_int(s['llama-server_computed_median'])} / {_int(s['llama-server-reuse_computed_median'])} "
            f"({_int(s['modeld_computed_total'])} / {_int(s['llama-server_computed_total'])} / "
            f"{_int(s['llama-server-reuse_computed_total'])}) | {_more(s)} | {_more(s['reuse'])} | "
            f"{_num((loop.get('load_average') or [None])[0])} |"
        )
    lines += [
        "",
        "Per turn (TTFT ms; computed / prompt tokens; the server's own prefill ms), modeld / default / reuse:",
        "",
    ]
    lines += ["| family | turn | TTFT | computed / prompt | prefill ms |", "|---|---|---|---|---|"]
    for name, loop in result["families"].items():
        by = {(r["system"], r["turn"]): r for r in loop["records"]}
        for t in sorted({r["turn"] for r in loop["records"]}):
            rs = [by.get((system, t)) or {} for system in SYSTEMS]
            lines.append(
                f"| {name} | {t}{'' if t else ' (cold)'} | {' / '.join(_ms(r.get('ttft_s')) for r in rs)} | "
                + " / ".join(f"{r.get('computed_tokens', '-')} of {r.get('prompt_tokens', '-')}" for r in rs)
                + f" | {' / '.join(_int(r.get('prompt_ms')) for r in rs)} |"
            )
    lines += spread_lines(result.get("repeats") or {})
    notes = [f"- {name}: {note}" for name, loop in result["families"].items() for note in loop["notes"]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return [*lines, ""]


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return (
        f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}; "
        f"spread {max(values) - min(values):.2f}; {len(values)} runs)"
    )


def spread_lines(repeats: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per family run more than once: the per-run warm TTFT ratio medians, their median, range and
    spread (max - min), against each baseline; the tokens computed per run; the loads."""
    rows = []
    for name, loops in repeats.items():
        if len(loops) < 2:
            continue
        sums = [family_summary(loop) for loop in loops if loop["records"]]
        default = [s["ttft_ratio_median"] for s in sums if s["ttft_ratio_median"] is not None]
        prefill = ""
        if not default:  # no TTFT compares in any run (gpt-oss, Command R): the servers' prefill
            default = [s["prefill_ratio_median"] for s in sums if s["prefill_ratio_median"] is not None]
            prefill = "prefill: "
        reuse = [
            s["reuse"]["ttft_ratio_median"] for s in sums if s["reuse"] and s["reuse"]["ttft_ratio_median"]
        ]
        computed = ", ".join(
            f"{s['modeld_computed_total']}/{s['llama-server_computed_total']}/{s['llama-server-reuse_computed_total']}"
            for s in sums
        )
        loads = ", ".join(_num((loop.get("load_average") or [None])[0]) for loop in loops)
        met = _mark(statistics.median(default) <= TTFT_GOAL) if default else ""
        rows.append(f"| {name} | {prefill}{_stats(default)}{met} | {_stats(reuse)} | {computed} | {loads} |")
    if not rows:
        return []
    return [
        "",
        "Over the runs (each family's loop run more than once; per run the median of its warm-turn ratios; "
        "`prefill:` where no TTFT compares, the servers' own prefill ratio):",
        "",
        "| family | TTFT ratio vs default: median (range; spread) | vs reuse | computed, all turns, per run: "
        "modeld/default/reuse | load per run |",
        "|---|---|---|---|---|",
        *rows,
    ]


def _gap(x: float | None) -> str:
    if x is None:
        return "-"
    return "no top-5 token in common" if x == float("inf") else f"{x:.4g}"


def exactness_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``bench/families_exactness.py``'s lines (``exactness.jsonl`` beside the runs) as a table:
    per family and system, turn 2 warm against a fresh server."""
    if not rows:
        return []
    lines = [
        "## Is a warm turn what a fresh prefill computes? (`bench/families_exactness.py`)",
        "",
        "The loop's turn 2 (after a new instruction: the templates that drop earlier reasoning re-render "
        "there) sent warm, after turns 0 and 1, and the same request to a fresh server of the same kind; "
        "greedy, `logprobs` with `top_logprobs` 5. Tokens agree: leading greedy tokens equal; gap: the "
        "largest difference of a logprob among the tokens both top-5 lists hold, at the first generated "
        "position (set by the prefill alone) and over the agreeing positions. `reply`: the tiny family "
        "models (near-certain answers); `realistic`: the bench's model.",
        "",
        "| model | family | system | computed warm / fresh | tokens agree | gap, first position | gap, agreeing positions |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for system, m in row.items():
            if isinstance(m, dict):
                lines.append(
                    f"| {row.get('model', '-')} | {row['family']} | {system} | {m['computed_warm']} / "
                    f"{m['computed_fresh']} | {m['tokens_agree']} of {m['positions']} | "
                    f"{_gap(m['first_logprob_gap'])} | {_gap(m['max_logprob_gap'])} |"
                )
    return [*lines, ""]
