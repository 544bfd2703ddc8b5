"""``python -m bench.hybrid [--llama-server PATH] [--quick] [--classes swa-gemma3,...] [--edits map,messages]``: models
whose memory cannot be cut at any token, in an agent loop whose turns edit inside the prefix,
against llama-server with its default context checkpoints (blueprint 0016, "Memory that cannot be
cut at any token"; issue: hybrid, sliding-window and recurrent models stay warm).

Per class (a generated model of each: ``modeld.testmodels.ARCH_SPECS``; sliding window, short-conv
hybrid, gated-DeltaNet hybrid, Mamba-2 hybrid, pure recurrent), both servers get the same chat
requests through ``/v1/chat/completions`` (one answer token, greedy; the time to it is the turn's
TTFT):

* a conversation whose system prompt holds a repository map and whose turns edit inside the
  prefix, in turn: a repo-map line that changes (aider's map refresh), a reminder that moves to
  the newest user message (opencode's system reminder), and the previous answer's reasoning
  dropped (what Qwen3's and Qwen3.5's templates do to earlier turns). Two loops: ``map``, where
  the map line changes every turn (the first edit is inside the system message, at 60% of it),
  and ``messages``, where the map stays and the first edit is the moved reminder or the dropped
  reasoning (at a message's start or inside it);
* after the last turn both servers restart (modeld writes its warm contexts to disk; llama-server
  keeps nothing) and the conversation goes on with one more turn.

Each server answers one untimed request of another conversation after it starts (modeld loads a
model at its first request, llama-server before it answers ``/health``), so no turn counts a load.

Per class it reports: the tokens each server reused on the edit turns as a share of the tokens
before the edit (the prompts' longest common token prefix with the previous turn's, from
llama-server's ``/apply-template`` and ``/tokenize``: both render the same template); the warm
turns' TTFT, modeld over llama-server (medians); the first turn after the restart, the same ratio;
and the model's recurrent state and what ``--checkpoints`` may hold per context (modeld's
``/v1/models`` footprint). modeld runs with its defaults (``--num-ctx`` as llama-server's ``-c``);
llama-server as a user starts it for one conversation: ``--jinja -c N -np 1``, its default
``--ctx-checkpoints``, flash attention off and batch 512 as every bench system, and modeld's
OpenMP spin (``GOMP_SPINCOUNT``; with llama.cpp's default its prefill ran 33 times slower on a
loaded 2-core machine).

``--width N`` runs copies of the classes N wide (8 layers, 12 for gemma3's pattern, attention
every 4th layer where the class mixes; :func:`widen`): at the generated tiny sizes a token costs
0.05-0.13 ms and the warm TTFT ratio measures the two engine builds' speed and fixed costs, not
reuse (blueprint 0016, "Timed (stop 45)"); at 512 a token costs 0.5-1 ms and compute dominates.

Figures from a shared 2-core machine are noisy: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.systems.base import free_port
from bench.systems.openai_http import HttpServerSystem
from modeld import testmodels
from modeld.backends._omp import SPIN_COUNT
from modeld.backends.cpu import cpu_has_amx

__all__ = ["BENCH_WIDTH", "run_hybrid", "widen"]

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid"
N_CTX = 8192

Log = Callable[[str], None]


class _Server(HttpServerSystem):
    """One of the two servers, started for one model."""

    def __init__(self, name: str, args: list[str], port: int, *, model: str) -> None:
        self.name = name
        self.port = port
        self.model = model
        super().__init__(args)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ask(self, messages: list[dict[str, str]]) -> tuple[float, int, dict[str, Any]]:
        """One answer token; returns the seconds to it, the prompt tokens reused, the body."""
        body = {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0.0}
        started = time.perf_counter()
        resp = self.http.post("/v1/chat/completions", json=body)
        elapsed = time.perf_counter() - started
        resp.raise_for_status()
        done = resp.json()
        timings = done.get("timings") or {}
        details = (done.get("usage") or {}).get("prompt_tokens_details") or {}
        reused = int(timings.get("cache_n", details.get("cached_tokens") or 0))
        return elapsed, reused, done


def _modeld(path: str, data: Path, flags: tuple[str, ...] = ()) -> _Server:
    port = free_port()
    args = [
        sys.executable, "-m", "modeld.cli", "--data-dir", str(data), "serve",
        "--listen", f"unix:{data}/s.sock", "--backend", "llama", "--http", f"127.0.0.1:{port}",
        "--model", f"m={path}", "--num-ctx", str(N_CTX), *flags,
    ]  # fmt: skip
    return _Server("modeld", args, port, model="m")


def _llama_server(binary: str, path: str, threads: int) -> _Server:
    port = free_port()
    args = [
        binary, "-m", path, "--jinja", "-c", str(N_CTX), "-np", "1", "-t", str(threads), "-tb", str(threads),
        "-b", "512", "-ub", "512", "-fa", "off", "--port", str(port), "--host", "127.0.0.1",
        *(["--no-repack"] if cpu_has_amx() else []),
    ]  # fmt: skip
    return _Server("llama-server", args, port, model="m")


BENCH_WIDTH = 512
"""The width ``make bench`` runs the classes at (:func:`widen`): compute dominates there."""


def widen(spec: testmodels.ArchSpec, width: int) -> testmodels.ArchSpec:
    """``spec`` ``width`` wide: 8 layers (12 for gemma3: two of its 5-local-1-global patterns),
    64-wide attention heads with 2 KV heads, a feed-forward 3x wide, and where the class mixes
    attention with recurrent or convolutional layers, attention every 4th layer."""
    layers = 12 if spec.arch == "gemma3" else max(spec.layers, 8)
    return dataclasses.replace(
        spec,
        name=f"{spec.name}-w{width}",
        hidden=width,
        layers=layers,
        heads=width // 64 if spec.heads else 0,
        kv_heads=2 if spec.kv_heads else 0,
        head_dim=64 if spec.head_dim else 0,
        ff=3 * width if spec.ff else 0,
        attention=tuple(i for i in range(layers) if i % 4 == 3) if spec.attention else (),
    )


EDITS = ("map", "messages")
"""The two loops (see the module docstring)."""


def _repo_map(turn: int, lines: int) -> str:
    out = []
    for i in range(lines):
        version = turn if i == lines * 3 // 5 else 0  # one line, at 60% of the map, changes
        out.append(f"src/module_{i:03d}.py: def handler_{i}(request), class Model{i}(Base)  # v{version}\n")
    return "".join(out)


def _conversation(turn: int, lines: int, think: bool, edits: str = "map") -> list[dict[str, str]]:
    """The agent's request at ``turn``: an edit inside the prefix each turn (see the module
    docstring): the map at 60% (every turn of the ``map`` loop), the reminder moved to the
    newest user message, the reasoning of the last answer kept only while it is the last one
    (``think``)."""
    system = "You are a careful coding agent working in this repository.\nRepository map:\n" + _repo_map(
        turn if edits == "map" else 0, lines
    )
    messages = [{"role": "system", "content": system}]
    for k in range(turn + 1):
        user = f"Step {k}: run the tests for module_{k:03d} and fix what fails.\n"
        if k == turn:
            user += (
                "<system-reminder>Keep functions small; run the tests after each edit.</system-reminder>\n"
            )
        messages.append({"role": "user", "content": user})
        if k < turn:
            answer = f"Ran the tests of module_{k:03d}: 2 failures, fixed in handler_{k}.\n"
            if think and k == turn - 1:
                answer = f"<think>The failure is in handler_{k}; check its inputs.</think>\n" + answer
            messages.append({"role": "assistant", "content": answer})
    return messages


def _prompt_tokens(server: _Server, messages: list[dict[str, str]]) -> list[int]:
    prompt = server.http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    tokens: list[int] = server.http.post("/tokenize", json={"content": prompt, "add_special": True}).json()[
        "tokens"
    ]
    return tokens


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _class(
    spec: testmodels.ArchSpec,
    binary: str,
    threads: int,
    turns: int,
    lines: int,
    log: Log,
    edits: str = "map",
    flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    path = str(testmodels.ensure_model(spec))
    data = Path(tempfile.mkdtemp(prefix=f"bhy-{spec.name}-"))
    servers = [_modeld(path, data, flags), _llama_server(binary, path, threads)]
    rows: list[dict[str, Any]] = []

    def loaded() -> None:
        # modeld loads a model at its first request, llama-server before it answers /health:
        # one untimed request of another conversation, so no turn counts a model load.
        for server in servers:
            server.ask([{"role": "user", "content": "hello"}])

    try:
        loaded()
        footprint = servers[0].http.get("/v1/models").json()["data"][0].get("modeld", {}).get("footprint", {})
        previous: list[int] = []
        for turn in range(turns + 1):
            if turn == turns:
                for server in servers:
                    server.restart()
                loaded()
            messages = _conversation(turn, lines, think=True, edits=edits)
            tokens = _prompt_tokens(servers[1], messages)
            before = _lcp(previous, tokens) if previous else 0
            row: dict[str, Any] = {"turn": turn, "prompt": len(tokens), "before_edit": before}
            row["restart"] = turn == turns
            for server in servers:
                elapsed, reused, _ = server.ask(messages)
                row[server.name] = {"ttft_s": round(elapsed, 4), "reused": reused}
            rows.append(row)
            log(
                f"{spec.name} ({edits}) turn {turn}{' (after a restart)' if row['restart'] else ''}: {len(tokens)} tokens, "
                f"{before} before the edit; modeld reused {row['modeld']['reused']} in {row['modeld']['ttft_s']:.2f} s, "
                f"llama-server {row['llama-server']['reused']} in {row['llama-server']['ttft_s']:.2f} s"
            )
            previous = tokens
    finally:
        for server in servers:
            server.close()
    return {
        "model": spec.name,
        "edits": edits,
        "modeld_flags": list(flags),
        "memory": footprint.get("memory", ""),
        "footprint": footprint,
        "turns": rows,
    }


def _summary(doc: dict[str, Any]) -> dict[str, Any]:
    rows = doc["turns"]
    edits = [r for r in rows[1:] if not r["restart"] and r["before_edit"]]
    after = [r for r in rows if r["restart"]]

    def share(name: str) -> float:
        return (
            statistics.median(min(1.0, r[name]["reused"] / r["before_edit"]) for r in edits) if edits else 0.0
        )

    def ttft(name: str, rs: list[dict[str, Any]]) -> float:
        return statistics.median(r[name]["ttft_s"] for r in rs) if rs else 0.0

    warm = ttft("modeld", edits) / max(1e-9, ttft("llama-server", edits))
    restart = ttft("modeld", after) / max(1e-9, ttft("llama-server", after))
    fp = doc["footprint"]
    return {
        "model": doc["model"],
        "edits": doc.get("edits", "map"),
        "memory": doc["memory"],
        "reuse_share_modeld": round(share("modeld"), 3),
        "reuse_share_llama_server": round(share("llama-server"), 3),
        "warm_ttft_ratio": round(warm, 3),
        "restart_ttft_ratio": round(restart, 3),
        "state_bytes": fp.get("state_bytes", 0),
        "checkpoint_bytes": fp.get("checkpoint_bytes", 0),
    }


def report(docs: list[dict[str, Any]]) -> str:
    lines = [
        "| model | edits | memory | reused before the edit: modeld | llama-server "
        "| warm TTFT modeld / llama-server | after a restart | state per sequence | checkpoints per model (max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for doc in docs:
        s = _summary(doc)
        lines.append(
            f"| {s['model']} | {s['edits']} | {s['memory']} | {s['reuse_share_modeld']:.0%} | {s['reuse_share_llama_server']:.0%} "
            f"| {s['warm_ttft_ratio']:.2f} | {s['restart_ttft_ratio']:.2f} | {s['state_bytes']} B "
            f"| {s['checkpoint_bytes']} B |"
        )
    return "\n".join(lines) + "\n"


def run_hybrid(
    llama_server: str,
    *,
    threads: int,
    quick: bool = False,
    classes: list[str] | None = None,
    edits: tuple[str, ...] = EDITS,
    width: int = 0,
    flags: tuple[str, ...] = (),
    log: Log = print,
) -> dict[str, Any]:
    """Every class's loops (see the module docstring); ``quick``: 3 turns over a shorter map;
    ``width``: the classes' copies that wide (:func:`widen`; 0: as generated); ``flags``: more
    ``modeld serve`` flags (its defaults otherwise)."""
    if not llama_server or not Path(llama_server).is_file():
        return {"skipped": "no llama-server binary (scripts/build_llama_server.sh builds one)"}
    # Both servers wait for work with modeld's OpenMP spin (modeld/backends/_omp.py): with
    # llama.cpp's default, llama-server's threads spun on a loaded 2-core machine and its prefill
    # ran 33 times slower (112 against 3700 tokens a second, qwen35, load average 14).
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    specs = [s for s in testmodels.ARCH_SPECS if not classes or s.name in classes]
    if width:
        specs = [widen(s, width) for s in specs]
    turns, lines = (3, 24) if quick else (6, 60)
    docs = [_class(spec, llama_server, threads, turns, lines, log, e, flags) for e in edits for spec in specs]
    return {"classes": docs, "summary": [_summary(d) for d in docs], "report": report(docs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hybrid", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-server", default="", help="the llama-server binary (scripts/build_llama_server.sh)"
    )
    parser.add_argument("--quick", action="store_true", help="3 turns over a shorter repository map")
    parser.add_argument("--classes", default="", help="comma-separated model names (default: every class)")
    parser.add_argument("--edits", default=",".join(EDITS), help="the loops to run: map, messages")
    parser.add_argument(
        "--modeld-flag",
        action="append",
        default=[],
        help="a flag for modeld serve (repeatable), e.g. --no-swa-full",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--width", type=int, default=0, help="run copies this wide (a multiple of 64; 0: as generated)"
    )
    args = parser.parse_args(argv)
    doc = run_hybrid(
        args.llama_server,
        threads=args.threads,
        quick=args.quick,
        classes=[c for c in args.classes.split(",") if c] or None,
        edits=tuple(e for e in args.edits.split(",") if e in EDITS) or EDITS,
        width=args.width,
        flags=tuple(args.modeld_flag),
        log=lambda s: print(s, flush=True),
    )
    if "skipped" in doc:
        print(f"bench.hybrid: skipped: {doc['skipped']}", file=sys.stderr)
        return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"{stamp}.json").write_text(json.dumps(doc, indent=1))
    (RESULTS / f"{stamp}.md").write_text(doc["report"])
    print(doc["report"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
