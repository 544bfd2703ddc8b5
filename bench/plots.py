"""The report's plots: TTFT per turn per system for each workload, and one summary.

Per workload: the newest run solid, the other run (when there is one) dotted in the same
colour, so the run-to-run spread is visible per turn; log scale. Summary: modeld's TTFT ratios
against the limit, llama-server and the llama-cpp-python server per workload, the bar the mean
of the runs and the whisker the range between them; the line at 1 is parity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import analysis

__all__ = ["plot_summary", "plot_workload"]

COLORS = {
    "modeld": "tab:blue",
    "modeld-http": "tab:cyan",
    "limit": "tab:orange",
    "cold": "tab:green",
    "llama-server": "tab:red",
    "lcp-server": "tab:purple",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_workload(path: Path, docs: list[dict[str, Any]], load: dict[str, Any], systems: list[str]) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for run, doc in enumerate(docs[:2]):
        for system in systems:
            turns = analysis.by_turn(doc, system, load["name"])
            if not turns:
                continue
            xs = sorted(turns)
            ax.plot(
                xs,
                [turns[t]["ttft_s"] for t in xs],
                marker="o" if run == 0 else ".",
                label=system if run == 0 else None,
                color=COLORS.get(system, "black"),
                linestyle=("" if system == "cold" else "-")
                if run == 0
                else ("" if system == "cold" else ":"),
                alpha=1.0 if run == 0 else 0.5,
            )
    for t in load["restart_before"]:
        ax.axvline(t - 0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(load["turns"]))
    ax.set_title(
        f"{load['name']}: TTFT per turn" + (" (dotted: the other run)" if len(docs) > 1 else ""), fontsize=9
    )
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, s (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_summary(path: Path, merged: dict[str, dict[str, dict[str, Any]]]) -> None:
    plt = _pyplot()
    keys = [
        ("modeld_over_limit", "modeld / limit", "tab:orange"),
        ("modeld_over_llama_server", "modeld / llama-server", "tab:red"),
        ("modeld_over_lcp_server", "modeld / lcp-server", "tab:purple"),
    ]
    names = list(merged)
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(names)), 4.0))
    for k, (key, label, color) in enumerate(keys):
        xs, ys, lo, hi = [], [], [], []
        for i, name in enumerate(names):
            cell = merged[name][key]
            runs = [v for v in cell["runs"] if v is not None]
            if cell["value"] is None or not runs:
                continue
            xs.append(i + (k - 1) * width)
            ys.append(cell["value"])
            lo.append(cell["value"] - min(runs))
            hi.append(max(runs) - cell["value"])
        ax.bar(xs, ys, width, yerr=[lo, hi], label=label, color=color, capsize=2)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("warm TTFT ratio (log; < 1: modeld faster)")
    ax.set_title("modeld against the limit and the peers (whiskers: run-to-run range)", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
