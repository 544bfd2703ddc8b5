"""Numbers from run documents: per-run ratios, the merge of two runs, and measured causes.

Pure functions over the JSON a run writes (``runs/<id>/run.json``), so the report, the
regression check and the tests share one definition of every ratio:

* a ratio of TTFTs is the median of per-turn ratios over the workload's *warm* turns (turns
  whose workspace was seen before; all turns when none is), so one noisy turn cannot swing it;
* ``decode_over_limit`` is the median per-turn ratio of decode tokens/s over all turns;
* ``restart_over_cold`` is modeld's TTFT on the first turn after the restart over the median
  cold (full-prefill) TTFT measured in the workload or in the one it continues;
* ``http_overhead_ms`` is the median per-turn TTFT difference, modeld's OpenAI endpoint minus
  modeld over gRPC;
* ``rss_over_llama_server`` is modeld's peak RSS in the workload (VmHWM summed over its
  processes: the daemon and its engine workers) over llama-server's, at the same warm capacity
  (llama-server has a slot per workspace, modeld the same windows: issue 22);
* ``recomputed_tokens`` is the daemon's own count of prompt tokens a session had computed before
  and modeld computed again over the workload (its ``recomputed`` counter, read around every
  turn: ``modeld`` over gRPC, else ``modeld-http``); a token count, exact, compared without a
  tolerance;
* :func:`warm_per_gib`: tokens a system served from warm state in the workload's last round per
  GiB of its peak RSS.
* the agent-API loops (``bench/agent_apis.py``) compare modeld with llama-server per turn
  (TTFT, prompt tokens computed, bytes sent) and take medians over the warm turns (every turn
  after the first), with the range of the per-turn ratios beside them.
* speculation (``bench/speculation.py``) and the fleet (``bench/fleet.py``) bring their own
  medians (over rounds paired within a round; over the moved conversations);
  :func:`extra_figures` picks the issue's ratios out of them (:data:`EXTRA_GOALS`) and
  :func:`merge_extra` merges two runs' like the headline's.

Two runs merge into a value (their mean) and a spread (the largest run's value over the
smallest, minus one): the run-to-run noise shown beside every ratio and the tolerance of
``make bench-compare``. A ratio that misses its goal gets a cause line built from what the run
measured (tokens prefilled per turn, decode speed), never from a guess.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.workloads import GOALS

__all__ = [
    "EXTRA_GOALS",
    "RATIO_PAIRS",
    "agent_api_summary",
    "agent_api_turns",
    "by_turn",
    "causes",
    "extra_figures",
    "headline",
    "merge",
    "merge_extra",
    "met",
    "same_tokens",
    "system_stats",
    "warm_per_gib",
]

Doc = dict[str, Any]
Turns = dict[int, dict[str, Any]]

RATIO_PAIRS = {
    "modeld_over_limit": ("modeld", "limit"),
    "modeld_over_llama_server": ("modeld", "llama-server"),
    "modeld_over_lcp_server": ("modeld", "lcp-server"),
}


def by_turn(doc: Doc, system: str, workload: str) -> Turns:
    return {
        r["turn"]: r
        for r in doc["turns"]
        if r["system"] == system and r["workload"] == workload and not r.get("error")
    }


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _warm(load: Doc) -> list[int]:
    return list(load["warm"]) or list(range(load["turns"]))


def _ratio(a: Turns, b: Turns, turns: list[int], key: str = "ttft_s") -> float | None:
    return _median(
        [a[t][key] / b[t][key] for t in turns if t in a and t in b and b[t][key] > 0 and a[t][key] > 0]
    )


def _cold_ttft(doc: Doc, load: Doc) -> float | None:
    for name in (load["name"], load.get("continues", "")):
        values = [r["ttft_s"] for r in by_turn(doc, "cold", name).values()]
        if values:
            return _median(values)
    return None


def headline(doc: Doc) -> dict[str, dict[str, float | None]]:
    """workload -> ratio -> value (None where a system did not run)."""
    out: dict[str, dict[str, float | None]] = {}
    for load in doc["workloads"]:
        name = load["name"]
        warm = _warm(load)
        every = list(range(load["turns"]))
        m = by_turn(doc, "modeld", name)
        row: dict[str, float | None] = {
            key: _ratio(m, by_turn(doc, b, name), warm) for key, (_, b) in RATIO_PAIRS.items()
        }
        row["decode_over_limit"] = _ratio(m, by_turn(doc, "limit", name), every, "decode_tps")
        http = by_turn(doc, "modeld-http", name)
        row["http_overhead_ms"] = _median(
            [(http[t]["ttft_s"] - m[t]["ttft_s"]) * 1000 for t in warm if t in http and t in m]
        )
        rss = doc.get("rss", {})
        ours, theirs = rss.get("modeld", {}).get(name), rss.get("llama-server", {}).get(name)
        row["rss_over_llama_server"] = ours / theirs if ours and theirs else None
        counts = doc.get("recomputed") or {}
        again = [counts[s][name] for s in ("modeld", "modeld-http") if name in counts.get(s, {})]
        row["recomputed_tokens"] = float(again[0]) if again else None
        if load["restart_before"]:
            first = load["restart_before"][0]
            cold = _cold_ttft(doc, load)
            row["restart_over_cold"] = m[first]["ttft_s"] / cold if first in m and cold else None
        out[name] = row
    return out


def warm_per_gib(doc: Doc, load: Doc, system: str) -> float | None:
    """Tokens served from warm state in the workload's last round (each workspace's last turn:
    prompt tokens minus tokens prefilled) per GiB of the system's peak RSS: warm capacity per
    byte. None when the system does not report its prefill or its RSS."""
    turns = by_turn(doc, system, load["name"])
    rss = doc.get("rss", {}).get(system, {}).get(load["name"])
    last: dict[int, int] = {}
    for t, workspace in enumerate(load.get("workspace_of_turn", [])):
        last[workspace] = t
    if not last:
        last = {0: load["turns"] - 1}
    warm = 0
    for t in last.values():
        r = turns.get(t)
        if r is None or r.get("prefilled") is None:
            return None
        warm += max(0, load["prompt_tokens"][t] - r["prefilled"])
    return warm / (rss / (1 << 30)) if rss else None


def same_tokens(doc: Doc, workload: str) -> tuple[int, int]:
    """(turns where modeld's greedy tokens equal the limit's, turns both ran)."""
    m, lim = by_turn(doc, "modeld", workload), by_turn(doc, "limit", workload)
    both = [t for t in m if t in lim]
    return sum(1 for t in both if m[t]["token_ids"] == lim[t]["token_ids"]), len(both)


def system_stats(doc: Doc, workload: Doc, system: str) -> dict[str, Any] | None:
    turns = by_turn(doc, system, workload["name"])
    if not turns:
        return None
    warm = [t for t in _warm(workload) if t in turns]
    prefilled = [turns[t]["prefilled"] for t in warm if turns[t]["prefilled"] is not None]
    return {
        "ttft_median_s": _median([r["ttft_s"] for r in turns.values()]),
        "ttft_warm_median_s": _median([turns[t]["ttft_s"] for t in warm]),
        "prefilled_warm_median": _median([float(p) for p in prefilled]),
        "prefilled_per_turn": [
            turns[t]["prefilled"] if t in turns else None for t in range(workload["turns"])
        ],
        "decode_tps_median": _median([r["decode_tps"] for r in turns.values() if r["decode_tps"] > 0]),
        "peak_rss_bytes": doc.get("rss", {}).get(system, {}).get(workload["name"]),
    }


def merge(docs: list[Doc]) -> dict[str, dict[str, dict[str, Any]]]:
    """workload -> ratio -> {value, runs, spread, goal, direction, met} over the runs given."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    goals = {load["name"]: load["goals"] for load in docs[0]["workloads"]}
    per_run = [doc.get("headline") or headline(doc) for doc in docs]
    for name in goals:
        row: dict[str, dict[str, Any]] = {}
        for key in GOALS:
            values = [h.get(name, {}).get(key) for h in per_run]
            present = [v for v in values if v is not None]
            value = statistics.fmean(present) if present else None
            direction, goal = GOALS[key]
            row[key] = {
                "value": value,
                "runs": values,
                "spread": spread(present, absolute=key.endswith(("_ms", "_tokens"))),
                "goal": goal if key in goals[name] else None,
                "direction": direction,
                "met": met(value, direction, goal) if key in goals[name] and value is not None else None,
            }
        out[name] = row
    return out


