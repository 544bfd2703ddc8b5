"""The benchmark report: ``report.md``, ``results.json`` and the plots, from one or two runs.

The headline table shows every ratio as the mean of the runs with each run's value beside it
(the run-to-run spread); ratios that miss their goal are marked and explained below the table
by a measured cause (:func:`bench.analysis.causes`). Per workload: what the limit is and what a
perfect system would prefill, each system's settings, a table of medians, and TTFT and tokens
prefilled per turn for every system (from the newest run). ``results.json`` holds the merged
headline (what ``make bench-compare`` reads) and the run documents it was built from.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench import analysis
from bench.agent_socket import socket_lines
from bench.families_report import families_lines
from bench.page_overhead import page_lines
from bench.plots import plot_summary, plot_workload
from bench.workloads import GOALS

__all__ = ["SYSTEM_ORDER", "agent_apis_lines", "fleet_lines", "speculation_lines", "write_report"]

SYSTEM_ORDER = ["modeld", "modeld-http", "limit", "cold", "llama-server", "lcp-server"]
COLUMNS = [
    ("modeld_over_limit", "modeld / limit, warm TTFT"),
    ("modeld_over_llama_server", "modeld / llama-server, warm TTFT"),
    ("modeld_over_lcp_server", "modeld / lcp-server, warm TTFT"),
    ("decode_over_limit", "decode tok/s modeld / limit"),
    ("restart_over_cold", "restart: first turn / cold prefill"),
    ("http_overhead_ms", "OpenAI endpoint overhead, ms"),
    ("rss_over_llama_server", "peak RSS modeld / llama-server"),
    ("recomputed_tokens", "tokens modeld computed again"),
]

Doc = dict[str, Any]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _cell(cell: dict[str, Any], *, count: bool = False) -> str:
    if cell["value"] is None:
        return "-"
    digits = 0 if count else 1 if cell["value"] >= 10 else 2
    runs = [v for v in cell["runs"] if v is not None]
    text = _num(cell["value"], digits)
    if len(runs) > 1:
        text += " [" + ", ".join(_num(v, digits) for v in runs) + "]"
    if cell["met"] is False:
        text += " ✗"
    elif cell["met"] is True:
        text += " ✓"
    return text


def _goal(key: str) -> str:
    direction, goal = GOALS[key]
    return f"{'≤' if direction == 'lower' else '≥'} {goal:g}"


def _headline(docs: list[Doc], merged: dict[str, Any], causes: list[dict[str, str]]) -> list[str]:
    lines = [
        "## Headline",
        "",
        "| workload | "
        + " | ".join(f"{title} (goal {_goal(key)})" for key, title in COLUMNS)
        + " | greedy tokens equal to the limit's |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for name, row in merged.items():
        equal, both = analysis.same_tokens(docs[0], name)
        lines.append(
            f"| {name} | "
            + " | ".join(_cell(row[key], count=key.endswith("_tokens")) for key, _ in COLUMNS)
            + f" | {equal}/{both} |"
        )
    runs = ", ".join(d["id"] for d in docs)
    lines += [
        "",
        f"Each value is the mean over {len(docs)} run(s) ({runs}); in brackets each run's own value (the run-to-run "
        "spread). ✓ / ✗: the workload's goal for that ratio met / missed (no mark: not a goal there). TTFT ratios are "
        "medians of per-turn ratios over warm turns (turns whose workspace was seen before). Tokens computed again: "
        "the daemon's own count (`recomputed` in `modeld status`) of prompt tokens a session had computed before, "
        "over the workload.",
        "",
    ]
    if causes:
        lines += ["### Why each miss happened (measured in the newest run)", ""]
        lines += [f"- **{c['workload']}**, {c['ratio']}: {c['cause']}" for c in causes]
        lines.append("")
    return lines


def _memory(docs: list[Doc], systems: list[str]) -> list[str]:
    """Peak RSS per system and workload (each run's value), modeld's processes apart, and the
    warm tokens each system held per GiB (issue 22)."""
    shown = [s for s in systems if s != "cold"]
    lines = [
        "## Memory",
        "",
        "Peak RSS in MiB per workload (VmHWM summed over each system's processes, reset before the workload; "
        "in brackets each run's value), and modeld's processes in the newest run:",
        "",
        "| workload | " + " | ".join(shown) + " | modeld's processes (newest run) |",
        "|---" * (len(shown) + 2) + "|",
    ]
    for load in docs[0]["workloads"]:
        name = load["name"]
        cells = []
        for system in shown:
            values = [d.get("rss", {}).get(system, {}).get(name) for d in docs]
            present = [v for v in values if v]
            if not present:
                cells.append("-")
                continue
            text = f"{sum(present) / len(present) / (1 << 20):.0f}"
            if len(present) > 1:
                text += " [" + ", ".join(f"{v / (1 << 20):.0f}" for v in present) + "]"
            cells.append(text)
        parts = docs[0].get("rss_parts", {}).get("modeld", {}).get(name, {})
        split = ", ".join(f"{n.split()[0]} {b / (1 << 20):.0f}" for n, b in sorted(parts.items())) or "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {split} |")
    lines += [
        "",
        "Warm tokens held per GiB of peak RSS (tokens served from warm state on each workspace's last turn, "
        "newest run; `-`: the system does not report its prefill):",
        "",
        "| workload | " + " | ".join(shown) + " |",
        "|---" * (len(shown) + 1) + "|",
    ]
    for load in docs[0]["workloads"]:
        values = [analysis.warm_per_gib(docs[0], load, system) for system in shown]
        lines.append(
            f"| {load['name']} | " + " | ".join("-" if v is None else f"{v:.0f}" for v in values) + " |"
        )
    return [*lines, ""]


def _beyond_perfect(doc: Doc, load: Doc, system: str) -> int | None:
    """Tokens a system prefilled beyond what a perfect cache of every earlier prompt would
    (``ideal_prefill``), summed over the workload's turns; None when it does not report its
    prefill. The bench's own check, beside the daemon's count: it sees a restart's losses too."""
    turns = analysis.by_turn(doc, system, load["name"])
    if not turns or any(r["prefilled"] is None for r in turns.values()):
        return None
    return sum(max(0, int(r["prefilled"]) - int(load["ideal_prefill"][t])) for t, r in turns.items())


def _systems_table(doc: Doc, load: Doc, systems: list[str]) -> list[str]:
    lines = [
        "| system | warm TTFT median ms | all turns median ms | prefilled per warm turn (median) | decode tok/s "
        "| peak RSS MiB | prefilled beyond a perfect cache | computed again (the daemon's count) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system in systems:
        s = analysis.system_stats(doc, load, system)
        if s is None:
            continue
        pre = s["prefilled_warm_median"]
        rss = s["peak_rss_bytes"]
        beyond = _beyond_perfect(doc, load, system)
        again = (doc.get("recomputed") or {}).get(system, {}).get(load["name"])
        lines.append(
            f"| {system} | {_ms(s['ttft_warm_median_s'])} | {_ms(s['ttft_median_s'])} | "
            f"{'-' if pre is None else f'{pre:.0f}'} | {_num(s['decode_tps_median'], 1)} | "
            f"{'-' if not rss else f'{rss / (1 << 20):.0f}'} | {'-' if beyond is None else beyond} | "
            f"{'-' if again is None else again} |"
        )
    return lines


def _per_turn(doc: Doc, load: Doc, systems: list[str]) -> list[str]:
    lines = [
        "TTFT ms / tokens prefilled, per turn (`-`: not reported; *ideal*: what a perfect system prefills):",
        "",
        "| turn | ideal | " + " | ".join(systems) + " |",
        "|---" * (len(systems) + 2) + "|",
    ]
    warm = set(load["warm"])
    for t in range(load["turns"]):
        cells = []
        for system in systems:
            r = analysis.by_turn(doc, system, load["name"]).get(t)
            if r is None:
                cells.append("")
                continue
            pre = "-" if r["prefilled"] is None else str(r["prefilled"])
            restore = f" (restore {_ms(r['restore_s'])})" if r.get("restore_s") else ""
            again = f", {r['recomputed']} again" if r.get("recomputed") else ""
            cells.append(f"{_ms(r['ttft_s'])} / {pre}{restore}{again}")
        marks = []
        if t in warm:
            marks.append("warm")
        if load["waves"][t] >= 0:
            marks.append(f"wave {load['waves'][t]}")
        if t in load["restart_before"]:
            marks.append("after restart")
        label = f"{t}" + (f" ({', '.join(marks)})" if marks else "")
        lines.append(f"| {label} | {load['ideal_prefill'][t]} | " + " | ".join(cells) + " |")
    return lines


def _workload(doc: Doc, load: Doc, systems: list[str], plot: str) -> list[str]:
    name = load["name"]
    present = [s for s in systems if analysis.by_turn(doc, s, name)]
    lines = [
        f"## {name}: {load['title']}",
        "",
        f"*The limit:* {load['limit']}. *A perfect system prefills:* {load['perfect']} "
        f"({sum(load['ideal_prefill'])} tokens over {load['turns']} turns; prompts of "
        f"{min(load['prompt_tokens'])}-{max(load['prompt_tokens'])} tokens).",
        "",
    ]
    if load.get("continues"):
        lines += [f"Runs on the systems and warm state that `{load['continues']}` left behind.", ""]
    settings = doc.get("settings", {}).get(name, {})
    if settings:
        lines += ["Settings:", ""]
        for system, s in settings.items():
            why = f" ({s['why']})" if s.get("why") else ""
            lines.append(f"- {system}: `{s.get('command', '')}`{why}")
        lines.append("")
    wall = doc.get("durations", {}).get(name)
    if wall is not None:
        lines += [f"Wall time of this workload: {wall / 60:.1f} min (every system, starts included).", ""]
    restarts = doc.get("restarts", {}).get(name)
    if restarts:
        lines += [
            "Restart (stop, start, ready; modeld: sessions re-opened, model loaded): "
            + ", ".join(f"{s} {v:.1f} s" for s, v in restarts.items()),
            "",
        ]
    for note in doc.get("notes", {}).get(name, []):
        lines.append(f"- Note: {note}")
    if doc.get("notes", {}).get(name):
        lines.append("")
    lines += [
        *_systems_table(doc, load, present),
        "",
        *_per_turn(doc, load, present),
        "",
        f"![{name}]({plot})",
        "",
    ]
    return lines


def _tokens(x: Any) -> str:
    return "-" if x is None else f"{x:.0f}"


def _ratio_range(summary: dict[str, Any], key: str) -> str:
    median = summary[f"{key}_ratio_median"]
    if median is None:
        return "-"
    return f"{median:.2f} (range {summary[f'{key}_ratio_min']:.2f}-{summary[f'{key}_ratio_max']:.2f})"


def agent_apis_lines(result: Doc, model: str) -> list[str]:
    """The agent-API loops' section (``bench/agent_apis.py``): per loop, a table per turn and the
    warm-turn medians."""
    trimmed = (
        "the captured requests as sent"
        if result["whole"]
        else f"trimmed: every tool-schema description to {result['description_limit']} characters, every "
        f"text block to {result['text_limit']}"
    )
    lines = [
        "## Agent APIs: modeld against llama-server's own endpoints (`bench/agent_apis.py`)",
        "",
        f"A coding agent's loop on the `{model}` model, {result['turns']} turns, greedy, {result['max_tokens']}-token "
        f"answers, streamed; the first request is a captured Claude Code / Codex CLI request ({trimmed}), every later "
        "turn adds a tool call, its result and a new instruction. **messages** (`/v1/messages`): both systems get "
        "the same body, the whole conversation every turn, `metadata.user_id` holding the session. **responses** "
        "(`/v1/responses`): modeld's client sends only the new items with `previous_response_id`; llama-server "
        "refuses `previous_response_id`, so its client resends everything, echoing each answer. TTFT: request "
        "sent to the first event carrying generated content, client-observed. Computed: prompt tokens the system "
        "evaluated this turn (modeld's usage; llama-server's `timings.prompt_n`, or its usage where the stream has "
        "no timings, or its log where the stream has neither). Sent: the request body's bytes. Ratios are modeld / llama-server per turn; the medians are "
        "over the warm turns (every turn after the first).",
        "",
    ]
    for name, loop in result["loops"].items():
        rows = analysis.agent_api_turns(loop)
        s = analysis.agent_api_summary(loop)
        lines += [
            f"### {name}: `{loop['endpoint']}` ({loop['fixture']}, {loop['tools']} tools, window {loop['n_ctx']})",
            "",
        ]
        for system, settings in loop["settings"].items():
            lines.append(f"- {system}: `{settings.get('command', '')}`")
        for note in loop["notes"]:
            lines.append(f"- Note: {note}")
        lines += [
            "",
            "| turn | TTFT ms modeld | TTFT ms llama-server | TTFT ratio | computed modeld | computed llama-server "
            "| prompt modeld / llama-server | sent B modeld | sent B llama-server | sent ratio |",
            "|---" * 10 + "|",
        ]
        for row in rows:
            m, o = row["modeld"] or {}, row["llama-server"] or {}
            lines.append(
                f"| {row['turn']}{'' if row['turn'] else ' (cold)'} | {_ms(m.get('ttft_s'))} | {_ms(o.get('ttft_s'))} | "
                f"{_num(row['ttft_ratio'])} | {_tokens(m.get('computed_tokens'))} | {_tokens(o.get('computed_tokens'))} | "
                f"{_tokens(m.get('prompt_tokens'))} / {_tokens(o.get('prompt_tokens'))} | "
                f"{_tokens(m.get('bytes_sent'))} | {_tokens(o.get('bytes_sent'))} | {_num(row['bytes_ratio'])} |"
            )
        lines += [
            "",
            f"Warm turns ({s['warm_turns']}), medians: TTFT modeld {_ms(s['modeld_ttft_s_median'])} ms, llama-server "
            f"{_ms(s['llama-server_ttft_s_median'])} ms, modeld / llama-server per turn {_ratio_range(s, 'ttft')}; "
            f"computed modeld {_tokens(s['modeld_computed_median'])}, llama-server "
            f"{_tokens(s['llama-server_computed_median'])} tokens; sent modeld {_tokens(s['modeld_bytes_median'])} B, "
            f"llama-server {_tokens(s['llama-server_bytes_median'])} B, ratio {_ratio_range(s, 'bytes')}."
            + (
                f" Prompt tokens modeld computed again that a turn had computed before (the daemon's "
                f"`recomputed` count, every turn): {s['modeld_recomputed']}."
                if s.get("modeld_recomputed") is not None
                else ""
            ),
            "",
        ]
    if result.get("socket"):  # the responses loop over the Responses WebSocket (bench/agent_socket.py)
        lines += socket_lines(result["socket"])
    return lines


def _goal_table(docs: list[Doc], name: str) -> list[str]:
    """The issue's ratios for an extra: the mean of the runs with each run's value (the
    run-to-run spread) and the goal, met or missed."""
    merged = analysis.merge_extra(docs, name)
    lines = ["| figure | goal | value [each run] |", "|---|---|---|"]
    for cell in merged.values():
        goal = (
            "-"
            if cell["goal"] is None
            else f"{'≤' if cell['direction'] == 'lower' else '≥'} {cell['goal']:g}"
        )
        lines.append(f"| {cell['title']} | {goal} | {_cell(cell)} |")
    return lines


def _ran(doc: Doc, name: str) -> dict[str, Any] | None:
    """The run's result of an extra, or None where it was skipped, failed or not selected."""
    result = doc.get(name)
    return result if result and "skipped" not in result and "error" not in result else None


def _wall(result: Doc) -> str:
    return f" ({result['duration_s'] / 60:.1f} min)" if "duration_s" in result else ""


def _skipped(docs: list[Doc], name: str) -> list[str]:
    lines = []
    for d in docs:
        result = d.get(name) or {}
        if "skipped" in result:
            lines.append(f"- Run {d['id']}: not run: {result['skipped']}")
        elif "error" in result:
            lines.append(f"- Run {d['id']}: FAILED: {result['error']}")
    return lines


def speculation_lines(docs: list[Doc]) -> list[str]:
    """Speculation from the context (``bench/speculation.py``): the issue's goals over the runs,
    then the newest run's table."""
    newest = next((r for d in docs if (r := _ran(d, "speculation"))), None)
    lines = [
        "## Speculation from the context (`bench/speculation.py`, issue 19)",
        "",
        "Decode tok/s with and without speculation from the context, against llama-server plain and with its n-gram "
        "modes (`--spec-type ngram-simple` / `ngram-mod`, their defaults), every server pinned to the same cores, the "
        "same raw prompts, greedy, streamed; ratios paired within a round, the median over the rounds. Goals: file "
        "rewrite ≥ 2x modeld without speculation and ≥ llama-server's best n-gram mode, tool call ≥ 1.3x, fresh "
        "prose ≥ 0.97x, greedy output identical to plain decoding on every turn.",
        "",
        *_goal_table(docs, "speculation"),
    ]
    same = [(d["id"], _identical(r)) for d in docs if (r := _ran(d, "speculation"))]
    if same:
        lines.append(
            "| modeld's greedy output identical to its plain decoding, every turn | identical | "
            + ", ".join(f"{run}: {verdict}" for run, verdict in same)
            + " |"
        )
    lines += ["", *_skipped(docs, "speculation")]
    if newest is not None:
        lines += ["", f"The newest run{_wall(newest)}:", "", newest["markdown"]]
        realistic = newest.get("realistic")
        if realistic and "markdown" in realistic:
            lines += [
                "",
                "The same run on REALISTIC (random weights: nothing is copied, drafts fail):",
                "",
                realistic["markdown"],
            ]
    return [*lines, ""]


def _identical(result: dict[str, Any]) -> str:
    """modeld's greedy output against its plain decoding on every compared turn, COPYING's and
    REALISTIC's; where it parted, how many partings came at a near tie (the batch kernels'
    rounding, blueprint 0021)."""
    sums = [result.get("summary") or {}, (result.get("realistic") or {}).get("summary") or {}]
    seen = [v for s in sums if (v := s.get("greedy_identical")) is not None]
    if not seen:
        return "not compared"
    if all(seen):
        return "identical ✓"
    partings = sum(s.get("modeld_partings", 0) for s in sums)
    ties = sum(s.get("modeld_partings_at_near_ties", 0) for s in sums)
    return f"DIFFERS ✗ ({ties} of {partings} workload(s) parted at a near tie)"


def fleet_lines(docs: list[Doc]) -> list[str]:
    """The fleet behind smg (``bench/fleet.py``): the issue's goal over the runs, then the newest
    run's table."""
    newest = next((r for d in docs if (r := _ran(d, "fleet"))), None)
    lines = [
        "## A fleet behind the gateway (`bench/fleet.py`, issue 18)",
        "",
        "Three workers behind SGLang's gateway (`smg`), each conversation with its own context; two turns each, then "
        "the worker holding the most conversations is killed and every conversation takes its third turn. A moved "
        "turn's TTFT against the same turn re-prefilled cold on a fresh worker of the same system (measured next to "
        "it), and against a fleet of llama-servers behind the same gateway. Goal: a moved turn at most 0.1 of a cold "
        "re-prefill on the 8k prefix. Each figure is the median over the moved conversations.",
        "",
        *_goal_table(docs, "fleet"),
        "",
        *_skipped(docs, "fleet"),
    ]
    if newest is not None:
        if newest["prefix_tokens"] < 8192:
            lines += [
                f"- Note: ~{newest['prefix_tokens']}-token contexts here; the goal is stated for the 8k prefix.",
                "",
            ]
        if newest.get("llama_server_flags"):
            lines += [
                f"- llama-server: `llama-server -m MODEL --alias bench {newest['llama_server_flags']}`",
                "",
            ]
        lines += [f"The newest run{_wall(newest)}:", "", newest["markdown"].removeprefix("# ")]
    return [*lines, ""]


def write_report(out: Path, docs: list[Doc]) -> None:
    """Write report.md, results.json and the plots for ``docs`` (newest first)."""
    doc = docs[0]
    merged = analysis.merge(docs)
    causes = analysis.causes(doc, merged)
    systems = [s for s in SYSTEM_ORDER if any(r["system"] == s for r in doc["turns"])]
    m, model = doc["machine"], doc["model"]
    lines = [
        f"# modeld benchmark{' (quick)' if doc.get('quick') else ''}",
        "",
        f"Written {time.strftime('%Y-%m-%d %H:%M', time.localtime())} from run(s) "
        + ", ".join(f"{d['id']} ({d['machine']['duration_s'] / 60:.1f} min)" for d in docs)
        + f". Model: generated `{model['name']}` ({model['file']}), greedy decode of {model['max_tokens']} tokens "
        f"per turn, {m['threads']} threads for every system, flash attention off"
        + (
            f"; modeld streams tokens that come within {model['stream_interval_s'] * 1000:.0f} ms "
            "together (`--stream-interval`, its default)."
            if "stream_interval_s" in model
            else "."
        ),
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; {m['platform']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + ". Load average at start / end per run: "
        + "; ".join(
            f"{d['machine']['load_average_start'][0]:.2f} / {d['machine']['load_average_end'][0]:.2f}"
            for d in docs
        )
        + " (a shared machine: read ratios and medians, not single numbers).",
        "",
        "Systems: **modeld** (`modeld serve`, gRPC through `runtime_client`, one session per workspace, manifests "
        "from the ContextBuilder); **modeld-http** (the same daemon's OpenAI endpoint, when installed); **limit** "
        "(llama-cpp-python driven directly, a hot context per workspace evaluating only the tokens that changed: "
        "what a perfect daemon would cost); **cold** (the same driver, full prefill of the same prompt); "
        "**llama-server** (llama.cpp's own server, built from the engine's llama.cpp commit, set up per workload "
        "as a well-informed user would); **lcp-server** (llama-cpp-python's OpenAI server with `--cache`). Every "
        "server listens on loopback; HTTP systems get the same raw prompt on `/v1/completions`, streamed.",
        "",
    ]
    if m.get("llama_server"):
        lines += [f"llama-server build: {m['llama_server']}", ""]
    lines += _headline(docs, merged, causes)
    lines += _memory(docs, systems)
    out.mkdir(parents=True, exist_ok=True)
    for load in doc["workloads"]:
        plot = f"ttft-{load['name']}.png"
        plot_workload(out / plot, docs, load, systems)
        lines += _workload(doc, load, systems, plot)
    plot_summary(out / "summary.png", merged)
    lines += ["## Summary plot", "", "![summary](summary.png)", ""]
    overhead = doc.get("overhead")
    if overhead:
        ip, wire = overhead["in_process"], overhead["over_the_wire"]
        lines += [
            "## Daemon overhead (memory backend: no engine cost)",
            "",
            f"Each turn: ensure_prefix on an unchanged {int(ip['prefix_tokens'])}-token prefix with a segmented "
            "manifest, a 64-token suffix, a 32-token decode, every token streamed on its own (`--stream-interval 0`). "
            "Medians. Goal (issue 9): an unchanged 8k prefix's ensure_prefix under 2 ms of daemon time.",
            "",
            "| | ensure_prefix ms | prefill_suffix ms | TTFT ms | per generated token µs |",
            "|---|---|---|---|---|",
            f"| in process (engine) | {ip['ensure_prefix_ms']:.2f} | {ip['prefill_suffix_ms']:.2f} | {ip['ttft_ms']:.2f} | {ip['per_token_ms'] * 1000:.0f} |",
            f"| over the wire (daemon) | {wire['ensure_prefix_ms']:.2f} | {wire['prefill_suffix_ms']:.2f} | {wire['ttft_ms']:.2f} | {wire['per_token_ms'] * 1000:.0f} |",
        ]
        worker = overhead.get("worker_process")
        if worker:
            lines += [
                f"| over the wire, engine in a worker process | {worker['ensure_prefix_ms']:.2f} | "
                f"{worker['prefill_suffix_ms']:.2f} | {worker['ttft_ms']:.2f} | {worker['per_token_ms'] * 1000:.0f} |",
                "",
                f"The worker's IPC cost (worker row minus the daemon row): "
                f"{worker['ttft_ms'] - wire['ttft_ms']:+.2f} ms per turn to the first token, "
                f"{(worker['per_token_ms'] - wire['per_token_ms']) * 1000:+.0f} µs per generated token "
                "(medians of one run; the memory backend computes nothing, so this is all protocol).",
            ]
        lines.append("")
        pairs = overhead.get("decode_pairs")
        if pairs:
            lines += [
                "## Decode through the worker, paired (`bench/decode_pairs.py`)",
                "",
                f"Issue 9's goal: decode tok/s through the worker / direct llama-cpp-python >= 0.97. The same "
                f"~1600-token prompt and {int(pairs['tokens'])} greedy tokens, the limit and modeld over gRPC (default "
                f"flags) back to back, the order swapped every pair, {int(pairs['pairs'])} pairs; the workloads' decode "
                "column above decodes 32 tokens a turn with the systems one after another, so it moves 5-12% between runs.",
                "",
                "| modeld / limit, median | range | limit tok/s | modeld tok/s |",
                "|---|---|---|---|",
                f"| {pairs['ratio_median']:.3f} {'✓' if pairs['ratio_median'] >= 0.97 else '✗'} | "
                f"{pairs['ratio_min']:.3f}-{pairs['ratio_max']:.3f} | {pairs['limit_tps_median']:.1f} | "
                f"{pairs['modeld_tps_median']:.1f} |",
                "",
            ]
        sdk = overhead.get("openai")
        if sdk:
            lines += [
                "## OpenAI endpoint overhead (memory backend, `bench/openai_overhead.py`)",
                "",
                f"The coding loop ({int(sdk['turns'])} turns, a growing chat, 32 streamed tokens a turn) over gRPC "
                "(`runtime_client`), over plain HTTP (`/v1/chat/completions`, streamed) and through the official "
                "`openai` SDK, on one daemon. Medians, ms. Goal (issue 10): the facade adds at most 5 ms a turn.",
                "",
                "| | TTFT | whole turn |",
                "|---|---|---|",
                f"| gRPC | {sdk['grpc_ttft_ms']:.1f} | {sdk['grpc_turn_ms']:.1f} |",
                f"| HTTP | {sdk['http_ttft_ms']:.1f} | {sdk['http_turn_ms']:.1f} |",
                f"| `openai` SDK | {sdk['sdk_ttft_ms']:.1f} | {sdk['sdk_turn_ms']:.1f} |",
                "",
                f"The facade (HTTP minus gRPC): {sdk['facade_turn_ms']:+.1f} ms a turn; through the SDK "
                f"{sdk['sdk_turn_overhead_ms']:+.1f} ms (the SDK's own client-side work included).",
                "",
            ]
    page = (overhead or {}).get("page")
    if page:
        lines += page_lines(page)
    if doc.get("agent_apis"):
        lines += agent_apis_lines(doc["agent_apis"], model["name"])
    if doc.get("families"):
        lines += families_lines(doc["families"])
    if doc.get("claude_code"):
        from bench.claude_code import report_lines

        lines += report_lines(doc["claude_code"])
    if doc.get("chat_agents"):
        from bench.chat_agents import report_lines as chat_agents_lines

        lines += chat_agents_lines(doc["chat_agents"])
    if any(d.get("speculation") for d in docs):
        lines += speculation_lines(docs)
    if any(d.get("fleet") for d in docs):
        lines += fleet_lines(docs)
    lines += [
        "Reproduce: `make bench` (one run; the report merges the two newest compatible runs), "
        "`make bench WORKLOAD=name` (one workload or extra: `agent_apis`, `families`, `claude_code`, `chat_agents`, `speculation`, `fleet`), `make bench-quick` (tiny model, the CI smoke run), "
        "`make bench-compare` (the newest run against the committed results).",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    (out / "results.json").write_text(
        json.dumps(
            {
                "schema": 2,
                "runs": [d["id"] for d in docs],
                "headline": merged,
                "causes": causes,
                "run_docs": docs,
            },
            indent=1,
        )
    )
