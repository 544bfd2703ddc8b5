"""``python -m bench.chat_agents``: a main agent and two sub-agents over ``/v1/chat/completions``
with tools, modeld against llama-server, paired turn by turn (issue 30).

The three agents share a system prompt (about 2.4k tokens of the realistic vocabulary: rules and
a repository map) and the tools; each has its own task, and each turn appends what an agent
loop appends after a tool call: the assistant's call (scripted: what each server generated is
dropped, so both get byte-identical bodies) and the tool's result. Per round:

1. the main agent's turn, then each sub-agent's, one at a time (**warm turns**);
2. the two sub-agents at once (**two sub-agents at once**);

and after the last round, all three at once on the default window (**three at once**: errors).
Each turn runs on both servers back to back, the first alternating, the second started after
the first is idle (``settle``). modeld runs at its defaults with ``--num-ctx 8192`` (one unified
window of 8192 cells for 4 sequences: the three agents do not fit together, the one that gives
way moves to a tier whole); llama-server with ``-np 3 --kv-unified -c 24576`` (a window per agent).

Per turn and system: TTFT (client-observed: the request sent to the first streamed content
delta, or to the end), the prompt tokens the server computed (modeld: ``prompt_tokens -
cached_tokens``; llama-server: ``timings.prompt_n``) and what it had never seen (the prompt minus
that agent's previous prompt): computed beyond that was computed before (**recomputed**).
Timing is printed and recorded, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.extra_run import write_extra_run
from bench.systems.base import Unsupported, settle
from bench.systems.llama_server import LlamaServerSystem
from bench.systems.modeld_http import ModeldHttpSystem
from bench.workloads import Workload

__all__ = ["Record", "main", "run_chat_agents"]

WINDOW = 8192
AGENTS = ("main", "sub_a", "sub_b")
ROUNDS = 4
QUICK_ROUNDS = 2
SYSTEMS = ("modeld", "llama-server")
Log = Callable[[str], None]
Body = dict[str, Any]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": what,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "a path in the repository"}},
                "required": ["path"],
            },
        },
    }
    for name, what in (
        ("read_file", "Read a file of the repository and return its text."),
        ("list_dir", "List a directory of the repository."),
        ("run_tests", "Run the tests under a path and return their output."),
    )
]

SYSTEM = (
    "You are a coding agent working in a large repository. Follow the rules.\n"
    + "".join(
        f"Rule {i}: keep module {i} small, name things plainly, and test every change to it.\n"
        for i in range(40)
    )
    + "".join(
        f"repo: src/pkg{i // 8}/mod{i}.py defines Handler{i}, load_{i}() and save_{i}()\n" for i in range(60)
    )
)

TASKS = {
    "main": "Fix the failing test in src/pkg2/mod17.py and explain the cause.",
    "sub_a": "Sub-task: list every caller of load_23() in src/ and summarize them.",
    "sub_b": "Sub-task: check that save_41() handles an empty payload; report what it does.",
}


@dataclass
class Record:
    phase: str  # warm, pair, three
    round: int
    agent: str
    system: str
    ttft_s: float
    prompt_tokens: int | None
    computed_tokens: int | None
    new_tokens: int | None  # the prompt minus this agent's previous prompt (never seen by the server)
    error: str = ""


class Agent:
    """One agent's conversation (the same on both servers)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.messages: list[Body] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TASKS[name]},
        ]
        self.steps = 0
        self.previous: dict[str, int] = {}

    def body(self, max_tokens: int) -> Body:
        return {
            "model": "bench",
            "messages": self.messages,
            "tools": TOOLS,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def advance(self) -> None:
        """What an agent loop appends after the turn: the call it made and the tool's result."""
        k = self.steps
        self.steps += 1
        call = f"call_{self.name}_{k}"
        path = f"src/pkg{k % 7}/mod{(k * 13 + len(self.name)) % 60}.py"
        self.messages += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": json.dumps({"path": path})},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": call,
                "content": "".join(f"{path}:{n}: value_{n} = compute({n}, state)\n" for n in range(20)),
            },
        ]