def spread(values: list[float], *, absolute: bool = False) -> float | None:
    """Run-to-run spread: largest over smallest minus one, or (``absolute``, for a figure in
    ms) largest minus smallest; None with fewer than two runs."""
    if len(values) < 2:
        return None
    lo, hi = min(values), max(values)
    if absolute or lo <= 0:
        return hi - lo
    return hi / lo - 1.0


def met(value: float, direction: str, goal: float) -> bool:
    return value <= goal if direction == "lower" else value >= goal


def _fmt_tokens(x: float | None) -> str:
    return "not reported" if x is None else f"{x:.0f}"


def causes(doc: Doc, merged: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, str]]:
    """A measured cause for every ratio that misses its goal, from the newest run ``doc``."""
    out = []
    loads = {load["name"]: load for load in doc["workloads"]}
    for name, row in merged.items():
        load = loads.get(name)
        if load is None:
            continue
        warm = _warm(load)
        ideal = _median([float(load["ideal_prefill"][t]) for t in warm])
        m = system_stats(doc, load, "modeld")
        for key, cell in row.items():
            if cell["met"] is not False or m is None:
                continue
            text = _cause(doc, load, key, cell, m, ideal)
            out.append({"workload": name, "ratio": key, "cause": text})
    return out


def _noise(key: str, cell: dict[str, Any], direction: str, goal: float) -> str:
    s = cell["spread"]
    if s is None or cell["value"] is None:
        return ""
    if key.endswith("_tokens"):
        return ""  # an exact count: no noise to be within
    if key.endswith("_ms"):
        near, shown = cell["value"] - s, f"{s:.1f} ms"
    else:
        near = cell["value"] / (1 + s) if direction == "lower" else cell["value"] * (1 + s)
        shown = f"{s:.0%}"
    if met(near, direction, goal):
        return f" The miss is within the run-to-run spread ({shown})."
    return ""


