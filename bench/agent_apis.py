"""``python -m bench.agent_apis``: coding-agent loops over the agent APIs, modeld against llama-server.

Two loops, each played on modeld (``modeld serve --http``) and on llama-server (llama.cpp's own
server, built from the engine's llama.cpp commit), on the same prompts, turn by turn:

* **messages**: Anthropic's Messages API (``POST /v1/messages``), what Claude Code speaks. The
  first request is Claude Code's own (``tests/fixtures/agents/claude_messages_first.json``: three
  system blocks, twelve tools with JSON schemas, a first user message with its reminders and a
  ``role: system`` environment message), with ``metadata.user_id`` holding Claude Code's session
  (modeld's conversation key). Every later turn appends, as Claude Code does after a tool call,
  an assistant message (a sentence and a ``tool_use``) and a user message (the ``tool_result``
  and a new instruction, ``cache_control`` on its last block). The API is stateless: both
  systems get the whole conversation every turn, in byte-identical bodies. The assistant
  messages are scripted (what each system generated is dropped), so the bodies stay identical.
* **responses**: OpenAI's Responses API (``POST /v1/responses``), what Codex CLI speaks. The
  first request is Codex's (``codex_responses_first.json``: the developer messages, the
  environment and the prompt as ``input`` items, Codex's function tools). Every later turn adds
  three items: a ``function_call`` (``exec_command``), its ``function_call_output`` and a new
  user message. modeld's client sends only those with ``previous_response_id`` (the stored
  response continues on its warm session); llama-server refuses ``previous_response_id``, so its
  client resends everything, echoing the output items of each earlier answer, as Codex does
  with ``store: false``. Both conversations thus hold each system's own answers; the bodies are
  otherwise the same (``store: true`` in both, which llama-server ignores).

Both loops: greedy (``temperature: 0``), a fixed small output (``max_tokens`` /
``max_output_tokens``: 32 tokens, 8 with ``--quick``), streamed. Per turn and system it records:

* **TTFT**, client-observed: from sending the request to the first stream event that carries
  generated content (``text_delta`` / ``input_json_delta`` / ``thinking_delta``;
  ``response.output_text.delta`` / ``function_call_arguments.delta`` / reasoning deltas); when an
  answer has no content, to its final event (the record says so);
* **prompt tokens computed**: modeld's usage (Messages: ``input_tokens +
  cache_creation_input_tokens``; Responses: ``input_tokens - cached_tokens``), llama-server's
  ``timings.prompt_n`` where its stream carries it (Responses) and its usage otherwise (Messages:
  ``input_tokens``, which it reports as prompt minus cache). llama-server sends its Messages
  stream's ``message_start`` (the one event with prompt usage) with the first token's partial
  result, and withholds that result when the token ends in an incomplete UTF-8 sequence: the
  stream then has no ``message_start`` at all, and the counts come from llama-server's log
  (``prompt eval time = ... / N tokens``; the record says ``counted_by: server log``);
* **bytes sent**: the request body as sent (compact JSON, UTF-8).

To keep a full run within its budget on two cores, the fixtures are trimmed by default: every
``description`` in the tool schemas to ``DESCRIPTION_LIMIT`` characters and every text block to
``TEXT_LIMIT`` (cut at a line or sentence end), which leaves every tool, every schema and every
message, about 8-9k tokens of the generated vocabulary instead of 17-21k. ``--whole`` sends the
captured requests as they are. Two client-side adjustments keep the prompts the same on both
servers: Codex's ``namespace`` tool is flattened into its functions (llama-server skips tools
whose type is not ``function``; modeld flattens a namespace itself), and ``store`` is true.

Turn-major, as ``bench/runner.py``: each turn runs on both systems back to back, the second
started after the first is idle (``settle``), the starting system alternating. Every loop starts
both servers afresh (their settings are those of ``bench/systems``: ``-np 1 --kv-unified
--cache-ram --cache-reuse 256``, flash attention off, ``--no-repack`` on AMX CPUs; modeld with
``--num-ctx`` the same window). Without a llama-server binary (``make bench-quick``) its side is
skipped with a note. Timing is printed and recorded, never asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import sys
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

__all__ = [
    "LOOPS",
    "SYSTEMS",
    "Record",
    "ResponsesClient",
    "messages_bodies",
    "responses_first",
    "responses_new_items",
    "run_agent_apis",
    "server_log_counts",
]

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "agents"
SYSTEMS = ("modeld", "llama-server")
LOOPS = {
    "messages": ("/v1/messages", "claude_messages_first.json"),
    "responses": ("/v1/responses", "codex_responses_first.json"),
}
MODEL = "bench"  # the name modeld-http registers the model under; llama-server takes any name
TURNS = 7  # the first request, then six turns of a tool call, its result and an instruction
QUICK_TURNS = 3
DESCRIPTION_LIMIT = 200
TEXT_LIMIT = 4000
WORKDIR = "/home/dev/shop"  # replaces the fixtures' <WORKDIR> placeholder
PLACEHOLDERS = {
    "<WORKDIR_SLUG>": WORKDIR.replace("/", "-"),
    "<WORKDIR>": WORKDIR,
    "<AGENTS_CACHE>": "/home/dev/.cache/agents",
}

Log = Callable[[str], None]
Body = dict[str, Any]


# --- the prompts ---------------------------------------------------------------------------------


def _fixture(name: str) -> Body:
    text = (FIXTURES / name).read_text()
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    body: Body = json.loads(text)["body"]
    return body


def shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at a line or sentence end when one is in
    the second half."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    for sep in ("\n", ". "):
        at = cut.rfind(sep)
        if at > limit // 2:
            return cut[: at + len(sep)].rstrip()
    return cut


def _descriptions(value: Any, limit: int) -> Any:
    """Every ``description`` string in a schema tree shortened (a property *named* description,
    whose value is a schema, is walked like any other)."""
    if isinstance(value, dict):
        return {
            k: shorten(v, limit) if k == "description" and isinstance(v, str) else _descriptions(v, limit)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_descriptions(v, limit) for v in value]
    return value


def _texts(content: Any, limit: int) -> Any:
    if isinstance(content, str):
        return shorten(content, limit)
    return [
        {**part, "text": shorten(part["text"], limit)} if isinstance(part.get("text"), str) else part
        for part in content
    ]


@dataclass(frozen=True)
class Step:
    """One scripted agent step: what the agent says, the tool call, its result, the next ask."""

    kind: str  # read, test, grep, edit
    path: str
    command: str
    say: str
    result: str
    ask: str


WORDS = (
    "cart order invoice stock price coupon refund session cache token payment ledger basket "
    "customer address shipment tax discount catalog review rating"
).split()
ASKS = (
    "The refund total is wrong when a coupon was applied. Find where it is computed.",
    "Now check how the tax is rounded for each line of the invoice.",
    "Run the tests for the invoice module and tell me what fails.",
    "Fix the rounding so the refund matches the charged amount, with a test.",
    "Look for other callers of the helper you changed.",
    "Update the changelog entry for this fix.",
    "Check that the basket total still matches after the change.",
    "Run the whole test suite once more.",
)


def _name(rng: random.Random) -> str:
    return "_".join(rng.sample(WORDS, 2))


def _source(rng: random.Random, lines: int) -> list[str]:
    out = ['"""Totals for the shop\'s orders."""', "", "from decimal import ROUND_HALF_UP, Decimal", ""]
    while len(out) < lines:
        name, arg = _name(rng), rng.choice(WORDS)
        out += [
            "",
            f"def {name}({arg}: list[Decimal], rate: Decimal = Decimal('0.{rng.randint(10, 99)}')) -> Decimal:",
            f'    """The {rng.choice(WORDS)} total of {arg}, rounded to cents."""',
            f"    total = sum(({arg}_item * rate for {arg}_item in {arg}), Decimal(0))",
            "    return total.quantize(Decimal('0.01'), rounding=ROUND_HALF_UP)",
        ]
    return out[:lines]


