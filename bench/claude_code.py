"""``python -m bench.claude_code``: the real Claude Code, run headless three times on one task in
one repository, against modeld and against llama-server (issue 30).

Claude Code (the pinned npm package, installed and cached by ``scripts/install_agents.sh``) runs
``claude -p TASK`` in a small git repository, each run a new session, as a person repeating a
task does. Its requests go through a recording proxy in this process to the server under test
(``modeld serve --http`` at its default flags; llama-server at its own: one unified window of the
model's 32k context shared by 4 slots, ``-np 4 --kv-unified``, with its RAM prompt cache), so each
request's timing is measured where Claude Code sees it:

* **TTFT**: from the request reaching the proxy to the first content event of its stream
  (``content_block_delta``), or to its end when it has none;
* **prompt tokens computed**: the server's own usage (``input_tokens`` +
  ``cache_creation_input_tokens`` for modeld; ``input_tokens`` for llama-server, which reports
  the prompt minus its cache) and **cached** (``cache_read_input_tokens``).

The model is the generated ``reply`` model (TINY's size, a 32k window): it answers every request
briefly and ends its turn, so a run is Claude Code's first request with its whole system prompt,
tools and environment (about 16k tokens of this vocabulary), its side requests, and an answer; a
random-weight model never ends a turn, and an agent treats a cut-off answer as an error.

Runs alternate which system goes first and wait until the other is idle (``settle``). A run's
TTFT is that of its main request (the one carrying the tools: the agent's turn); the sum over
all its requests is recorded too. For modeld, each run also keeps what the daemon did for every
request (its request records: reuse outcome, reason and tier, tokens computed, the daemon's own
TTFT, prefill and restore times, and its ``recomputed`` count), so a slow run says whether
modeld restored, waited or computed, or whether the time went outside the daemon. Timing is printed and recorded, never asserted; a run that
fails (no JSON result, an API error) is an error of the workload.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
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

__all__ = ["Exchange", "Recorder", "main", "run_claude_code"]

ROOT = Path(__file__).resolve().parent.parent
TASK = "What does calc.py do?"
RUNS = 3
WINDOW = 32768
"""The reply model's context: modeld's default window for it, llama-server's default ``-c``."""
MAX_OUTPUT = 48
RUN_TIMEOUT = 900.0
SYSTEMS = ("modeld", "llama-server")
Log = Callable[[str], None]

REPO_FILES = {
    "README.md": "# calc\n\nA tiny calculator used to try coding agents.\n",
    "calc.py": '"""A tiny calculator."""\n\n\ndef add(a: int, b: int) -> int:\n    return a + b\n',
}
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "accept-encoding"}


@dataclass
class Exchange:
    """One request Claude Code sent, as the proxy saw it."""

    system: str
    run: int
    path: str
    tools: bool  # the agent's own turn (its request carries the tools)
    ttft_s: float
    total_s: float
    status: int
    prompt_tokens: int | None
    computed_tokens: int | None
    cached_tokens: int | None
    first_event: str