def _cause(
    doc: Doc, load: Doc, key: str, cell: dict[str, Any], m: dict[str, Any], ideal: float | None
) -> str:
    fix = f" What would fix it: {load['fix']}." if load.get("fix") else ""
    noise = _noise(key, cell, cell["direction"], cell["goal"])
    pm = m["prefilled_warm_median"]
    if key in RATIO_PAIRS:
        other = RATIO_PAIRS[key][1]
        o = system_stats(doc, load, other) or {}
        po = o.get("prefilled_warm_median")
        head = (
            f"modeld prefilled {_fmt_tokens(pm)} tokens per warm turn (median), {other} {_fmt_tokens(po)}, "
            f"a perfect system {_fmt_tokens(ideal)}."
        )
        if pm is not None and po is not None and pm > po * 1.1 + 8:
            return f"{head} modeld recomputes what {other} reuses.{fix}{noise}"
        if pm is not None and po is None:
            return f"{head} {other} does not report its prefill.{noise}"
        tm, to = m["ttft_warm_median_s"], o.get("ttft_warm_median_s")
        gap = f" ({(tm - to) * 1000:.0f} ms per turn, median)" if tm is not None and to is not None else ""
        return f"{head} Same work; the gap{gap} is time per turn, not reuse.{noise}"
    if key == "decode_over_limit":
        lim = system_stats(doc, load, "limit") or {}
        return (
            f"modeld decoded {m['decode_tps_median'] or 0:.1f} tokens/s (median), the limit "
            f"{lim.get('decode_tps_median') or 0:.1f}.{noise}"
        )
    if key == "restart_over_cold":
        first = load["restart_before"][0]
        turns = by_turn(doc, "modeld", load["name"])
        r = turns.get(first, {})
        return (
            f"modeld's first turn after the restart prefilled {r.get('prefilled')} of {r.get('prompt_tokens')} "
            f"prompt tokens (a perfect system: {load['ideal_prefill'][first]}).{fix}{noise}"
        )
    if key == "recomputed_tokens":
        per_turn = [
            f"turn {t} {r['recomputed']}"
            for t, r in sorted(by_turn(doc, "modeld", load["name"]).items())
            if r.get("recomputed")
        ]
        where = f" ({', '.join(per_turn)})" if per_turn else " (in a wave of concurrent turns)"
        return (
            f"modeld computed {cell['value']:.0f} prompt tokens again that a session had computed before"
            f"{where}; the daemon's log and explain-context say where they went."
        )
    if key == "http_overhead_ms":
        return f"the OpenAI endpoint added {cell['value']:.1f} ms per turn (median) over gRPC.{noise}"
    if key == "rss_over_llama_server":
        parts = doc.get("rss_parts", {}).get("modeld", {}).get(load["name"], {})
        shares = ", ".join(f"{proc.split()[0]} {b / (1 << 20):.0f}" for proc, b in sorted(parts.items()))
        theirs: int = doc.get("rss", {}).get("llama-server", {}).get(load["name"]) or 0
        ours: int = m["peak_rss_bytes"] or 0
        return (
            f"modeld's peak RSS {ours / (1 << 20):.0f} MiB ({shares}), llama-server's "
            f"{theirs / (1 << 20):.0f} MiB.{noise}"
        )
    return ""


