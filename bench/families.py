"""``python -m bench.families``: an agent loop per model family, modeld against llama-server ``--jinja``.

Issue 31's benchmark. For each family of ``modeld.testmodels.families`` (Qwen3, gpt-oss, Llama
3.3, Mistral Small, Gemma, GLM, DeepSeek, Kimi, MiniMax, LFM2, Nemotron, Seed-OSS, Granite,
Command R: each template written here from the real one's rules), a model carrying that family's
template and control tokens plays a multi-turn coding-agent loop with tools over OpenAI chat
(``POST /v1/chat/completions``, streamed), on modeld (``modeld serve --http``) and on two
llama-servers (``--jinja``, the bench's settings from ``bench/systems``), all started afresh per
family: ``llama-server`` at its default (no ``--cache-reuse``: the goal's baseline, exact as modeld
is) and ``llama-server-reuse`` (``--cache-reuse 256``: after a template re-renders an earlier
turn it shifts the KV of the chunks after the change into new positions, fewer tokens computed,
not what a fresh prefill computes: ``bench/families_exactness.py`` measures by how much,
blueprint 0010). Every server waits for work with modeld's OpenMP spin (``GOMP_SPINCOUNT``, the
worker's setting, ``modeld/backends/_omp.py``; an operator's own wins; ``--omp-default`` gives
llama-server libgomp's default instead): the spin is a setting a user can give llama-server too,
and on loaded cores libgomp's default made its prefill ~2x slower (blueprint 0010).

The model: REALISTIC (the 0.5B-shaped generated model) carrying the family's template and
tokens, made by the family machinery (``ensure_family_model(name, base=REALISTIC)``: only the
metadata differs from REALISTIC's, 412 MB a copy, ~5 s to write). The copies are made when a
family's loop starts and removed after it (``--keep-models`` keeps them): 18 cached copies
would hold 7.4 GB for 5 s each saved. ``--quick`` (``make bench-quick``): the tiny family models
(REPLY's shape) of :data:`QUICK_FAMILIES`, 3 turns, no llama-server unless given.

The conversation (the same bytes to both systems, the assistant turns scripted, so what either
generated is dropped): a system prompt (Claude Code's, cut to :data:`SYSTEM_CHARS` characters,
~800 tokens; the first prompt is ~2k tokens with the tools), three tools (Claude Code's Read, Bash and Edit, in OpenAI's function form), a
first instruction; every later turn adds an assistant call (empty content, a line of
``reasoning_content``, one ``tool_calls`` entry with a 9-character id, as Mistral needs) and its
``tool`` result (a file read, a test run, grep hits, an edit's snippet: ``bench.agent_apis``'
steps); every second turn then also an answer and a new user instruction, so both shapes of an
agent's request (after a tool result, after a user message) are measured and the templates that
render earlier turns otherwise once a later user turn exists (Qwen3 drops the reasoning) do so.
Gemma 3's template has no tools: its turns carry the step's output in a user message instead.

Per turn and system: TTFT (client-observed: request sent to the first chunk carrying generated
content, ``content``/``reasoning_content``/``tool_calls``; also the first chunk of any kind),
prompt tokens, tokens computed (modeld: ``prompt_tokens - cached_tokens`` of its usage;
llama-server: its ``timings.prompt_n``, else its log), each server's own ``timings.prompt_ms``.
Per family: the warm-turn (every turn after the first) TTFT ratio modeld / llama-server (median
and range) and whether modeld computed more than llama-server on any turn. Issue 31's goals: no
family recomputes more than llama-server; modeld's warm TTFT <= 0.8x llama-server's on every
family. Turn-major (each turn on every system, each after the one before is idle, the order
rotating). A turn whose request ends in a user's new instruction is sent to each system at least
:data:`READ_SECONDS` after that system's previous turn ended (the user reads the answer and
types; ``--read-seconds``): the same pause for every system, in which modeld computes the next
prefix ahead (it runs with ``--prefill-ahead``, its default, named so the report says so;
blueprint 0010) and
llama-server does nothing. Timing is
recorded, never asserted; errors fail the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.agent_apis import (
    DESCRIPTION_LIMIT,
    Step,
    _claude_call,
    _descriptions,
    _fixture,
    server_log_counts,
    shorten,
    steps,
)
from bench.families_report import exactness_lines, families_lines
from bench.systems.base import Unsupported, settle
from bench.systems.llama_server import CACHE_REUSE, LlamaServerSystem
from bench.systems.modeld_http import ModeldHttpSystem
from bench.workloads import Workload

__all__ = [
    "FAMILY_TURNS",
    "QUICK_FAMILIES",
    "FamilyRecord",
    "bodies",
    "run_families",
    "run_family",
]

SYSTEMS = ("modeld", "llama-server", "llama-server-reuse")
# llama-server at its default (no ``--cache-reuse``): the goal's baseline, exact as modeld is;
# ``-reuse``: with ``--cache-reuse 256``, which shifts the KV of a chunk after a template's
# re-render into new positions (fewer tokens, not what a fresh prefill computes: blueprint 0010)
REUSE = {"llama-server": 0, "llama-server-reuse": CACHE_REUSE}
MODEL = "bench"  # the name modeld-http registers the model under; llama-server takes any name
FAMILY_TURNS = 5  # the first request, then four turns of a call and its result
QUICK_TURNS = 3
READ_SECONDS = 10.0
"""The least time between a system's answer and its next request that ends in a user's new
instruction: a person reading an answer and typing the next one takes longer (``--read-seconds``;
the quick run: 0)."""
# TTFT and the prompt tokens are the figures, and the scripted turns drop every answer: a longer
# decode would only lengthen the run (on 2 shared cores, 32 tokens took ~45 s a turn under load).
MAX_TOKENS = 8
QUICK_FAMILIES = ("qwen3", "gpt-oss", "llama3.3")
SYSTEM_CHARS = 2000
TOOLS = ("Read", "Bash", "Edit")

Body = dict[str, Any]
Log = Callable[[str], None]


# --- the conversation ------------------------------------------------------------------------------


def tools() -> list[Body]:
    """Claude Code's Read, Bash and Edit tools as OpenAI functions, descriptions shortened."""
    first = _fixture("claude_messages_first.json")
    out = []
    for tool in first["tools"]:
        if tool["name"] in TOOLS:
            function = {
                "name": tool["name"],
                "description": shorten(tool["description"], DESCRIPTION_LIMIT),
                "parameters": _descriptions(tool["input_schema"], DESCRIPTION_LIMIT),
            }
            out.append({"type": "function", "function": function})
    return out