class Recorder(http.server.ThreadingHTTPServer):
    """A loopback proxy to ``target`` that records every exchange (``exchanges``)."""

    daemon_threads = True

    def __init__(self, target: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.target = target
        self.client = httpx.Client(base_url=target, timeout=httpx.Timeout(RUN_TIMEOUT, connect=10.0))
        self.exchanges: list[Exchange] = []
        self.system = ""
        self.run = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, name="claude-code-proxy", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.client.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the response ends when the connection closes: no framing to redo
    server: Recorder

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._forward("GET")

    def do_HEAD(self) -> None:
        self._forward("HEAD")

    def do_POST(self) -> None:
        self._forward("POST")

    def _forward(self, method: str) -> None:
        recorder = self.server
        started = time.perf_counter()
        body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else b""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        tools = False
        with contextlib.suppress(ValueError):
            tools = bool(json.loads(body or b"{}").get("tools"))
        usage: dict[str, Any] = {}
        first, event = 0.0, ""
        with recorder.client.stream(method, self.path, content=body, headers=headers) as resp:
            self.send_response(resp.status_code)
            for k, v in resp.headers.items():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.end_headers()
            pending = b""
            for chunk in resp.iter_raw():
                self.wfile.write(chunk)
                self.wfile.flush()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    with contextlib.suppress(ValueError):
                        payload = json.loads(line[5:])
                        kind = payload.get("type", "")
                        if kind == "content_block_delta" and not first:
                            first, event = time.perf_counter(), kind
                        elif kind == "message_start":
                            usage.update(payload["message"].get("usage") or {})
                        elif kind == "message_delta":
                            usage.update(payload.get("usage") or {})
            status = resp.status_code
        done = time.perf_counter()
        if not usage and pending.strip().startswith(b"{"):
            with contextlib.suppress(ValueError):
                usage = json.loads(pending).get("usage") or {}  # not streamed
        computed = usage.get("input_tokens")
        if isinstance(computed, int):
            computed += int(usage.get("cache_creation_input_tokens") or 0)
        cached = usage.get("cache_read_input_tokens")
        with recorder.lock:
            recorder.exchanges.append(
                Exchange(
                    recorder.system,
                    recorder.run,
                    self.path,
                    tools,
                    (first or done) - started,
                    done - started,
                    status,
                    computed + int(cached or 0) if isinstance(computed, int) else None,
                    computed if isinstance(computed, int) else None,
                    int(cached) if isinstance(cached, int) else None,
                    event or "end",
                )
            )


def _claude(*, cached_only: bool = False) -> Path:
    """The installed Claude Code (``scripts/install_agents.sh``: cached, or installed from npm
    unless ``cached_only``)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install_agents.sh"), *(["--cached-only"] if cached_only else [])],
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise Unsupported(f"Claude Code is not installed: {lines[-1] if lines else proc.returncode}")
    for line in proc.stdout.splitlines():
        name, _, path = line.partition("=")
        if name == "claude":
            return Path(path)
    raise Unsupported("scripts/install_agents.sh named no claude binary")


def _repo(path: Path) -> Path:
    """A small git repository (the same commit every time)."""
    path.mkdir(parents=True)
    for name, text in REPO_FILES.items():
        (path / name).write_text(text)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_AUTHOR_NAME": "bench",
        "GIT_AUTHOR_EMAIL": "bench@modeld.invalid",
        "GIT_COMMITTER_NAME": "bench",
        "GIT_COMMITTER_EMAIL": "bench@modeld.invalid",
        "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "-A"],
        ["-c", "commit.gpgsign=false", "commit", "-qm", "x"],
    ):
        subprocess.run(["git", *args], cwd=path, env=env, check=True, capture_output=True, timeout=30)
    return path


def _env(home: Path, base_url: str, model: str) -> dict[str, str]:
    """A headless Claude Code kept off the internet (no login, telemetry or update checks)."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": "bench",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT),
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
    }


def _one_run(claude: Path, repo: Path, home: Path, url: str, model: str) -> str:
    """One headless run; "" when it completed, else why not."""
    argv = [str(claude), "-p", TASK, "--output-format", "json"]
    proc = subprocess.Popen(
        argv,
        cwd=repo,
        env=_env(home, url, model),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        out, err = "", f"timed out after {RUN_TIMEOUT:.0f} s"
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, 9)
    try:
        result = json.loads(out)
    except ValueError:
        return f"no JSON result (exit {proc.returncode}): {err.strip()[-300:]}"
    if not isinstance(result, dict) or result.get("is_error"):
        return f"an error result: {json.dumps(result)[:300]}"
    return ""


def _start(name: str, model: str, llama_server: str, threads: int) -> Any:
    """Both systems at their defaults: the reply model's one window (modeld: ``--num-ctx`` its
    default, no pool flag; llama-server: ``-c`` its default, 4 slots sharing it)."""
    if name == "modeld":
        return ModeldHttpSystem(model, Workload(name, name, "", "", [], n_ctx=WINDOW), threads)
    load = Workload(name, name, "", "", [], workspaces=4, pool_tokens=WINDOW, n_ctx=WINDOW)
    return LlamaServerSystem(llama_server, model, load, threads)


def run_claude_code(
    model: str,
    llama_server: str,
    threads: int,
    *,
    runs: int = RUNS,
    systems: list[str] | None = None,
    cached_only: bool = False,
    log: Log = print,
) -> dict[str, Any]:
    """Three runs on each system; the document ``make bench`` stores as the run's ``claude_code``
    (``cached_only``: skip it, with a note, unless Claude Code is installed already)."""
    notes: list[str] = []
    try:
        claude = _claude(cached_only=cached_only)
    except Unsupported as e:
        return {"runs": runs, "notes": [str(e)], "exchanges": [], "errors": 0, "skipped": str(e)}
    tmp = Path(tempfile.mkdtemp(prefix="bcc"))
    running: dict[str, Any] = {}
    proxies: dict[str, Recorder] = {}
    for name in systems or list(SYSTEMS):
        try:
            running[name] = _start(name, model, llama_server, threads)
        except Unsupported as e:
            notes.append(f"{name} skipped: {e}")
            continue
        proxies[name] = Recorder(running[name].base_url)
    repos = {name: _repo(tmp / f"repo-{name}") for name in running}
    errors = 0
    outcome: dict[str, list[str]] = {name: [] for name in running}
    daemon: list[dict[str, Any]] = []
    previous: Any = None
    try:
        for k in range(runs):
            order = list(running)
            for name in order[::-1] if k % 2 else order:
                system, proxy = running[name], proxies[name]
                if previous is not None:
                    settle(previous.pids())
                previous = system
                proxy.system, proxy.run = name, k
                began = time.time()
                why = _one_run(
                    claude,
                    repos[name],
                    tmp / f"home-{name}",
                    proxy.url,
                    getattr(system, "model_name", "bench"),
                )
                outcome[name].append(why)
                errors += bool(why)
                for record in system.records(began) if hasattr(system, "records") else []:
                    daemon.append({"system": name, "run": k, **record})
                    log(f"    daemon: {_said(daemon[-1])}")
                mine = [e for e in proxy.exchanges if e.run == k]
                main = [e for e in mine if e.tools]
                ttft = main[0].ttft_s if main else float("nan")
                log(
                    f"  claude_code run {k}  {name:<12} TTFT {ttft * 1000:8.1f} ms (main request), "
                    f"{sum(e.ttft_s for e in mine) * 1000:8.1f} ms over {len(mine)} requests"
                    + (f"  FAILED: {why}" if why else "")
                )
    finally:
        for proxy in proxies.values():
            proxy.close()
        for system in running.values():
            system.close()
    return {
        "task": TASK,
        "runs": runs,
        "window": WINDOW,
        "settings": {name: system.settings for name, system in running.items()},
        "notes": notes,
        "outcome": outcome,
        "exchanges": [asdict(e) for p in proxies.values() for e in p.exchanges],
        "daemon_records": daemon,
        "errors": errors,
    }


