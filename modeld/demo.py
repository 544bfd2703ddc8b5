"""The main job (``make run``): a daemon, and a coding tool's turns against it, cold then warm.

Starts ``modeld serve`` in a private data directory, then plays a short coding session through
``runtime_client`` over the unix socket: a large stable prefix (system prompt, tools, repo map,
pinned file) and a new suffix each turn. It prints, per turn, whether the prefix was warm or
cold (and from which tier a warm one came: the KV, or a RAM or disk snapshot), how many tokens
were reused and prefilled, the daemon's own prefill time and the client-observed time to first
token. A long prefill draws a progress bar from the daemon's progress reports
(``ensure_prefix(..., progress=callback)``). Turn 3 edits the repo map, so part of the prefix is
recomputed and explain-context says where.

The daemon also serves HTTP on a free loopback port: the demo prints the live page's address
(``/ui``), where the four turns appear under the job label ``make-run`` (blueprint 0022): cold,
warm, the edit with the segment it hit, warm again. Run from a terminal, it keeps the daemon
serving afterwards so the page stays up, until Ctrl-C (``--stay``/``--no-stay``).

``--model`` takes a GGUF path, or ``tiny`` / ``realistic`` / ``copying`` for the models the project generates
(``modeld.testmodels``). With the memory backend the model is a name.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import runtime_client as rc
from modeld.lease import read_lease

__all__ = ["main"]

SYSTEM = (
    "You are a careful senior engineer working in this repository. Answer with a unified diff "
    "and one sentence of explanation. Never invent files.\n"
)
TOOLS = (
    '[{"name": "read_file", "parameters": {"path": "string"}},\n'
    ' {"name": "run_tests", "parameters": {"selector": "string"}},\n'
    ' {"name": "apply_patch", "parameters": {"diff": "string"}}]\n'
)
RULES = "Rules: keep functions small; type everything; tests narrate scenarios; no prints.\n"


def _repo_map(root: Path, limit_bytes: int) -> str:
    """A repo map built from this package's own sources: realistic code-like text."""
    lines: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        defs = [
            ln.strip().split("(")[0].replace("def ", "").replace("class ", "")
            for ln in path.read_text(errors="replace").splitlines()
            if ln.startswith(("def ", "class "))
        ]
        lines.append(f"{rel}: {', '.join(defs[:12])}")
    text = "\n".join(lines) + "\n"
    while len(text.encode()) < limit_bytes:
        text += text
    return text.encode()[:limit_bytes].decode(errors="ignore") + "\n"


def _edited(repo_map: str) -> str:
    """The repo map with one file's entry changed (its first name renamed), halfway through:
    whatever the package's sources are, the edit lands inside the prefix."""
    lines = repo_map.split("\n")
    i = len(lines) // 2
    lines[i] = lines[i].replace(": ", ": renamed_", 1) if ": " in lines[i] else lines[i] + "  # edited"
    return "\n".join(lines)


def _resolve_model(backend: str, model: str) -> str:
    if backend == "memory":
        return model or "demo"
    if model in ("", "tiny", "realistic", "copying"):
        from modeld import testmodels

        spec = {"realistic": testmodels.REALISTIC, "copying": testmodels.COPYING}.get(model, testmodels.TINY)
        print(f"demo: using the generated {spec.name} model (generating it on first use)...")
        return str(testmodels.ensure_model(spec))
    return model


