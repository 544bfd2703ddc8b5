"""The real agents' tool loops, end to end (issue 33): Claude Code and Codex CLI, unchanged, against
a real ``modeld serve --http`` serving ``modeld-tools`` (``modeld/testmodels/_tools.py``): a user
turn that names a file is answered with a call reading it, the agent runs the tool, its result
comes back, and the model answers it and ends the turn.

What is asserted, per agent: the tool runs (the agent's own record of it holds the file's text),
its result comes back to the daemon and is answered (``Done.``), every request after a run's
first is warm (the daemon's own usage, as the agent recorded it, and explain-context), a second
run continuing the session is warm from its first request. Codex also over the Responses
WebSocket (two runs, the second warm), with the bytes it sends per turn against HTTP. A tool
result past a small window: Claude Code's is cut to fit (``--fit-tool-results``, the default: its own
compaction cannot fit it) and its session goes on, warm; Codex gets the Responses API's
``context_length_exceeded``, compacts and goes on; and an image a tool returned does not end
the session (a named placeholder).

One daemon, one repository and one home per agent for the whole module: the agents' system
prompts and tools (12-20k tokens) are computed once and every later run starts warm.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents import CountingProxy, ensure_agents, make_repo, run_claude, run_codex, write_codex_config
from daemon_proc import serve_http, stop

import runtime_client as rc

pytestmark = [pytest.mark.wire, pytest.mark.llama, pytest.mark.slow]

MODEL = "modeld-tools"
READ_CALC = 'Read the file "calc.py" and say what it does.'
CALC_TEXT = "A tiny calculator."  # calc.py's docstring
RUN_TIMEOUT = 1500.0  # a cold 20k-token prompt on a loaded 2-core box takes minutes
WARM = 0.9  # a warm request reuses at least this share of its prompt


WINDOW = 24576
"""The daemon's window: Claude Code's first request (about 21k tokens of this vocabulary) and a
few turns fit; a file of a few thousand lines does not (the compaction tests)."""


class Daemon:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc, record = serve_http(
            tmp, "--max-output-tokens", "64", "--num-ctx", str(WINDOW),
            backend="llama", timeout=300,
        )  # fmt: skip
        self.url = record.http_endpoint

    def explain(self, session_id: str) -> Any:
        with rc.connect(data_dir=self.tmp) as client:
            return client.explain_context(session_id)

    def sessions(self) -> list[Any]:
        with rc.connect(data_dir=self.tmp) as client:
            return [s for s in client.list_sessions() if s.model_name == MODEL]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdloop"))
    d = Daemon(tmp)
    try:
        yield d
    finally:
        _, err = stop(d.proc)
        shutil.rmtree(tmp, ignore_errors=True)
        assert "Traceback" not in err, err[-3000:]


# --- Claude Code --------------------------------------------------------------------------------


def claude_messages(home: Path) -> list[dict[str, Any]]:
    """Every message of Claude Code's session transcripts (its own record of the session), in order."""
    out = []
    for path in sorted((home / ".claude" / "projects").glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if isinstance(entry.get("message"), dict):
                out.append(entry["message"])
    return out


def claude_requests(home: Path) -> list[dict[str, int]]:
    """The daemon's usage of each request, as Claude Code recorded it (one per assistant message)."""
    seen: dict[str, dict[str, int]] = {}
    for message in claude_messages(home):
        if message.get("role") == "assistant" and isinstance(message.get("usage"), dict):
            seen.setdefault(message.get("id", str(len(seen))), message["usage"])
    return list(seen.values())


def warm_share(usage: dict[str, int]) -> float:
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    return usage["cache_read_input_tokens"] / prompt


def claude_loop(
    daemon: Daemon, repo: Path, home: Path, prompts: tuple[str, str]
) -> list[list[dict[str, int]]]:
    """Two headless Claude Code runs of ``prompts`` in ``repo`` (the second ``--continue``), each
    a tool loop that calls, gets its result back and answers ``Done.``: two requests a run. The
    daemon's usage of each run's requests."""
    agents = ensure_agents()
    runs = []
    for i, prompt in enumerate(prompts):
        before = len(claude_requests(home))
        run = run_claude(
            agents.claude, prompt, cwd=repo, home=home, base_url=daemon.url, model=MODEL,
            max_output_tokens=64, max_retries=0, timeout=RUN_TIMEOUT,
            args=["--max-turns", "3", *(["--continue"] if i else [])],
        )  # fmt: skip
        assert run.returncode == 0 and not run.timed_out, (run.stderr[-2000:], run.stdout[-2000:])
        assert isinstance(run.result, dict) and not run.result.get("is_error"), run.result
        # The call, the tool's run, its result back, the answer: two requests, the turn ended.
        assert (run.result["result"], run.result["num_turns"]) == ("Done.", 2), run.result
        requests = claude_requests(home)[before:]
        assert len(requests) == 2, requests
        runs.append(requests)
    return runs


def test_claude_code_runs_a_tool_loop_and_every_later_turn_is_warm(daemon: Daemon) -> None:
    tmp = daemon.tmp
    repo = make_repo(tmp / "claude-repo")
    home = tmp / "claude-home"
    first, second = claude_loop(daemon, repo, home, (READ_CALC, 'Read the file "calc.py" again.'))
    # The first run's first request is the cold one; every later request is warm.
    assert all(warm_share(u) >= WARM for u in first[1:] + second), (first, second)
    messages = claude_messages(home)
    calls = [
        b
        for m in messages
        for b in m.get("content") or []
        if isinstance(b, dict) and b.get("type") == "tool_use"
    ]
    results = [
        b
        for m in messages
        for b in m.get("content") or []
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]
    assert [(c["name"], c["input"]) for c in calls] == [("Read", {"file_path": "calc.py"})] * 2
    assert len(results) == 2 and all(CALC_TEXT in json.dumps(r["content"]) for r in results)
    # explain-context: the session's last request reused its whole warm prefix.
    session = max(daemon.sessions(), key=lambda s: s.last_used_at)
    report = daemon.explain(session.session_id)
    assert report.last_reuse is not None and report.last_reuse.outcome == "warm", report.last_reuse


# --- Codex --------------------------------------------------------------------------------------

SENT: dict[str, list[tuple[int, int]]] = {}
"""Per transport, per run: (bytes Codex sent, requests that carried a turn): the bytes figure."""


def codex_turns(events: list[Any]) -> tuple[list[dict[str, Any]], list[str], dict[str, int]]:
    """A run's command executions, agent messages and usage (Codex's own record of it)."""
    done = [e["item"] for e in events if isinstance(e, dict) and e.get("type") == "item.completed"]
    commands = [i for i in done if i.get("type") == "command_execution"]
    answers = [i["text"] for i in done if i.get("type") == "agent_message"]
    usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("type") == "turn.completed")
    return commands, answers, usage