def system_prompt() -> str:
    first = _fixture("claude_messages_first.json")
    return shorten("\n\n".join(block["text"] for block in first["system"]), SYSTEM_CHARS)


def _call(step: Step, k: int) -> Body:
    use = _claude_call(step, k)
    return {
        "id": f"call{k:05d}",  # 9 alphanumerics: Mistral's template refuses any other id
        "type": "function",
        "function": {"name": use["name"], "arguments": json.dumps(use["input"])},
    }


def messages(with_tools: bool, turns: int) -> list[list[Body]]:
    """The conversation of every turn (module docstring)."""
    from bench.agent_apis import ASKS

    history: list[Body] = [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": ASKS[0]},
    ]
    out = [list(history)]
    for k, step in enumerate(steps(turns - 1), start=1):
        if with_tools:
            call = _call(step, k)
            history += [
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": f"{step.say} Then I can answer: {step.ask}",
                    "tool_calls": [call],
                },
                {"role": "tool", "tool_call_id": call["id"], "content": step.result},
            ]
            if k % 2 == 0:
                history += [
                    {"role": "assistant", "content": f"Done: {step.say}"},
                    {"role": "user", "content": step.ask},
                ]
        else:
            history += [
                {"role": "assistant", "content": f"{step.say} Please run `{step.command}`."},
                {"role": "user", "content": f"Output of `{step.command}`:\n{step.result}\n{step.ask}"},
            ]
        out.append(list(history))
    return out


def bodies(family_name: str, turns: int, max_tokens: int) -> list[Body]:
    """The request bodies of one family's loop, turn by turn (the same for both systems)."""
    from modeld.testmodels.families import family

    fam = family(family_name)
    out = []
    for conversation in messages(fam.tools, turns):
        body: Body = {
            "model": MODEL,
            "messages": conversation,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": f"bench-{fam.name}",
        }
        if fam.tools:
            body["tools"] = tools()
        out.append(body)
    return out


# --- one request -----------------------------------------------------------------------------------


@dataclass
class FamilyRecord:
    family: str
    system: str
    turn: int
    ttft_s: float  # to the first chunk carrying generated content
    first_chunk_s: float  # to the first chunk of any kind
    total_s: float
    bytes_sent: int
    prompt_tokens: int | None
    computed_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    prompt_ms: float | None  # the server's own prefill time (timings.prompt_ms)
    counted_by: str = "usage"  # usage, timings, server log
    first_event: str = ""
    error: str = ""


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _has_content(chunk: Body) -> str:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning", "tool_calls"):
            if delta.get(key):
                return key
    return ""