def send(http: httpx.Client, body: Body) -> tuple[float, int | None, int | None]:
    """POST a streamed chat completion: TTFT, prompt tokens, tokens computed."""
    started = time.perf_counter()
    first = 0.0
    usage: Body = {}
    timings: Body = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:400]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            payload = json.loads(line[5:])
            if "error" in payload:
                raise RuntimeError(f"stream error: {json.dumps(payload['error'])[:400]}")
            choices = payload.get("choices") or []
            delta = choices[0].get("delta") or {} if choices else {}
            if not first and (
                delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
            ):
                first = time.perf_counter()
            if payload.get("usage"):
                usage = payload["usage"]
            if isinstance(payload.get("timings"), dict):
                timings = payload["timings"]
    done = time.perf_counter()
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    computed = (
        timings.get("prompt_n")
        if "prompt_n" in timings
        else (prompt - cached if prompt is not None else None)
    )
    return (first or done) - started, prompt, computed


def _start(name: str, model: str, llama_server: str, threads: int) -> Any:
    if name == "modeld":  # its defaults, with the window the issue measured at
        return ModeldHttpSystem(model, Workload(name, name, "", "", [], n_ctx=WINDOW), threads)
    load = Workload(name, name, "", "", [], workspaces=len(AGENTS), n_ctx=WINDOW)
    return LlamaServerSystem(llama_server, model, load, threads)