def run_codex_loop(daemon: Daemon, transport: str) -> None:
    agents = ensure_agents()
    tmp = daemon.tmp / f"codex-{transport}"
    repo = make_repo(tmp / "repo")
    codex_home = tmp / "codex-home"
    proxy = CountingProxy(daemon.url.removeprefix("http://"))
    extra = "supports_websockets = true\n" if transport == "websocket" else ""
    write_codex_config(codex_home, f"{proxy.url}/v1", MODEL, context_window=32768, provider_extra=extra)
    SENT[transport] = []
    try:
        for i in range(2):
            sent = proxy.sent
            run = run_codex(
                agents.codex, READ_CALC, cwd=repo, codex_home=codex_home, home=tmp / "user",
                subcommand=["resume", "--last"] if i else [], timeout=RUN_TIMEOUT,
            )  # fmt: skip
            assert run.returncode == 0 and not run.timed_out, (run.stderr[-2000:], run.stdout[-2000:])
            events = run.result or []
            kinds = [e.get("type") for e in events if isinstance(e, dict)]
            assert "turn.completed" in kinds and "turn.failed" not in kinds, events
            commands, answers, usage = codex_turns(events)
            # The tool ran (Codex's shell, in its sandbox), its output came back, it was answered.
            assert [(c["command"], c["exit_code"]) for c in commands] == [("/bin/bash -lc 'cat calc.py'", 0)]
            assert CALC_TEXT in commands[0]["aggregated_output"]
            assert answers == ["Done."], events
            # Usage is the run's two requests together. In the first run the second request
            # reuses at least the whole first prompt (the two are nearly the same size). A
            # resumed run's first request reuses the whole session and then computes what Codex
            # adds on resuming (its base instructions and environment again, about 16k tokens:
            # new text, not a miss); its second request reuses all of the first.
            share = usage["cached_input_tokens"] / usage["input_tokens"]
            assert share >= (0.6 if i else 0.45), usage
            SENT[transport].append((proxy.sent - sent, 2))
            # explain-context: the run's last request reused all that was warm and extended it.
            session = max(daemon.sessions(), key=lambda s: s.last_used_at)
            reuse = daemon.explain(session.session_id).last_reuse
            assert reuse is not None and (reuse.outcome, reuse.reason) == ("warm", "extended"), reuse
    finally:
        proxy.close()


def test_codex_runs_a_tool_loop_over_http(daemon: Daemon) -> None:
    run_codex_loop(daemon, "http")


def test_codex_runs_a_tool_loop_over_the_responses_websocket(daemon: Daemon) -> None:
    """Codex with ``supports_websockets``: its turns go over ``GET /v1/responses`` upgraded, each
    continuing the socket's last response with only its new items; the second run is warm. It
    sends a fraction of what it sends over HTTP (the figure is in blueprint 0019)."""
    run_codex_loop(daemon, "websocket")
    if "http" in SENT:
        http, ws = SENT["http"][1][0], SENT["websocket"][1][0]
        print(f"\ncodex bytes sent per run (a tool loop: 2 requests each; run 2 resumed): {SENT}")
        assert ws * 2 < http, SENT