def _said(r: dict[str, Any]) -> str:
    """One daemon record in a line: what it did and where the time went."""
    ttft = "-" if r["ttft_ms"] is None else f"{r['ttft_ms']:.0f}"
    return (
        f"{r['outcome']}/{r['reason']}{' from ' + r['tier'] if r['tier'] else ''}, "
        f"computed {r['prefilled_tokens']} of {r['prompt_tokens']}, TTFT {ttft} ms in the daemon "
        f"(prefill {r['prefill_ms']:.0f}, restore {r['restore_ms']:.0f}), {r['daemon_ms']:.0f} ms in all, "
        f"recomputed so far {r['recomputed_so_far']}"
    )


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run and system: the main request's TTFT, the sum over the run's requests, the prompt
    tokens computed (all requests), and modeld / llama-server for the main request."""
    rows: list[dict[str, Any]] = []
    exchanges = result.get("exchanges") or []
    for k in range(int(result.get("runs", 0))):
        row: dict[str, Any] = {"run": k + 1}
        for name in SYSTEMS:
            mine = [e for e in exchanges if e["run"] == k and e["system"] == name]
            main = [e for e in mine if e["tools"]]
            row[name] = {
                "ttft_s": main[0]["ttft_s"] if main else None,
                "ttft_sum_s": sum(e["ttft_s"] for e in mine),
                "computed": sum(e["computed_tokens"] or 0 for e in mine),
                "prompt": sum(e["prompt_tokens"] or 0 for e in mine),
                "requests": len(mine),
            }
        a, b = row["modeld"]["ttft_s"], row["llama-server"]["ttft_s"]
        row["ratio"] = a / b if a and b else None
        rows.append(row)
    return rows


def report_lines(result: dict[str, Any]) -> list[str]:
    """The report's table."""
    if result.get("skipped"):
        return ["## The real Claude Code", "", f"Skipped: {result['skipped']}", ""]
    lines = [
        f"## The real Claude Code, {result.get('runs', RUNS)} runs of one task (TTFT of its main request)",
        "",
        f"`claude -p {json.dumps(result.get('task', TASK))}`, each run a new session in the same "
        f"repository, the reply model, a {result.get('window', WINDOW)}-token window; both servers "
        "at their defaults.",
        "",
        "| run | modeld TTFT | llama-server TTFT | modeld / llama-server | computed (modeld, llama-server) | requests |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary(result):
        m, s = row["modeld"], row["llama-server"]

        def ms(v: float | None) -> str:
            return f"{v * 1000:.0f} ms" if v else "-"

        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
        lines.append(
            f"| {row['run']} | {ms(m['ttft_s'])} | {ms(s['ttft_s'])} | {ratio} | "
            f"{m['computed']}, {s['computed']} | {m['requests']}, {s['requests']} |"
        )
    records = result.get("daemon_records") or []
    if records:
        lines += ["", "What modeld did for each request (its request records; TTFT inside the daemon):", ""]
        lines += [f"- run {r['run'] + 1}: {_said(r)}" for r in records]
    lines += ["", *(f"- {n}" for n in result.get("notes") or []), ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.claude_code", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--llama-server", default="", help="the llama-server binary (scripts/build_llama_server.sh)"
    )
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--out", type=Path, help="write run.json and report.md here")
    args = parser.parse_args(argv)
    from modeld import testmodels

    model = str(testmodels.ensure_model(testmodels.REPLY))
    started = time.time()
    result = run_claude_code(
        model,
        args.llama_server,
        len(os.sched_getaffinity(0)),
        runs=args.runs,
        log=lambda s: print(s, flush=True),
    )
    write_extra_run(
        "claude_code", (testmodels.REPLY.name, Path(model).name), started, result, report_lines, args.out
    )
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