def run_chat_agents(
    model: str,
    llama_server: str,
    threads: int,
    *,
    rounds: int = ROUNDS,
    max_tokens: int = 32,
    systems: list[str] | None = None,
    log: Log = print,
) -> dict[str, Any]:
    """The rounds on both systems; the document ``make bench`` stores as the run's ``chat_agents``."""
    notes: list[str] = []
    running: dict[str, Any] = {}
    for name in systems or list(SYSTEMS):
        try:
            running[name] = _start(name, model, llama_server, threads)
        except Unsupported as e:
            notes.append(f"{name} skipped: {e}")
    agents = {a: Agent(a) for a in AGENTS}
    began = time.time()
    daemon: list[dict[str, Any]] = []
    records: list[Record] = []
    lock = threading.Lock()
    previous_system: Any = None
    flip = 0

    def one(phase: str, r: int, agent: Agent, name: str) -> None:
        body = agent.body(max_tokens)
        try:
            ttft, prompt, computed = send(running[name].http, body)
            error = ""
        except Exception as e:  # recorded: an error of the workload
            ttft, prompt, computed, error = 0.0, None, None, str(e)[:300]
        before = agent.previous.get(name)
        new = prompt - before if prompt is not None and before is not None else prompt
        if prompt is not None:
            agent.previous[name] = prompt
        record = Record(phase, r, agent.name, name, ttft, prompt, computed, new, error)
        with lock:
            records.append(record)
        log(
            f"  chat_agents {phase:<5} round {r} {agent.name:<6} {name:<12} TTFT {ttft * 1000:8.1f} ms  "
            f"computed {computed!s:>5} of {prompt!s:>5} (new {new!s:>5})"
            + (f"  FAILED: {error}" if error else "")
        )

    def paired(phase: str, r: int, group: list[Agent]) -> None:
        nonlocal previous_system, flip
        order = list(running)
        flip += 1
        for name in order[::-1] if flip % 2 else order:
            if previous_system is not None:
                settle(previous_system.pids())
            previous_system = running[name]
            threads_ = [threading.Thread(target=one, args=(phase, r, a, name)) for a in group]
            for t in threads_:
                t.start()
            for t in threads_:
                t.join()

    try:
        for r in range(rounds):
            for a in AGENTS:
                paired("warm", r, [agents[a]])
                agents[a].advance()
            paired("pair", r, [agents["sub_a"], agents["sub_b"]])
            agents["sub_a"].advance()
            agents["sub_b"].advance()
        paired("three", rounds, [agents[a] for a in AGENTS])
        for name, system in running.items():  # what modeld's daemon did for every turn
            if hasattr(system, "records"):
                daemon += [{"system": name, **r} for r in system.records(began)]
    finally:
        for system in running.values():
            system.close()
    return {
        "rounds": rounds,
        "window": WINDOW,
        "max_tokens": max_tokens,
        "settings": {name: system.settings for name, system in running.items()},
        "notes": notes,
        "records": [asdict(r) for r in records],
        "daemon_records": daemon,
        "errors": sum(1 for r in records if r.error),
    }


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures: medians of per-turn modeld / llama-server TTFT ratios for the warm
    turns (rounds after the first) and the two sub-agents at once, errors of three at once per
    system, and the tokens each system computed that it had computed before."""
    by: dict[tuple[str, int, str], dict[str, Body]] = {}
    for r in result.get("records") or []:
        by.setdefault((r["phase"], r["round"], r["agent"]), {})[r["system"]] = r

    def ratios(phase: str, agent: str = "") -> list[float]:
        out = []
        for (p, rnd, who), pair in by.items():
            m, s = pair.get("modeld"), pair.get("llama-server")
            if agent and who != agent:
                continue
            if p == phase and (phase != "warm" or rnd > 0) and m and s and m["ttft_s"] and s["ttft_s"]:
                out.append(m["ttft_s"] / s["ttft_s"])
        return out

    warm, pair = ratios("warm"), ratios("pair")
    per_agent = {a: ratios("warm", a) for a in AGENTS}
    records = result.get("records") or []
    ran = {r["system"] for r in records}
    return {
        "systems": sorted(ran),
        "warm_ratio": statistics.median(warm) if warm else None,
        "pair_ratio": statistics.median(pair) if pair else None,
        "warm_ratio_by_agent": {a: statistics.median(v) if v else None for a, v in per_agent.items()},
        "three_errors": {
            name: sum(1 for r in records if r["phase"] == "three" and r["system"] == name and r["error"])
            for name in SYSTEMS
        },
        "recomputed": {
            name: sum(
                max(0, (r["computed_tokens"] or 0) - (r["new_tokens"] or 0))
                for r in records
                if r["system"] == name and r["computed_tokens"] is not None and r["new_tokens"] is not None
            )
            for name in SYSTEMS
        },
    }


def report_lines(result: dict[str, Any]) -> list[str]:
    f = figures(result)

    def ratio(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "-"

    lines = [
        "## Agents over the chat API: a main agent and two sub-agents (`bench/chat_agents.py`)",
        "",
        f"modeld at its defaults with a {result.get('window', WINDOW)}-token window; llama-server "
        "`-np 3 --kv-unified`, a window per agent. Medians of per-turn TTFT ratios.",
        "",
        "| figure | modeld / llama-server | goal |",
        "|---|---|---|",
        f"| warm turns (rounds 2 on) | {ratio(f['warm_ratio'])} | <= 0.4 |",
        *(
            f"| warm turns of {agent} | {ratio(value)} | |"
            for agent, value in f["warm_ratio_by_agent"].items()
        ),
        f"| two sub-agents at once | {ratio(f['pair_ratio'])} | <= 0.25 |",
        "",
        "Three agents at once, errors: "
        + ", ".join(f"{name} {f['three_errors'][name]}" for name in SYSTEMS if name in f["systems"])
        + ". Tokens computed that the server had computed before (computed minus what it never "
        "saw): "
        + ", ".join(f"{name} {f['recomputed'][name]}" for name in SYSTEMS if name in f["systems"])
        + ".",
        "",
        *(f"- {n}" for n in result.get("notes") or []),
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chat_agents", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 rounds, 8-token answers")
    parser.add_argument(
        "--llama-server", default="", help="the llama-server binary (scripts/build_llama_server.sh)"
    )
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write run.json and report.md here")
    args = parser.parse_args(argv)
    from modeld import testmodels

    spec = testmodels.TINY if args.quick else testmodels.REALISTIC
    model = str(testmodels.ensure_model(spec))
    started = time.time()
    result = run_chat_agents(
        model,
        args.llama_server,
        len(os.sched_getaffinity(0)),
        rounds=args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS),
        max_tokens=8 if args.quick else 32,
        log=lambda s: print(s, flush=True),
    )
    write_extra_run("chat_agents", (spec.name, Path(model).name), started, result, report_lines, args.out)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