class ProgressBar:
    """Draws the daemon's progress reports of a long prefill (at most one every 0.5 s).

    On a terminal the bar is redrawn in place; into a file or pipe each report is a line."""

    def __init__(self, out: TextIO, width: int = 30) -> None:
        self.out = out
        self.width = width
        self.shown = False

    def __call__(self, progress: rc.PrefillProgress) -> None:
        total = max(1, progress.total)
        filled = min(self.width, self.width * progress.done // total)
        bar = "#" * filled + "-" * (self.width - filled)
        line = (
            f"  {progress.stage} [{bar}] {progress.done}/{progress.total} tokens "
            f"{progress.elapsed_ms / 1000:.1f}s"
        )
        tty = self.out.isatty()
        self.out.write(("\r" + line) if tty else line + "\n")
        self.out.flush()
        self.shown = True

    def done(self) -> None:
        """End a bar drawn in place (nothing to do if none was drawn)."""
        if self.shown and self.out.isatty():
            self.out.write("\n")
            self.out.flush()
        self.shown = False


@dataclass(frozen=True)
class TurnResult:
    outcome: str
    reason: str
    tier: str
    prefix: int
    reused: int
    prefilled: int
    suffix: int
    prefill_ms: float
    ttft_ms: float
    tok_s: float
    answer: str


def _turn(session: rc.ClientSession, ctx: rc.BuiltContext, max_tokens: int, bar: ProgressBar) -> TurnResult:
    """One turn as a tool runs it; TTFT is measured from ensure_prefix to the first token."""
    started = time.perf_counter()
    prefix = session.ensure_prefix(ctx.prefix_input(), progress=bar)
    suffix = session.prefill_suffix(ctx.suffix_input(), progress=bar)
    bar.done()
    first = 0.0
    text: list[str] = []
    completion = 0
    with session.decode(rc.DecodeConfig(max_tokens=max_tokens)) as stream:
        for chunk in stream:
            if not first and (chunk.text or chunk.token_ids or chunk.final):
                first = time.perf_counter()
            text.append(chunk.text)
            if chunk.usage is not None:
                completion = chunk.usage.completion_tokens
    end = time.perf_counter()
    return TurnResult(
        outcome=prefix.reuse.outcome,
        reason=prefix.reuse.reason,
        tier=(prefix.reuse.tier or "kv") if prefix.reused_tokens else "-",
        prefix=prefix.prefix_tokens,
        reused=prefix.reused_tokens,
        prefilled=prefix.prefilled_tokens,
        suffix=suffix.suffix_tokens,
        prefill_ms=prefix.prefill_ms + suffix.prefill_ms,
        ttft_ms=(first - started) * 1000,
        tok_s=(completion - 1) / (end - first) if completion > 1 and end > first else 0.0,
        answer="".join(text).replace("\n", " ")[:40],
    )


def _table(rows: list[tuple[str, TurnResult]]) -> str:
    """The per-turn table: reuse (and where it came from), tokens, server and client times."""
    header = (
        f"{'turn':<40} {'reuse':<24} {'from':<4} {'prefix':>7} {'reused':>7} {'prefilled':>9} "
        f"{'suffix':>6} {'prefill ms':>10} {'TTFT ms':>9} {'tok/s':>7}  answer"
    )
    lines = [header, "-" * len(header)]
    for label, r in rows:
        lines.append(
            f"{label:<40} {r.outcome + ' (' + r.reason + ')':<24} {r.tier:<4} {r.prefix:>7} {r.reused:>7} "
            f"{r.prefilled:>9} {r.suffix:>6} {r.prefill_ms:>10.1f} {r.ttft_ms:>9.1f} {r.tok_s:>7.1f}  {r.answer!r}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modeld-demo", description=__doc__)
    parser.add_argument("--backend", default="llama", choices=["memory", "llama", "openvino"])
    parser.add_argument("--model", default="", help="GGUF path, or tiny / realistic / copying (generated)")
    parser.add_argument("--prefix-bytes", type=int, default=6000, help="size of the repo map")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-ctx", type=int, default=8192)
    parser.add_argument(
        "--stay",
        action=argparse.BooleanOptionalAction,
        default=sys.stdout.isatty(),
        help="keep the daemon (and its live page) up after the turns, until Ctrl-C (default: on a terminal)",
    )
    args = parser.parse_args(argv)

    model = _resolve_model(args.backend, args.model)
    data = Path(tempfile.mkdtemp(prefix="modeld-demo-"))
    socket = data / "modeld.sock"
    log = (data / "daemon.log").open("w")
    print(f"demo: starting `modeld serve --backend {args.backend}` (log: {data / 'daemon.log'})")
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "modeld.cli",
            "--data-dir",
            str(data),
            "serve",
            "--backend",
            args.backend,
            "--listen",
            f"unix:{socket}",
            "--http",
            "127.0.0.1:0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    # A demo stopped with kill (SIGTERM) stops its daemon too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        deadline = time.monotonic() + 60
        while (rec := read_lease(data)) is None or rec.state != "serving":
            if daemon.poll() is not None or time.monotonic() > deadline:
                print((data / "daemon.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.05)
        page = f"{rec.http_endpoint}/ui" if rec.http_endpoint else ""
        if page:
            print(f"demo: the live page is at {page} (the turns appear there as they run)")
        with rc.connect(data_dir=data, job="make-run") as client:
            request = rc.OpenSessionRequest(
                type=args.backend, path=model, config=rc.Config(num_ctx=args.num_ctx)
            )
            session = client.open_session(request)
            print(
                f"demo: session {session.session_id} on {session.info.backend} model {session.info.model_name}"
            )
            repo_map = _repo_map(Path(__file__).parent, args.prefix_bytes)
            turns = [
                ("cold: first turn", repo_map, "Why does test_lease fail on a slow disk?\n"),
                ("warm: same prefix, new question", repo_map, "Add a retry to read_lease.\n"),
                (
                    "edit: one file of the repo map changed",
                    _edited(repo_map),
                    "Now update the callers.\n",
                ),
                (
                    "warm again",
                    _edited(repo_map),
                    "Write the changelog entry.\n",
                ),
            ]
            rows = []
            bar = ProgressBar(sys.stdout)
            for number, (label, rmap, question) in enumerate(turns, 1):
                print(f"demo: turn {number}/{len(turns)}: {label}")
                ctx = (
                    rc.ContextBuilder(identity=session.identity)
                    .system(SYSTEM)
                    .tools(TOOLS)
                    .repo_rules(RULES)
                    .repo_map(rmap)
                    .user_turn(question)
                    .build()
                )
                row = _turn(session, ctx, args.max_tokens, bar)
                rows.append((label, row))
            print()
            print(_table(rows))
            print(f"\nwarm TTFT / cold TTFT = {rows[1][1].ttft_ms / rows[0][1].ttft_ms:.3f}")
            print("\n$ modeld explain-context", session.session_id)
            sys.stdout.flush()
            env = {**os.environ, "MODELD_DATA_DIR": str(data)}
            subprocess.run(
                [sys.executable, "-m", "modeld.cli", "explain-context", session.session_id],
                env=env,
                check=False,
            )
            if args.stay and page:
                print(
                    f"\ndemo: the daemon keeps serving; open {page} to see the four turns. Ctrl-C stops it."
                )
                sys.stdout.flush()
                try:
                    while daemon.poll() is None:
                        time.sleep(0.5)
                except KeyboardInterrupt:
                    print()
            session.close()
        return 0
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