def steps(n: int, seed: int = 23) -> list[Step]:
    """``n`` deterministic agent steps (a file read, a test run, a search, an edit, ...), their
    results 6-20 lines long."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = ("read", "test", "grep", "edit")[i % 4]
        path = f"shop/{rng.choice(WORDS)}/{_name(rng)}.py"
        if kind == "read":
            lines = _source(rng, rng.randint(12, 20))
            result = "".join(f"{k + 1}\t{line}\n" for k, line in enumerate(lines))
            command, say = f"sed -n '1,{len(lines)}p' {path}", f"Let me read {path}."
        elif kind == "test":
            test = f"tests/test_{_name(rng)}.py"
            rows = [
                f"{test}::test_{_name(rng)} {rng.choice(['PASSED', 'PASSED', 'FAILED'])}" for _ in range(8)
            ]
            failed = sum(r.endswith("FAILED") for r in rows)
            result = (
                "============================= test session starts ==============================\n"
                + "\n".join(rows)
                + f"\nE       AssertionError: assert Decimal('{rng.randint(10, 99)}.{rng.randint(10, 99)}') == "
                f"Decimal('{rng.randint(10, 99)}.{rng.randint(10, 99)}')\n"
                + f"========================= {failed} failed, {8 - failed} passed in 0.{rng.randint(10, 99)}s =========================\n"
            )
            command, say = f"python -m pytest -q {test}", f"I'll run {test}."
        elif kind == "grep":
            symbol = _name(rng)
            hits = [
                f"shop/{rng.choice(WORDS)}/{_name(rng)}.py:{rng.randint(3, 300)}:    total = {symbol}(items, rate)"
                for _ in range(rng.randint(5, 9))
            ]
            result = "\n".join(hits) + "\n"
            command, say = f"grep -rn '{symbol}(' shop", f"Searching for the callers of {symbol}."
        else:
            lines = _source(rng, rng.randint(6, 10))
            start = rng.randint(20, 120)
            result = (
                f"The file {WORKDIR}/{path} has been updated. Here's the result of running `cat -n` on a "
                "snippet of the edited file:\n"
                + "".join(f"{start + k}\t{line}\n" for k, line in enumerate(lines))
            )
            command, say = f"apply_patch {path}", f"I'll fix the rounding in {path}."
        out.append(Step(kind, path, command, say, result, ASKS[i % len(ASKS)]))
    return out


def _claude_call(step: Step, k: int) -> dict[str, Any]:
    tool_id = f"toolu_bench{k:02d}"
    if step.kind == "read":
        call = {"name": "Read", "input": {"file_path": f"{WORKDIR}/{step.path}"}}
    elif step.kind == "edit":
        call = {
            "name": "Edit",
            "input": {
                "file_path": f"{WORKDIR}/{step.path}",
                "old_string": "rounding=ROUND_HALF_UP)",
                "new_string": "rounding=ROUND_HALF_EVEN)",
            },
        }
    else:
        call = {"name": "Bash", "input": {"command": step.command, "description": step.say}}
    return {"type": "tool_use", "id": tool_id, **call}


def messages_bodies(turns: int, max_tokens: int, *, whole: bool = False) -> list[Body]:
    """The Messages loop's request bodies, turn by turn (the same for both systems)."""
    first = _fixture(LOOPS["messages"][1])
    if not whole:
        first["tools"] = _descriptions(first["tools"], DESCRIPTION_LIMIT)
        first["system"] = _texts(first["system"], TEXT_LIMIT)
        first["messages"] = [{**m, "content": _texts(m["content"], TEXT_LIMIT)} for m in first["messages"]]
    first.update(model=MODEL, max_tokens=max_tokens, stream=True, temperature=0)
    bodies = [first]
    messages = copy.deepcopy(first["messages"])
    for k, step in enumerate(steps(turns - 1), start=1):
        # Claude Code sends its environment message as a plain string after the first request,
        # and keeps cache_control only on the last block of the last message.
        for m in messages:
            if m["role"] == "system" and isinstance(m["content"], list):
                m["content"] = "".join(part["text"] for part in m["content"])
            elif isinstance(m["content"], list):
                for part in m["content"]:
                    part.pop("cache_control", None)
        call = _claude_call(step, k)
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": step.say}, call]},
            {
                "role": "user",
                "content": [
                    {"tool_use_id": call["id"], "type": "tool_result", "content": step.result},
                    {"type": "text", "text": step.ask, "cache_control": {"type": "ephemeral"}},
                ],
            },
        ]
        bodies.append({**first, "messages": copy.deepcopy(messages)})
    return bodies