def test_the_socket_was_refused_where_it_should_fall_back(daemon: Daemon) -> None:
    """A plain GET of the socket's path is 426, what makes Codex fall back to HTTP."""
    plain = httpx.get(f"{daemon.url}/v1/responses", timeout=30)
    assert (plain.status_code, plain.headers.get("upgrade")) == (426, "websocket")


# --- past a small window, and images (issue 33 part 1) -----------------------------------------


NOTES = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(600))
"""A file whose text (about 9k tokens as Read numbers its lines) takes a session past the window."""


def test_claude_code_goes_on_past_the_window_inside_a_tool_loop(daemon: Daemon) -> None:
    """Claude Code reads a file that takes its tool loop past the window. Refused ('prompt is too
    long: N tokens > M maximum'), Claude Code 2.1.328 compacts inside the loop, but its compaction
    request carries its tools (about 16k tokens here) and the same tool result, so it is refused
    too, and so is every later run (measured; blueprint 0019). With ``--fit-tool-results`` (the default) the
    daemon cuts the tool result instead (to its first window / 4 characters, marked, and listed in
    ``modeld.omitted_content``): the run answers (``Done.``), and a ``--continue`` run is warm
    from its first request and goes on (its second result is cut, the first left out whole)."""
    tmp = daemon.tmp / "claude-compact"
    repo = make_repo(tmp / "repo", {"notes.txt": NOTES, "calc.py": '"""A tiny calculator."""\n'})
    home = tmp / "home"
    _, continued = claude_loop(
        daemon, repo, home, ('Read the file "notes.txt".', 'Read the file "notes.txt" again.')
    )
    # The continued session is warm: its first request reuses the cut conversation.
    assert warm_share(continued[0]) >= WARM, continued
    calls = [
        b
        for m in claude_messages(home)
        for b in m.get("content") or []
        if isinstance(b, dict) and b.get("type") == "tool_use"
    ]
    assert [(c["name"], c["input"]) for c in calls] == [("Read", {"file_path": "notes.txt"})] * 2


def test_codex_compacts_past_a_small_window_and_goes_on(daemon: Daemon) -> None:
    """Codex (told the model's window is larger than the daemon's, so it does not compact first)
    reads the same file: the turn's stream ends with ``response.failed`` and
    ``context_length_exceeded``, Codex compacts and the resumed session goes on."""
    agents = ensure_agents()
    tmp = daemon.tmp / "codex-compact"
    repo = make_repo(tmp / "repo", {"notes.txt": NOTES, "calc.py": '"""A tiny calculator."""\n'})
    codex_home = tmp / "codex-home"
    write_codex_config(codex_home, f"{daemon.url}/v1", MODEL, context_window=65536)
    for i, prompt in enumerate(('Read the file "notes.txt".', READ_CALC)):
        run = run_codex(
            agents.codex, prompt, cwd=repo, codex_home=codex_home, home=tmp / "user",
            subcommand=["resume", "--last"] if i else [], timeout=RUN_TIMEOUT,
        )  # fmt: skip
        assert run.returncode == 0 and not run.timed_out, (run.stderr[-2000:], run.stdout[-2000:])
        kinds = [e.get("type") for e in run.result or [] if isinstance(e, dict)]
        assert "turn.completed" in kinds and "turn.failed" not in kinds, run.result


def test_an_image_in_claude_code_s_history_does_not_end_the_session(daemon: Daemon) -> None:
    """Claude Code's Read of a PNG puts an image in the history; the session goes on."""
    agents = ensure_agents()
    tmp = daemon.tmp / "claude-image"
    png = (
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4"
        b"\x89\x00\x00\x00\rIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\xa7\x35\x81\x84\x00\x00\x00\x00IEND\xaeB`\x82"
    )
    repo = make_repo(tmp / "repo")
    (repo / "dot.png").write_bytes(png)
    home = tmp / "home"
    first = run_claude(
        agents.claude, 'Read the file "dot.png".', cwd=repo, home=home, base_url=daemon.url, model=MODEL,
        max_output_tokens=64, max_retries=0, timeout=RUN_TIMEOUT, args=["--max-turns", "3"],
    )  # fmt: skip
    assert not first.timed_out, first.stderr[-2000:]
    images = [
        b
        for m in claude_messages(home)
        for b in m.get("content") or []
        if isinstance(b, dict) and "image" in json.dumps(b)
    ]
    assert images, "Claude Code's Read of a PNG put no image in the session"
    later = run_claude(
        agents.claude, READ_CALC, cwd=repo, home=home, base_url=daemon.url, model=MODEL,
        max_output_tokens=64, max_retries=0, timeout=RUN_TIMEOUT, args=["--max-turns", "3", "--continue"],
    )  # fmt: skip
    assert later.returncode == 0 and isinstance(later.result, dict), later.stdout[-2000:]
    assert (later.result["result"], later.result["num_turns"]) == ("Done.", 2), later.result