def send(http: httpx.Client, family_name: str, system: str, turn: int, body: Body) -> FamilyRecord:
    """POST one turn streamed; its record (counts from the usage and timings the stream carries)."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    usage: Body = {}
    timings: Body = {}
    first = first_chunk = 0.0
    event = failed = ""
    started = time.perf_counter()
    with http.stream(
        "POST", "/v1/chat/completions", content=data, headers={"content-type": "application/json"}
    ) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"{system}: HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:  # after the prefill (an output parser's refusal): recorded, not raised
                failed = f"stream error: {json.dumps(chunk['error'])[:400]}"
                break
            now = time.perf_counter()
            first_chunk = first_chunk or now
            if not first and (kind := _has_content(chunk)):
                first, event = now, kind
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
            if isinstance(chunk.get("timings"), dict):
                timings = chunk["timings"]
    done = time.perf_counter()
    prompt = _int(usage.get("prompt_tokens"))
    cached = _int((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    computed = None if prompt is None else prompt - (cached or 0)
    counted_by = "usage" if computed is not None else ""
    if system.startswith("llama-server") and "prompt_n" in timings:  # its own count of what it evaluated
        computed, counted_by = int(timings["prompt_n"]), "timings"
    return FamilyRecord(
        family_name,
        system,
        turn,
        (first or done) - started,
        (first_chunk or done) - started,
        done - started,
        len(data),
        prompt,
        computed,
        cached,
        _int(usage.get("completion_tokens")),
        float(timings["prompt_ms"]) if isinstance(timings.get("prompt_ms"), int | float) else None,
        counted_by,
        event or "none (no content: to the stream's end)",
        failed,
    )


PROMPT_MS = re.compile(r"prompt eval time =\s*([\d.]+) ms /")


def _from_log(record: FamilyRecord, log: Path, offset: int) -> None:
    """Counts and its prefill time from llama-server's log where its stream had none (it ended
    in an error)."""
    deadline = time.monotonic() + 5.0
    while True:
        with log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
            counts = server_log_counts(text)
        if counts or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if record.prompt_ms is None and len(times := PROMPT_MS.findall(text)) == 1:
        record.prompt_ms = float(times[0])
    if len(counts) == 1:
        record.computed_tokens, record.prompt_tokens = counts[0]
        record.cached_tokens = record.prompt_tokens - record.computed_tokens
        record.counted_by = "server log"


# --- the loops -------------------------------------------------------------------------------------


def _n_ctx(longest: Body, count: Callable[[str], int], turns: int, max_tokens: int) -> int:
    tokens = count(json.dumps(longest, ensure_ascii=False))
    return ((tokens + turns * (max_tokens + 32) + 512) // 1024 + 1) * 1024


def _line(r: FamilyRecord) -> str:
    return (
        f"  {r.family:<14} turn {r.turn}  {r.system:<12} TTFT {r.ttft_s * 1000:8.1f} ms  computed "
        f"{r.computed_tokens!s:>5} / {r.prompt_tokens!s:>5}  ({r.first_event})"
    )


def run_family(
    family_name: str,
    model: str,
    llama_server: str,
    threads: int,
    turns: int,
    max_tokens: int,
    count: Callable[[str], int],
    *,
    systems: list[str] | None = None,
    read_seconds: float = 0.0,
    log: Log = print,
) -> dict[str, Any]:
    """One family's loop on both systems (started afresh, stopped after); ``read_seconds``: the
    least time between a system's answer and its next request that ends in a user's message."""
    notes: list[str] = []
    requests = bodies(family_name, turns, max_tokens)
    n_ctx = _n_ctx(requests[-1], count, turns, max_tokens)
    load = Workload(
        f"families_{family_name}",
        family_name,
        "",
        "",
        [],
        n_ctx=n_ctx,
        llama_server_flags=("--jinja",),
        llama_server_why="the model's own chat template (llama-server's default, stated)",
    )
    running: dict[str, Any] = {}
    for name in SYSTEMS:
        if name not in (systems or SYSTEMS):
            notes.append(f"{name} skipped: not among the selected systems")
            continue
        try:
            running[name] = (
                ModeldHttpSystem(model, load, threads, ("--prefill-ahead",))
                if name == "modeld"
                else LlamaServerSystem(llama_server, model, load, threads, cache_reuse=REUSE[name])
            )
        except Unsupported as e:
            notes.append(f"{name} skipped: {e}")
    settings = {name: system.settings for name, system in running.items()}
    records: list[FamilyRecord] = []
    errors = 0
    previous: Any = None
    answered: dict[str, float] = {}  # system -> when its last turn ended (monotonic)
    try:
        for k in range(turns):
            order = [s for s in SYSTEMS if s in running]
            for name in order[k % len(order) :] + order[: k % len(order)]:  # each system first in turn
                system = running[name]
                if previous is not None:
                    settle(previous.pids())
                previous = system
                if k and requests[k]["messages"][-1]["role"] == "user" and name in answered:
                    time.sleep(max(0.0, answered[name] + read_seconds - time.monotonic()))
                log_path: Path = system.log_path
                offset = log_path.stat().st_size
                try:
                    record = send(system.http, family_name, name, k, requests[k])
                except Exception as e:  # recorded; the system sits out the rest of the loop
                    errors += 1
                    notes.append(f"{name} failed at turn {k}: {str(e)[:300]}")
                    log(f"  {family_name:<14} turn {k}  {name:<12} failed: {e}")
                    record = FamilyRecord(
                        family_name,
                        name,
                        k,
                        0.0,
                        0.0,
                        0.0,
                        0,
                        None,
                        None,
                        None,
                        None,
                        None,
                        "",
                        "",
                        str(e)[:500],
                    )
                    if name.startswith("llama-server"):
                        _from_log(record, log_path, offset)
                    records.append(record)
                    running.pop(name).close()
                    previous = None
                    continue
                answered[name] = time.monotonic()
                if record.computed_tokens is None and name.startswith("llama-server"):
                    _from_log(record, log_path, offset)
                if record.error:  # the turn's prefill counts; its TTFT is not compared
                    if name == "modeld":
                        errors += 1
                    notes.append(f"{name}, turn {k}: {record.error}")
                records.append(record)
                log(_line(record) + (f"  {record.error[:200]}" if record.error else ""))
    finally:
        for system in running.values():
            system.close()
    return {
        "family": family_name,
        "read_seconds": read_seconds,
        "tools": len(requests[0].get("tools", [])),
        "n_ctx": n_ctx,
        "settings": settings,
        "notes": notes,
        "records": [asdict(r) for r in records],
        "errors": errors,
    }


def _counter(tokenize: Callable[[str], list[int]]) -> Callable[[str], int]:
    return lambda text: len(tokenize(text))


def run_families(
    llama_server: str,
    threads: int,
    *,
    quick: bool = False,
    names: list[str] | None = None,
    turns: int | None = None,
    max_tokens: int = MAX_TOKENS,
    keep_models: bool = False,
    systems: list[str] | None = None,
    omp_default: bool = False,
    read_seconds: float | None = None,
    log: Log = print,
    progress: Callable[[dict[str, Any]], object] | None = None,
) -> dict[str, Any]:
    """Every family's loop; the document ``make bench`` stores as the run's ``families``
    (``progress``: called with the document so far after each family)."""
    from bench.direct import vocab_tokenizer
    from modeld import testmodels
    from modeld.testmodels.families import FAMILIES, ensure_family_model

    if not omp_default:  # equal spin: importing it sets modeld's (its worker's) unless one is set
        import modeld.backends._omp  # noqa: F401
    spin = os.environ.get("GOMP_SPINCOUNT") or "llama-server: libgomp's default; modeld's worker: its own"
    turns = turns or (QUICK_TURNS if quick else FAMILY_TURNS)
    read = (0.0 if quick else READ_SECONDS) if read_seconds is None else read_seconds
    chosen = names or (list(QUICK_FAMILIES) if quick else [f.name for f in FAMILIES])
    base = testmodels.REPLY if quick else testmodels.REALISTIC
    started = time.time()
    out: dict[str, Any] = {}
    for name in chosen:
        log(f"bench: {name}'s agent loop over /v1/chat/completions, {turns} turns ({base.name} model)")
        made = time.monotonic()
        path = ensure_family_model(name, base=base)
        made_s = time.monotonic() - made
        try:
            tokenize = vocab_tokenizer(str(path))
            out[name] = run_family(
                name,
                str(path),
                llama_server,
                threads,
                turns,
                max_tokens,
                _counter(tokenize),
                systems=systems,
                read_seconds=read,
                log=log,
            )
        except Exception as e:  # the family's error, recorded; the others go on
            log(f"  {name} failed: {e}")
            out[name] = {"family": name, "records": [], "notes": [f"failed: {str(e)[:500]}"], "errors": 1}
        finally:
            if not quick and not keep_models:
                path.unlink(missing_ok=True)
        out[name]["model_file"] = path.name
        out[name]["model_made_s"] = round(made_s, 1)
        out[name]["load_average"] = os.getloadavg()
        if progress is not None:
            progress(_document(base.name, turns, max_tokens, started, out, spin))
    return _document(base.name, turns, max_tokens, started, out, spin)


def _document(
    model: str, turns: int, max_tokens: int, started: float, out: dict[str, Any], spin: str
) -> dict[str, Any]:
    return {
        "model": model,
        "gomp_spincount": spin,
        "turns": turns,
        "max_tokens": max_tokens,
        "system_chars": SYSTEM_CHARS,
        "load_average": os.getloadavg(),
        "duration_s": round(time.time() - started, 1),
        "families": dict(out),
        "errors": sum(int(v["errors"]) for v in out.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"tiny family models, {', '.join(QUICK_FAMILIES)}"
    )
    parser.add_argument(
        "--llama-server", default="", help="the llama-server binary (scripts/build_llama_server.sh)"
    )
    parser.add_argument("--family", default="", help="comma-separated families (default: all; quick: a few)")
    parser.add_argument("--turns", type=int, default=0, help=f"turns per loop (default {FAMILY_TURNS})")
    parser.add_argument("--keep-models", action="store_true", help="keep the realistic family copies cached")
    parser.add_argument(
        "--read-seconds",
        type=float,
        default=None,
        help=f"least seconds between an answer and a user's next instruction (default {READ_SECONDS:g}; quick: 0)",
    )
    parser.add_argument(
        "--omp-default",
        action="store_true",
        help="llama-server with libgomp's default spin (default: modeld's worker's GOMP_SPINCOUNT for both)",
    )
    parser.add_argument(
        "--systems", default="", help=f"comma-separated systems (default: {','.join(SYSTEMS)})"
    )
    parser.add_argument("--out", type=Path, help="directory for report.md and run-<id>.json")
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        help="only rewrite report.md from run-<id>.json files (their families together, in order)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop cleanly: every server closed
    if args.report:
        docs = [json.loads(path.read_text()) for path in args.report]
        run_id = " + ".join(d["id"] for d in docs)
        write_report(args.report[0].parent, run_id, merge_runs([d["families"] for d in docs]), run_json=False)
        return 0
    started = time.time()
    run_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    out = (
        args.out or Path(__file__).resolve().parent / "results" / ("quick" if args.quick else "") / "families"
    )
    result = run_families(
        args.llama_server,
        len(os.sched_getaffinity(0)),
        quick=args.quick,
        names=[n for n in args.family.split(",") if n] or None,
        turns=args.turns or None,
        keep_models=args.keep_models,
        systems=[n for n in args.systems.split(",") if n] or None,
        omp_default=args.omp_default,
        read_seconds=args.read_seconds,
        log=lambda s: print(s, flush=True),
        progress=partial(write_report, out, run_id),  # the families so far, kept if the run is stopped
    )
    print(write_report(out, run_id, result))
    print(f"bench: wrote {out} in {result['duration_s']} s", flush=True)
    return 1 if result["errors"] else 0


def merge_runs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs as one document: every family's loop (the last run's, where several ran it; all of
    them under ``repeats``, for the spread over runs), the settings of the first run, the load at
    each run's end, the errors summed."""
    merged = dict(results[0])
    merged["families"] = {name: loop for r in results for name, loop in r["families"].items()}
    merged["repeats"] = {}
    for r in results:
        for name, loop in r["families"].items():
            merged["repeats"].setdefault(name, []).append(loop)
    merged["errors"] = sum(int(r["errors"]) for r in results)
    merged["duration_s"] = sum(float(r["duration_s"]) for r in results)
    merged["runs"] = [{"load_average": r["load_average"], "duration_s": r["duration_s"]} for r in results]
    return merged


def write_report(out: Path, run_id: str, result: dict[str, Any], *, run_json: bool = True) -> str:
    """``report.md`` and (``run_json``) ``run-<id>.json`` in ``out``; the report's text."""
    out.mkdir(parents=True, exist_ok=True)
    if run_json:
        (out / f"run-{run_id}.json").write_text(json.dumps({"id": run_id, "families": result}, indent=1))
    exact = out / "exactness.jsonl"  # bench/families_exactness.py --out: warm against fresh
    rows = [json.loads(line) for line in exact.read_text().splitlines() if line] if exact.is_file() else []
    report = "\n".join(
        [f"# modeld benchmark: families (run {run_id})", "", *families_lines(result), *exactness_lines(rows)]
    )
    (out / "report.md").write_text(report)
    return report


if __name__ == "__main__":
    sys.exit(main())