def _flat_tools(tools: list[Body]) -> list[Body]:
    """Function tools, a namespace's functions in its place, hosted tools left out."""
    out = []
    for tool in tools:
        if tool.get("type") == "namespace":
            out += _flat_tools(tool.get("tools", []))
        elif tool.get("type") == "function":
            out.append(tool)
    return out


def responses_first(max_tokens: int, *, whole: bool = False) -> Body:
    """The Responses loop's first request (both systems)."""
    first = _fixture(LOOPS["responses"][1])
    first["tools"] = _flat_tools(first["tools"])
    if not whole:
        first["tools"] = _descriptions(first["tools"], DESCRIPTION_LIMIT)
        first["input"] = [{**m, "content": _texts(m["content"], TEXT_LIMIT)} for m in first["input"]]
    first.update(model=MODEL, store=True, max_output_tokens=max_tokens, temperature=0)
    return first


def responses_new_items(turns: int) -> list[list[Body]]:
    """The items each later turn adds: the agent's call, its output, the next instruction."""
    out = []
    for k, step in enumerate(steps(turns - 1), start=1):
        call_id = f"call_bench{k:02d}"
        body = step.result.encode()
        output = (
            f"Chunk ID: {k:06x}\nWall time: 0.{k:04d} seconds\nProcess exited with code 0\n"
            f"Original token count: {len(body) // 4}\nOutput:\n{step.result}"
        )
        items: list[Body] = [
            {
                "type": "function_call",
                "name": "exec_command",
                "arguments": json.dumps({"cmd": step.command, "workdir": WORKDIR}),
                "call_id": call_id,
            },
            {"type": "function_call_output", "call_id": call_id, "output": output},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": step.ask}]},
        ]
        out.append(items)
    return out