# --- the agent-API loops (bench/agent_apis.py) ------------------------------------------------------

AGENT_API_PAIR = ("modeld", "llama-server")


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def agent_api_turns(loop: Doc) -> list[dict[str, Any]]:
    """Per turn of one loop: each system's record (None where it did not run or failed) and the
    ratios modeld / llama-server of TTFT, prompt tokens computed and bytes sent."""
    records = {(r["system"], r["turn"]): r for r in loop["records"] if not r.get("error")}
    out = []
    for turn in sorted({r["turn"] for r in loop["records"]}):
        m, o = (records.get((s, turn)) for s in AGENT_API_PAIR)
        row: dict[str, Any] = {"turn": turn, "modeld": m, "llama-server": o}
        for key, field in (("ttft", "ttft_s"), ("computed", "computed_tokens"), ("bytes", "bytes_sent")):
            row[f"{key}_ratio"] = _over(m[field] if m else None, o[field] if o else None)
        out.append(row)
    return out


def agent_api_summary(loop: Doc) -> dict[str, Any]:
    """Warm-turn (every turn after the first) medians per system, and the per-turn ratios'
    median with their range (the run's own spread)."""
    rows = [r for r in agent_api_turns(loop) if r["turn"] > 0]
    out: dict[str, Any] = {"warm_turns": len(rows)}
    for system in AGENT_API_PAIR:
        mine = [r[system] for r in rows if r[system] is not None]
        for key, field in (("ttft_s", "ttft_s"), ("computed", "computed_tokens"), ("bytes", "bytes_sent")):
            values = [float(x[field]) for x in mine if x[field] is not None]
            out[f"{system}_{key}_median"] = _median(values)
    again = [r.get("recomputed") for r in loop["records"] if r["system"] == "modeld" and not r.get("error")]
    out["modeld_recomputed"] = (
        sum(a for a in again if a is not None) if any(a is not None for a in again) else None
    )
    for key in ("ttft", "computed", "bytes"):
        ratios = [r[f"{key}_ratio"] for r in rows if r[f"{key}_ratio"] is not None]
        out[f"{key}_ratio_median"] = _median(ratios)
        out[f"{key}_ratio_min"] = min(ratios) if ratios else None
        out[f"{key}_ratio_max"] = max(ratios) if ratios else None
    return out


