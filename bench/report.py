"""The benchmark report: headline ratios, per-workload tables, the TTFT plot, and raw JSON.

Definitions (also printed in the report):
* a *warm* turn is one whose workspace was already seen earlier in the workload;
* TTFT is client-observed, from the start of the turn (ensure_prefix / the HTTP request) to the
  first generated token;
* ratios are medians of per-turn ratios over the turns both systems ran, so one noisy turn on a
  shared machine cannot swing them.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["write_report"]

SYSTEM_ORDER = ["modeld", "limit", "cold", "peer", "peer+cache"]
COLORS = {
    "modeld": "tab:blue",
    "limit": "tab:orange",
    "cold": "tab:green",
    "peer": "tab:red",
    "peer+cache": "tab:purple",
}


def _by(results: list[dict[str, Any]], system: str, workload: str) -> dict[int, dict[str, Any]]:
    return {r["turn"]: r for r in results if r["system"] == system and r["workload"] == workload}


def _warm_turns(load: dict[str, Any], workspaces: dict[str, list[int]]) -> list[int]:
    seen: set[int] = set()
    warm = []
    for i, ws in enumerate(workspaces[load["name"]]):
        if ws in seen:
            warm.append(i)
        seen.add(ws)
    return warm


Turns = dict[int, dict[str, Any]]


def _ratios(a: Turns, b: Turns, turns: list[int], key: str = "ttft_s") -> list[float]:
    return [a[t][key] / b[t][key] for t in turns if t in a and t in b and b[t][key] > 0]


def _ratio(a: Turns, b: Turns, turns: list[int], key: str = "ttft_s") -> float | None:
    values = _ratios(a, b, turns, key)
    return statistics.median(values) if values else None


def _spread(a: Turns, b: Turns, turns: list[int], key: str = "ttft_s") -> str:
    """``median (min-max)`` of the per-turn ratios: the machine's noise, visible."""
    values = _ratios(a, b, turns, key)
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def _median_ratio(
    a: dict[int, dict[str, Any]], cold: dict[int, dict[str, Any]], warm: list[int]
) -> float | None:
    """Median warm TTFT over median cold TTFT (cold is measured on a few turns of similar size)."""
    warm_values = [a[t]["ttft_s"] for t in warm if t in a]
    cold_values = [r["ttft_s"] for r in cold.values()]
    if not warm_values or not cold_values:
        return None
    return float(statistics.median(warm_values) / statistics.median(cold_values))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_report(
    out: Path,
    *,
    quick: bool,
    model: dict[str, Any],
    machine: dict[str, Any],
    workloads: list[dict[str, Any]],
    results: list[dict[str, Any]],
    rss: dict[str, dict[str, int]],
    overhead: dict[str, dict[str, float]],
) -> None:
    workspaces = {w["name"]: w.get("workspace_of_turn", []) for w in workloads}
    for w in workloads:
        if not workspaces[w["name"]]:
            workspaces[w["name"]] = (
                [0] * w["turns"] if w["name"] != "interleaved" else [i % 3 for i in range(w["turns"])]
            )
    systems = [s for s in SYSTEM_ORDER if any(r["system"] == s for r in results)]
    summary: dict[str, Any] = {"workloads": {}, "headline": {}}
    lines = [
        f"# modeld benchmark{' (quick)' if quick else ''}",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.localtime())}, {machine['duration_s']} s. Model: generated "
        f"`{model['name']}` ({model['file']}), n_ctx {model['n_ctx']}, greedy decode of {model['max_tokens']} tokens per turn.",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB; {machine['platform']}; "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
        + f". Load average {machine['load_average_start'][0]:.2f} at start, {machine['load_average_end'][0]:.2f} at end "
        "(a shared machine: read medians and ratios, not single numbers).",
        "",
        "Systems: **modeld** (llama backend, `runtime_client` over the unix socket, manifests built with the "
        "ContextBuilder); **limit** (llama-cpp-python driven directly in-process, a hot context per workspace "
        "evaluating only the tokens that changed: what a perfect daemon would cost); **cold** (the same driver, "
        "full prefill of the same prompt); **peer** / **peer+cache** (llama-cpp-python's OpenAI server, "
        "`python -m llama_cpp.server`, without and with `--cache`, streaming over HTTP).",
        "",
    ]

    headline_rows = []
    for load in workloads:
        name = load["name"]
        warm = _warm_turns(load, workspaces)
        turns = list(range(load["turns"]))
        m, lim, cold = _by(results, "modeld", name), _by(results, "limit", name), _by(results, "cold", name)
        peer, peerc = _by(results, "peer", name), _by(results, "peer+cache", name)
        row = {
            "modeld_over_limit_warm": _ratio(m, lim, warm),
            "modeld_warm_over_cold": _median_ratio(m, cold, warm),
            "modeld_over_peer": _ratio(m, peer, turns),
            "modeld_over_peer_cache": _ratio(m, peerc, turns),
            "decode_modeld_over_limit": _ratio(m, lim, turns, "decode_tps"),
            "same_tokens_as_limit": sum(
                1 for t in turns if t in m and t in lim and m[t]["token_ids"] == lim[t]["token_ids"]
            ),
            "turns": len(turns),
        }
        summary["headline"][name] = row
        headline_rows.append(
            f"| {name} | {_spread(m, lim, warm)} | {_fmt(row['modeld_warm_over_cold'])} | "
            f"{_spread(m, peer, turns)} | {_spread(m, peerc, turns)} | {_spread(m, lim, turns, 'decode_tps')} | "
            f"{row['same_tokens_as_limit']}/{row['turns']} |"
        )

    lines += [
        "## Headline ratios",
        "",
        "| workload | modeld warm TTFT / limit (goal <= 1.05) | modeld warm TTFT / cold prefill | modeld / peer TTFT | "
        "modeld / peer+cache TTFT | modeld decode tok/s / direct (goal >= 0.97) | greedy tokens equal to the limit's |",
        "|---|---|---|---|---|---|---|",
        *headline_rows,
        "",
        "Medians of per-turn ratios (in brackets, the smallest and largest per-turn ratio: the machine's noise), "
        "except *warm / cold*: median warm TTFT over median cold TTFT, cold being a "
        "full prefill of a turn's prompt measured on a few turns (for `loop_large` and `interleaved`, the limit's "
        "first turn on a fresh context). *Warm* turns are those whose workspace was seen before in the workload. "
        "Systems run turn by turn (each turn on every system back to back, the starting system rotating), one at a "
        "time, each waiting until the previous one is idle.",
        "",
    ]

    for load in workloads:
        name = load["name"]
        warm = _warm_turns(load, workspaces)
        lines += [f"## {name}: {load['title']}", ""]
        extra = f"; the edit is at token {load['edit_token']}" if load.get("edit_token") else ""
        lines += [
            f"Prefix tokens {load['prefix_tokens']}; suffix tokens per turn {load['suffix_tokens']}{extra}.",
            "",
        ]
        lines += [
            "| system | TTFT median ms (all turns) | warm TTFT median ms | min-max ms | tokens prefilled (warm, median) | decode tok/s (median) | peak RSS MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        per_system: dict[str, Any] = {}
        for system in systems:
            by_turn = _by(results, system, name)
            if not by_turn:
                continue
            ttfts = [r["ttft_s"] for r in by_turn.values()]
            warm_ttfts = [by_turn[t]["ttft_s"] for t in warm if t in by_turn]
            prefilled = [
                by_turn[t]["prefilled"] for t in warm if t in by_turn and by_turn[t]["prefilled"] is not None
            ]
            tps = [r["decode_tps"] for r in by_turn.values() if r["decode_tps"] > 0]
            entry = {
                "ttft_median_s": statistics.median(ttfts),
                "ttft_warm_median_s": statistics.median(warm_ttfts) if warm_ttfts else None,
                "ttft_min_s": min(ttfts),
                "ttft_max_s": max(ttfts),
                "prefilled_warm_median": statistics.median(prefilled) if prefilled else None,
                "decode_tps_median": statistics.median(tps) if tps else None,
                "peak_rss_bytes": rss.get(system, {}).get(name),
            }
            per_system[system] = entry
            mib = entry["peak_rss_bytes"]
            lines.append(
                f"| {system} | {_ms(entry['ttft_median_s'])} | {_ms(entry['ttft_warm_median_s'])} | "
                f"{_ms(entry['ttft_min_s'])}-{_ms(entry['ttft_max_s'])} | "
                f"{'-' if entry['prefilled_warm_median'] is None else int(entry['prefilled_warm_median'])} | "
                f"{_fmt(entry['decode_tps_median'], 1)} | {'-' if not mib else f'{mib / (1 << 20):.0f}'} |"
            )
        summary["workloads"][name] = per_system
        lines.append("")
        per_turn = ["| turn | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
        for t in range(load["turns"]):
            cells = []
            for system in systems:
                r = _by(results, system, name).get(t)
                cells.append("" if r is None else _ms(r["ttft_s"]))
            per_turn.append(f"| {t}{' (warm)' if t in warm else ''} | " + " | ".join(cells) + " |")
        lines += ["TTFT per turn, ms:", "", *per_turn, ""]

    ip, wire = overhead["in_process"], overhead["over_the_wire"]
    lines += [
        "## Daemon overhead (memory backend: no engine cost)",
        "",
        f"Each turn: ensure_prefix on an unchanged {int(ip['prefix_tokens'])}-token prefix with a segmented manifest, "
        "a 64-token suffix, a 32-token decode. Medians.",
        "",
        "| | ensure_prefix ms | prefill_suffix ms | TTFT ms | per generated token µs |",
        "|---|---|---|---|---|",
        f"| in process (engine) | {ip['ensure_prefix_ms']:.2f} | {ip['prefill_suffix_ms']:.2f} | {ip['ttft_ms']:.2f} | {ip['per_token_ms'] * 1000:.0f} |",
        f"| over the wire (daemon) | {wire['ensure_prefix_ms']:.2f} | {wire['prefill_suffix_ms']:.2f} | {wire['ttft_ms']:.2f} | {wire['per_token_ms'] * 1000:.0f} |",
        "",
        "Reproduce: `make bench` (this report) or `make bench-quick` (tiny model, smaller sizes, the CI smoke run).",
        "",
    ]
    summary["overhead"] = overhead
    out.joinpath("report.md").write_text("\n".join(lines))
    out.joinpath("results.json").write_text(
        json.dumps(
            {
                "model": model,
                "machine": machine,
                "workloads": workloads,
                "summary": summary,
                "turns": results,
            },
            indent=1,
        )
    )
    _plot(out / "ttft.png", workloads, results, systems)


def _plot(
    path: Path, workloads: list[dict[str, Any]], results: list[dict[str, Any]], systems: list[str]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8), squeeze=False)
    for ax, load in zip(axes[0], workloads, strict=True):
        for system in systems:
            turns = _by(results, system, load["name"])
            if not turns:
                continue
            xs = sorted(turns)
            ax.plot(
                xs,
                [turns[t]["ttft_s"] for t in xs],
                marker="o",
                label=system,
                color=COLORS[system],
                linestyle="" if system == "cold" else "-",
            )
        ax.set_yscale("log")
        ax.set_xticks(range(load["turns"]))
        ax.set_title(load["name"], fontsize=10)
        ax.set_xlabel("turn")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time to first token, s (log)")
    handles = {line.get_label(): line for ax in axes[0] for line in ax.get_lines()}
    shown = [s for s in systems if s in handles]
    axes[0][-1].legend([handles[s] for s in shown], shown, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