# --- one request -----------------------------------------------------------------------------------


@dataclass
class Record:
    loop: str
    system: str
    turn: int
    ttft_s: float
    total_s: float
    bytes_sent: int
    prompt_tokens: int | None  # the prompt as the system counted it
    computed_tokens: int | None  # prompt tokens computed this turn
    cached_tokens: int | None  # reused (prompt - computed)
    output_tokens: int | None
    text: str  # the answer's text (the Responses loop's conversations hold it)
    first_event: str  # what ended the TTFT clock
    response_id: str = ""
    counted_by: str = "usage"  # where computed_tokens came from: usage, timings, server log
    error: str = ""
    recomputed: int | None = None  # modeld: its daemon's count of tokens computed again this turn


CONTENT = {
    "content_block_delta",  # Messages: text_delta, input_json_delta, thinking_delta
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
}


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def send(http: httpx.Client, loop: str, system: str, turn: int, body: Body) -> tuple[Record, list[Body]]:
    """POST ``body`` streamed; the record and (Responses) the answer's output items."""
    path = LOOPS[loop][0]
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    usage: dict[str, Any] = {}
    final: Body = {}
    timings: Body = {}
    text: list[str] = []
    first, event = 0.0, ""
    started = time.perf_counter()
    with http.stream("POST", path, content=data, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"{system} {path}: HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            payload = json.loads(line[5:])
            kind = payload.get("type", "")
            if kind in ("error", "response.failed"):
                raise RuntimeError(f"{system} {path}: stream error: {json.dumps(payload)[:500]}")
            if kind in CONTENT and not first:
                first, event = time.perf_counter(), kind
            if kind == "content_block_delta" and payload["delta"].get("type") == "text_delta":
                text.append(payload["delta"]["text"])
            elif kind == "response.output_text.delta":
                text.append(payload["delta"])
            elif kind == "message_start":
                usage.update(payload["message"].get("usage") or {})
            elif kind == "message_delta":
                usage.update(payload.get("usage") or {})
            elif kind in ("response.completed", "response.incomplete"):
                final = payload["response"]
                usage = final.get("usage") or {}
            if isinstance(payload.get("timings"), dict):
                timings = payload["timings"]
            if kind in ("message_stop", "response.completed", "response.incomplete") and not first:
                first, event = time.perf_counter(), f"{kind} (no content)"
    done = time.perf_counter()
    if loop == "messages":
        computed = _int(usage.get("input_tokens"))
        if computed is not None:
            computed += _int(usage.get("cache_creation_input_tokens")) or 0
        cached = _int(usage.get("cache_read_input_tokens"))
        prompt = None if computed is None else computed + (cached or 0)
    else:
        prompt = _int(usage.get("input_tokens"))
        cached = _int((usage.get("input_tokens_details") or {}).get("cached_tokens"))
        computed = None if prompt is None else prompt - (cached or 0)
    counted_by = "usage" if computed is not None else ""
    if "prompt_n" in timings:  # llama-server's own count of the prompt tokens it evaluated
        computed, counted_by = int(timings["prompt_n"]), "timings"
    record = Record(
        loop,
        system,
        turn,
        first - started if first else done - started,
        done - started,
        len(data),
        prompt,
        computed,
        cached,
        _int(usage.get("output_tokens")),
        "".join(text),
        event or "none",
        str(final.get("id", "")),
        counted_by,
    )
    return record, list(final.get("output") or [])


PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")
EVAL = re.compile(r"\|\s+eval time =\s*[\d.]+ ms /\s*(\d+) tokens")
RELEASE = re.compile(r"stop processing: n_tokens = (\d+)")


def server_log_counts(text: str) -> list[tuple[int, int]]:
    """(prompt tokens evaluated, prompt tokens) of every request llama-server finished in this
    stretch of its log: ``prompt eval time = ... / N tokens``, and the prompt from the slot's size
    at release (``n_tokens`` = prompt + generated - 1, the last token never evaluated) minus the
    generated tokens (``eval time = ... / G tokens``)."""
    out = []
    evaluated = generated = None
    for line in text.splitlines():
        if m := PROMPT_EVAL.search(line):
            evaluated = int(m.group(1))
        elif m := EVAL.search(line):
            generated = int(m.group(1))
        elif (m := RELEASE.search(line)) and evaluated is not None and generated is not None:
            out.append((evaluated, int(m.group(1)) - generated + 1))
            evaluated = generated = None
    return out


def _from_log(record: Record, log: Path, offset: int) -> None:
    """Fill in a record whose stream had no prompt usage from llama-server's log (its Messages
    stream sends ``message_start``, the only event with prompt usage, with the first token's
    partial result, which it skips when that token ends in an incomplete UTF-8 sequence)."""
    deadline = time.monotonic() + 5.0
    while True:
        with log.open("rb") as f:
            f.seek(offset)
            counts = server_log_counts(f.read().decode(errors="replace"))
        if counts or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if len(counts) == 1:
        record.computed_tokens, record.prompt_tokens = counts[0]
        record.cached_tokens = record.prompt_tokens - record.computed_tokens
        record.counted_by = "server log"


# --- the loops -------------------------------------------------------------------------------------


class ResponsesClient:
    """What one system's client sends in the Responses loop: only the new items after the stored
    response (``previous_response_id``), or everything, each answer's output echoed back."""

    def __init__(self, first: Body, previous_id: bool) -> None:
        self.first = first
        self.previous_id = previous_id
        self.items: list[Body] = list(first["input"])
        self.last_id = ""
        self.echo: list[Body] = []

    def body(self, new: list[Body]) -> Body:
        if not new:
            return self.first
        if self.previous_id:
            return {**self.first, "input": new, "previous_response_id": self.last_id}
        self.items += self.echo + new
        return {**self.first, "input": list(self.items)}

    def answered(self, record: Record, output: list[Body]) -> None:
        self.last_id, self.echo = record.response_id, output


def _n_ctx(longest: Body, count: Callable[[str], int], turns: int, max_tokens: int) -> int:
    """A window for the longest conversation: its JSON's tokens (more than the rendered prompt:
    JSON escapes and keys) plus every answer, rounded up to 1024."""
    tokens = count(json.dumps(longest, ensure_ascii=False))
    return ((tokens + turns * (max_tokens + 32) + 512) // 1024 + 1) * 1024


def _start(
    model: str, llama_server: str, name: str, n_ctx: int, threads: int, selected: list[str], notes: list[str]
) -> dict[str, Any]:
    load = Workload(name, name, "", "", [], n_ctx=n_ctx)
    systems: dict[str, Any] = {}
    for system, make in (
        ("modeld", lambda: ModeldHttpSystem(model, load, threads)),
        ("llama-server", lambda: LlamaServerSystem(llama_server, model, load, threads)),
    ):
        if system not in selected:
            notes.append(f"{system} skipped: not among the selected systems")
            continue
        try:
            systems[system] = make()
        except Unsupported as e:
            notes.append(f"{system} skipped: {e}")
    return systems


def _line(r: Record) -> str:
    return (
        f"  {r.loop:<9} turn {r.turn}  {r.system:<12} TTFT {r.ttft_s * 1000:8.1f} ms  computed "
        f"{r.computed_tokens!s:>5} / {r.prompt_tokens!s:>5}  sent {r.bytes_sent:>6} B  ({r.first_event})"
    )


def run_loop(
    loop: str,
    model: str,
    llama_server: str,
    threads: int,
    turns: int,
    max_tokens: int,
    count: Callable[[str], int],
    *,
    whole: bool = False,
    systems: list[str] | None = None,
    log: Log = print,
) -> dict[str, Any]:
    """One loop on both systems (started afresh, stopped after): its records, settings, notes."""
    notes: list[str] = []
    if loop == "messages":
        bodies = messages_bodies(turns, max_tokens, whole=whole)
        longest = bodies[-1]
        tools = len(bodies[0]["tools"])

        def body_for(system: str, k: int) -> Body:  # the same for both systems
            return bodies[k]

    else:
        first = responses_first(max_tokens, whole=whole)
        new: list[list[Body]] = [[], *responses_new_items(turns)]
        clients = {
            "modeld": ResponsesClient(first, previous_id=True),
            "llama-server": ResponsesClient(first, previous_id=False),
        }
        longest = {**first, "input": first["input"] + [i for items in new for i in items]}
        tools = len(first["tools"])
        notes.append(
            "Codex's `namespace` tool is flattened into its functions by the client for both systems: "
            "llama-server skips tools whose type is not `function`"
        )

        def body_for(system: str, k: int) -> Body:
            return clients[system].body(new[k])

    n_ctx = _n_ctx(longest, count, turns, max_tokens)
    running = _start(
        model, llama_server, f"agent_apis_{loop}", n_ctx, threads, systems or list(SYSTEMS), notes
    )
    settings = {name: system.settings for name, system in running.items()}
    records: list[Record] = []
    errors = 0
    previous: Any = None
    try:
        for k in range(turns):
            order = [s for s in SYSTEMS if s in running]
            for name in order[::-1] if k % 2 else order:
                system = running[name]
                if previous is not None:
                    settle(previous.pids())
                previous = system
                log_path: Path | None = getattr(system, "log_path", None) if name == "llama-server" else None
                offset = log_path.stat().st_size if log_path is not None else 0
                again: Callable[[], int] | None = getattr(system, "recomputed", None)  # modeld's count
                try:
                    before = again() if again is not None else 0
                    record, output = send(system.http, loop, name, k, body_for(name, k))
                    if record.computed_tokens is None and log_path is not None:
                        _from_log(record, log_path, offset)
                    if again is not None:
                        record.recomputed = again() - before
                except Exception as e:  # recorded; the system sits out the rest of the loop
                    errors += 1
                    notes.append(f"{name} failed at turn {k}: {str(e)[:300]}")
                    log(f"  {loop:<9} turn {k}  {name:<12} failed: {e}")
                    records.append(
                        Record(loop, name, k, 0.0, 0.0, 0, None, None, None, None, "", "", error=str(e)[:500])
                    )
                    running.pop(name).close()
                    previous = None
                    continue
                if loop == "responses":
                    clients[name].answered(record, output)
                records.append(record)
                log(_line(record))
    finally:
        for system in running.values():
            system.close()
    missing = [r.turn for r in records if r.system == "llama-server" and r.counted_by in ("", "server log")]
    if missing and loop == "messages":
        notes.append(
            f"llama-server's stream had no `message_start` (the one event with prompt usage) on turn(s) "
            f"{', '.join(map(str, missing))}: it sends it with the first token's partial result, which it "
            "withholds when that token ends in an incomplete UTF-8 sequence; its counts there are from its log"
        )
    return {
        "endpoint": LOOPS[loop][0],
        "fixture": LOOPS[loop][1],
        "tools": tools,
        "n_ctx": n_ctx,
        "settings": settings,
        "notes": notes,
        "records": [asdict(r) for r in records],
        "errors": errors,
    }


def run_agent_apis(
    model: str,
    llama_server: str,
    threads: int,
    count: Callable[[str], int],
    *,
    quick: bool = False,
    max_tokens: int = 32,
    turns: int | None = None,
    whole: bool = False,
    systems: list[str] | None = None,
    log: Log = print,
) -> dict[str, Any]:
    """Both loops, and the responses loop over the Responses WebSocket on modeld
    (``bench/agent_socket.py``: bytes per turn against HTTP); the document ``make bench`` stores
    as the run's ``agent_apis``."""
    turns = turns or (QUICK_TURNS if quick else TURNS)
    loops = {}
    for loop in LOOPS:
        log(f"bench: agent loop over {LOOPS[loop][0]}, modeld and llama-server, {turns} turns")
        loops[loop] = run_loop(
            loop,
            model,
            llama_server,
            threads,
            turns,
            max_tokens,
            count,
            whole=whole,
            systems=systems,
            log=log,
        )
    socket = None
    if "modeld" in (systems or SYSTEMS):  # the same loop over the Responses WebSocket: bytes per turn
        from bench.agent_socket import run_socket_loop

        first = responses_first(max_tokens, whole=whole)
        new: list[list[Body]] = [[], *responses_new_items(turns)]
        longest = {**first, "input": first["input"] + [i for items in new for i in items]}
        log(f"bench: the responses loop over the Responses WebSocket on modeld, {turns} turns")
        socket = run_socket_loop(
            model, threads, first, new, _n_ctx(longest, count, turns, max_tokens), log=log
        )
    return {
        "turns": turns,
        "max_tokens": max_tokens,
        "whole": whole,
        "socket": socket,
        "description_limit": None if whole else DESCRIPTION_LIMIT,
        "text_limit": None if whole else TEXT_LIMIT,
        "load_average": os.getloadavg(),
        "loops": loops,
        "errors": sum(int(v["errors"]) for v in loops.values()) + int(bool(socket and socket.get("error"))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agent_apis", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 turns, 8-token answers")
    parser.add_argument(
        "--llama-server", default="", help="the llama-server binary (scripts/build_llama_server.sh)"
    )
    parser.add_argument(
        "--turns", type=int, default=0, help=f"turns per loop (default {TURNS}, quick {QUICK_TURNS})"
    )
    parser.add_argument("--whole", action="store_true", help="send the captured requests untrimmed")
    parser.add_argument(
        "--out", type=Path, help="write the run document here (default: bench/results/runs/<id>/)"
    )
    args = parser.parse_args(argv)
    from bench.direct import vocab_tokenizer
    from bench.report import agent_apis_lines
    from modeld import testmodels

    spec = testmodels.TINY if args.quick else testmodels.REALISTIC
    model = str(testmodels.ensure_model(spec))
    started = time.time()
    load_start = os.getloadavg()
    tokenize = vocab_tokenizer(model)
    result = run_agent_apis(
        model,
        args.llama_server,
        len(os.sched_getaffinity(0)),
        lambda text: len(tokenize(text)),
        quick=args.quick,
        max_tokens=8 if args.quick else 32,
        turns=args.turns or None,
        whole=args.whole,
        log=lambda s: print(s, flush=True),
    )
    out = write_extra_run(
        "agent_apis",
        (spec.name, Path(model).name),
        started,
        result,
        lambda r: agent_apis_lines(r, spec.name),
        args.out,
        quick=args.quick,
        load_start=load_start,
    )
    print(f"bench: wrote {out} in {round(time.time() - started, 1)} s", flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