# --- the extras' goals: speculation (bench/speculation.py) and the fleet (bench/fleet.py) ----------

# name -> key -> (direction, goal or None, title). The figures come from the run document's
# extra (its own medians over rounds or conversations); two runs merge like the headline's.
EXTRA_GOALS: dict[str, dict[str, tuple[str, float | None, str]]] = {
    "speculation": {
        "rewrite_over_off": ("higher", 2.0, "file rewrite, decode tok/s modeld ngram / modeld off"),
        "rewrite_over_llama_server_ngram": (
            "higher",
            1.0,
            "file rewrite, modeld ngram / llama-server's best n-gram mode",
        ),
        "tool_call_over_off": ("higher", 1.3, "tool call quoting code, modeld ngram / modeld off"),
        "prose_over_off": ("higher", 0.97, "fresh prose, modeld ngram / modeld off"),
        "realistic_worst_over_off": (
            "higher",
            0.97,
            "REALISTIC (random weights: drafts fail), the lowest of rewrite, tool call and prose, "
            "modeld ngram / modeld off",
        ),
    },
    "fleet": {
        "moved_over_cold": ("lower", 0.1, "modeld: moved turn TTFT / cold re-prefill"),
        "modeld_moved_over_llama_server_moved": (
            "lower",
            None,
            "moved turn TTFT, modeld / llama-server fleet",
        ),
        "llama_server_moved_over_cold": ("lower", None, "llama-server: moved turn TTFT / cold re-prefill"),
    },
}


def extra_figures(doc: Doc, name: str) -> dict[str, float | None]:
    """The figures :data:`EXTRA_GOALS` names for one run's ``speculation`` or ``fleet`` (all None
    where it did not run)."""
    result = doc.get(name)
    keys = EXTRA_GOALS[name]
    if not result or "skipped" in result or "error" in result:
        return dict.fromkeys(keys)
    if name == "speculation":
        figures = dict(result.get("summary", {}))
        realistic = (result.get("realistic") or {}).get("summary", {})
        ratios = [realistic.get(k) for k in ("rewrite_over_off", "tool_call_over_off", "prose_over_off")]
        present = [r for r in ratios if r is not None]
        figures["realistic_worst_over_off"] = min(present) if present else None
        return {key: figures.get(key) for key in keys}
    by = {r["system"]: r for r in result.get("systems", [])}

    def median(system: str, key: str) -> float | None:
        spread_ = by.get(system, {}).get(key) or {}
        return spread_.get("median")

    return {
        "moved_over_cold": median("modeld", "moved_over_cold"),
        "modeld_moved_over_llama_server_moved": result.get("modeld_moved_over_llama_server_moved"),
        "llama_server_moved_over_cold": median("llama-server", "moved_over_cold"),
    }


def merge_extra(docs: list[Doc], name: str) -> dict[str, dict[str, Any]]:
    """key -> {value, runs, spread, goal, direction, met, title} over the runs given: the mean of
    the runs' figures, each run's figure beside it."""
    per_run = [extra_figures(doc, name) for doc in docs]
    out: dict[str, dict[str, Any]] = {}
    for key, (direction, goal, title) in EXTRA_GOALS[name].items():
        values = [figures[key] for figures in per_run]
        present = [v for v in values if v is not None]
        value = statistics.fmean(present) if present else None
        out[key] = {
            "value": value,
            "runs": values,
            "spread": spread(present),
            "goal": goal,
            "direction": direction,
            "met": met(value, direction, goal) if goal is not None and value is not None else None,
            "title": title,
        }
    return out
