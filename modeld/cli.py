"""The ``modeld`` command line: serve, drain, describe, explain-context, status, logs, metrics,
requests, top.

Expected failures (no daemon, a bad model file, an unknown session) print one line to stderr
and exit non-zero; a traceback only ever means a bug. Every command that reports something
has ``--json`` for programs and a readable table for people. The global options
(``--address``, ``--data-dir``) may come before or after the command. Output into a pipe that
closes early (``modeld status | head -1``) ends quietly, like any Unix tool.

Exit codes: 0 success, 1 an error (the line says which), 2 bad usage, 3 another daemon owns
the machine (``serve`` without ``--takeover``), 4 no daemon could be reached, 141 the output
pipe was closed (as if by SIGPIPE).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from modeld.contract import BACKEND_TYPES, Config, OpenSessionRequest
from modeld.errors import DaemonUnavailableError, ModeldError
from modeld.flags import MAX_FLAG_CHARS, add_flags, count, from_flags, given, parse_duration
from modeld.observe.views import format_model_info, format_report, format_sessions

if TYPE_CHECKING:
    from modeld.daemon import ServeOptions

__all__ = ["main"]

EXIT_ERROR = 1
EXIT_UNAVAILABLE = 4
EXIT_PIPE = 141


def _json(obj: Any) -> str:
    def default(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.asdict(value)
        if isinstance(value, Path):
            return str(value)
        if hasattr(value, "items"):
            return dict(value.items())
        raise TypeError(f"not JSON serializable: {type(value).__name__}")

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.dumps(obj, indent=2, sort_keys=True, default=default)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``modeld serve: error: ...``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- serve ----------------------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int:
    from modeld.daemon import run
    from modeld.observe.logs import SafeFormatter

    try:
        options = serve_options(args)
    except ValueError as exc:
        print(f"modeld serve: error: {exc}", file=sys.stderr)
        return 2
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, options.serving.log_level.upper()), handlers=[handler])
    return run(options)


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The daemon's options from ``modeld serve``'s flags (raises ValueError, one line, on a
    combination that cannot work). Unset flags keep the defaults of ``modeld/settings.py``."""
    from modeld.daemon import ServeOptions
    from modeld.settings import (
        HttpSettings,
        Limits,
        RequestRecords,
        Residency,
        RestartPolicy,
        Serving,
        Timeouts,
    )

    limits = from_flags(args, Limits)
    if limits.max_message_bytes < limits.max_text_bytes + (64 << 10):
        raise ValueError(
            "--max-message-bytes must exceed --max-text-bytes by at least 64 KiB (room for the manifest)"
        )
    residency = from_flags(args, Residency)
    if residency.shared_store_bytes == 0:
        raise ValueError(
            "--shared-store-bytes 0 leaves the shared store no room (leave out --shared-store instead)"
        )
    if given(args, Residency, "shared_store_bytes") is not None and not residency.shared_store:
        raise ValueError("--shared-store-bytes is the budget of --shared-store DIR: add it")
    if residency.pool_tokens and not residency.kv_unified:
        raise ValueError("--kv-pool-tokens sizes the unified KV pool: drop --no-kv-unified")
    if residency.memory_budget_bytes == 0:
        raise ValueError("--memory-budget 0 leaves no room for any model (use auto for the default)")
    timeouts = from_flags(args, Timeouts)
    if timeouts.stream_interval_seconds > 10:
        raise ValueError("--stream-interval is at most 10s (a held token is that much late)")
    restart = from_flags(args, RestartPolicy)
    if restart.backoff_max < restart.backoff_initial:
        raise ValueError("--restart-backoff-max must be at least --restart-backoff")
    http = from_flags(args, HttpSettings)
    http = replace(
        http,
        api_key=http.api_key or os.environ.get("MODELD_API_KEY", ""),
        flash_attn=_flash_attn(http.flash_attn, http.kv_cache_type),
    )
    options = ServeOptions(
        serving=from_flags(args, Serving),
        http=http,
        limits=limits,
        residency=residency,
        timeouts=timeouts,
        restart=restart,
        recording=from_flags(args, RequestRecords),
    )
    if args.data_dir:
        options.data_dir = Path(args.data_dir)
    return options


# --- drain ----------------------------------------------------------------------------------

DRAIN_WAIT_SECONDS = 180.0
"""How long ``modeld drain`` waits by default: the daemon's drain timeout (60) and the time to
write its warm contexts (at most 60), with room to spare."""


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent has too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state == "Z"


def _cmd_drain(args: argparse.Namespace) -> int:
    """Ask the daemon that owns the data directory to drain (SIGTERM) and wait for it to exit."""
    import signal
    import socket

    from modeld.lease import read_lease
    from modeld.paths import default_data_dir

    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    record = read_lease(data_dir)
    if record is None or not record.alive:
        print(f"modeld drain: no daemon owns {data_dir}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if record.hostname and record.hostname != socket.gethostname():
        print(
            f"modeld drain: the owner of {data_dir} runs on {record.hostname}, not here: run modeld drain there",
            file=sys.stderr,
        )
        return EXIT_ERROR
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if b"modeld" not in cmdline:
        print(f"modeld drain: pid {record.pid} of the owner record is not a modeld process", file=sys.stderr)
        return EXIT_UNAVAILABLE
    started = time.monotonic()
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        print(f"modeld drain: the owner (pid {record.pid}) exited meanwhile", file=sys.stderr)
        return 0
    print(
        f"draining modeld pid {record.pid} (instance {record.instance_id}) ...", file=sys.stderr, flush=True
    )
    deadline = started + args.timeout
    while not _gone(record.pid):
        if time.monotonic() >= deadline:
            print(
                f"modeld drain: pid {record.pid} is still draining after {args.timeout:g}s (it goes on; run "
                "modeld drain again to keep waiting; a SIGKILL loses the warm state not yet saved)",
                file=sys.stderr,
            )
            return EXIT_ERROR
        time.sleep(0.1)
    print(f"drained: pid {record.pid} exited after {time.monotonic() - started:.1f}s")
    return 0


# --- describe -------------------------------------------------------------------------------


def _cmd_describe(args: argparse.Namespace) -> int:
    from modeld.engine import Engine
    from modeld.settings import HttpSettings, Residency

    sessions = from_flags(args, HttpSettings)
    flash_attn = _flash_attn(sessions.flash_attn, sessions.kv_cache_type)
    request = OpenSessionRequest(
        type=args.type,
        path=args.path,
        digest=args.digest or "",
        config=Config(num_ctx=args.num_ctx, kv_cache_type=sessions.kv_cache_type, flash_attn=flash_attn),
    )
    residency = from_flags(args, Residency)
    info = Engine(backends=(args.type,), residency=residency).describe(request)
    if args.json:
        print(_json(info))
        return 0
    print(format_model_info(info, args.num_ctx, sessions.kv_cache_type, flash_attn))
    return 0


def _flash_attn(flash_attn: bool, kv_cache_type: str) -> bool:
    """``--flash-attn``, implied by a quantized KV cache (llama.cpp needs it to quantize V, and
    llama-server's ``-fa auto`` turns it on for one)."""
    return flash_attn or kv_cache_type in ("q8_0", "q4_0")


# --- observers ------------------------------------------------------------------------------


def _connect(args: argparse.Namespace) -> Any:
    from runtime_client import connect

    return connect(args.address, data_dir=Path(args.data_dir) if args.data_dir else None)


def _cmd_status(args: argparse.Namespace) -> int:
    from modeld.observe.views import format_status

    with _connect(args) as client:
        status = client.status(debug=args.debug)
    if args.json:
        print(_json(status))
        return 0
    print(format_status(status, debug=args.debug))
    return 0


def _cmd_logs(args: argparse.Namespace) -> int:
    from modeld.observe.views import format_logs, match_models

    with _connect(args) as client:
        status = client.status(debug=True)
    models = list(status.models)
    if args.model:
        models = match_models(models, args.model)
        if not models:
            loaded = ", ".join(m.model_name or m.path for m in status.models) or "none"
            print(
                f"modeld: error: no loaded model matches {args.model[:MAX_FLAG_CHARS]!r} (loaded: {loaded})",
                file=sys.stderr,
            )
            return EXIT_ERROR
    if args.json:
        print(_json({m.model_name or m.path: list(m.worker.log_lines) if m.worker else [] for m in models}))
        return 0
    print(format_logs(models) if models else "no models loaded")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        if not args.session_id:
            sessions = client.list_sessions()
            if args.json:
                print(_json(sessions))
                return 0
            if not sessions:
                print("no open sessions")
                return 0
            print(format_sessions(sessions, time.time()))
            return 0
        report = client.explain_context(args.session_id)
    if args.json:
        print(_json(report))
        return 0
    print(format_report(report))
    return 0


def _cmd_metrics(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        text = client.metrics()
    sys.stdout.write(text)
    return 0


def _since(text: str) -> float:
    """``--since``: a duration back from now (``15m``, ``2h``; the flags' durations) as a Unix time."""
    return time.time() - parse_duration(text)


def _cmd_requests(args: argparse.Namespace) -> int:
    from modeld.observe.requests import format_record, format_records

    with _connect(args) as client:
        if args.id:
            record = client.request(args.id)
            if record is None:
                print(f"modeld: error: no request record {args.id[:MAX_FLAG_CHARS]!r}", file=sys.stderr)
                return EXIT_ERROR
            print(_json(record) if args.json else format_record(record))
            return 0
        records = client.list_requests(
            job=args.job,
            conversation=args.conversation,
            since=args.since,
            limit=args.limit,
            running=args.running,
        )
    print(_json([dataclasses.asdict(r) for r in records]) if args.json else format_records(records))
    return 0


def _cmd_top(args: argparse.Namespace) -> int:
    from modeld.observe.requests import format_top

    with _connect(args) as client:
        while True:
            records = client.list_requests(limit=200)
            screen = format_top(records, time.time())
            if args.once:
                print(screen)
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)


# --- main -----------------------------------------------------------------------------------


def _global_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """``--address`` and ``--data-dir``, accepted before the command and after it."""
    default = None if top else argparse.SUPPRESS
    p.add_argument(
        "--address",
        default=default,
        help="daemon address (unix:PATH or HOST:PORT); default: MODELD_ADDRESS, then the owner lease",
    )
    p.add_argument(
        "--data-dir",
        default=default,
        help="data directory (default: MODELD_DATA_DIR or the user data directory)",
    )


_DESCRIBE_SETTINGS = ("sequences", "kv_unified", "pool_tokens", "memory_budget_bytes", "swa_full")
"""The settings that size a model's memory, which ``modeld describe`` takes too."""
_DESCRIBE_SESSION = ("kv_cache_type", "flash_attn")
"""The session settings of the HTTP APIs that ``modeld describe`` sizes a model for."""


def _parser() -> argparse.ArgumentParser:
    from modeld.settings import SETTINGS, HttpSettings, Residency

    p = _Parser(prog="modeld", description="Local warm-prefix inference daemon.")
    _global_options(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the daemon")
    _global_options(s, top=False)
    groups = None
    for cls in SETTINGS:  # every flag is a setting (modeld/settings.py); unset ones keep its defaults
        groups = add_flags(s, cls, groups)
    s.set_defaults(func=_cmd_serve)

    d = sub.add_parser("describe", help="what a model is and can do on this machine (no daemon needed)")
    _global_options(d, top=False)
    d.add_argument("--type", required=True, choices=BACKEND_TYPES)
    d.add_argument("--path", required=True)
    d.add_argument("--digest", help="expected model digest")
    d.add_argument("--num-ctx", type=int, default=Config().num_ctx)
    add_flags(d, HttpSettings, only=_DESCRIBE_SESSION, help="as modeld serve's (for HTTP sessions)")
    add_flags(d, Residency, only=_DESCRIBE_SETTINGS, help="as modeld serve's")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_cmd_describe)

    e = sub.add_parser("explain-context", help="what is resident in a session, and why it was warm or cold")
    _global_options(e, top=False)
    e.add_argument("session_id", nargs="?", help="a session id (default: one line per open session)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_explain)

    t = sub.add_parser(
        "status", help="who owns the machine, the machine, the tiers, each model's worker and warm contexts"
    )
    _global_options(t, top=False)
    t.add_argument("--json", action="store_true")
    t.add_argument("--debug", action="store_true", help="also each engine worker's last log lines")
    t.set_defaults(func=_cmd_status)

    lg = sub.add_parser("logs", help="the last log lines of each engine worker (llama.cpp's included)")
    _global_options(lg, top=False)
    lg.add_argument("model", nargs="?", help="a loaded model: its name, file name, path or digest prefix")
    lg.add_argument("--json", action="store_true")
    lg.set_defaults(func=_cmd_logs)

    dr = sub.add_parser(
        "drain",
        help="drain the daemon that owns the data directory (SIGTERM): new turns go elsewhere, "
        "running ones finish, warm contexts are saved (and written to the shared store), then it exits",
    )
    _global_options(dr, top=False)
    dr.add_argument(
        "--timeout",
        type=parse_duration,
        default=DRAIN_WAIT_SECONDS,
        metavar="DURATION",
        help=f"how long to wait for the daemon to exit ({DRAIN_WAIT_SECONDS:g})",
    )
    dr.set_defaults(func=_cmd_drain)

    m = sub.add_parser("metrics", help="the daemon's metrics (Prometheus text format)")
    _global_options(m, top=False)
    m.set_defaults(func=_cmd_metrics)

    rq = sub.add_parser("requests", help="the request records: one per turn over every API and gRPC")
    _global_options(rq, top=False)
    rq.add_argument("id", nargs="?", help="one record, whole (running or done)")
    rq.add_argument("--job", default="", help="only this job label (X-Modeld-Job, or the agent's session)")
    rq.add_argument("--conversation", default="", help="only this conversation key")
    rq.add_argument(
        "--since", type=_since, default=0.0, metavar="DURATION", help="only the last 15m, 2h, ..."
    )
    rq.add_argument(
        "--limit", type=count(1, 1000), default=100, help="the newest this many (100; at most 1000)"
    )
    rq.add_argument("--running", action="store_true", help="only the turns running now")
    rq.add_argument("--json", action="store_true")
    rq.set_defaults(func=_cmd_requests)

    tp = sub.add_parser("top", help="the turns running now and the newest ones, refreshed (Ctrl-C stops)")
    _global_options(tp, top=False)
    tp.add_argument(
        "--interval", type=parse_duration, default=1.0, metavar="DURATION", help="refresh every (1s)"
    )
    tp.add_argument("--once", action="store_true", help="print one screen and exit")
    tp.set_defaults(func=_cmd_top)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`modeld status | head`): stop quietly, as a tool killed by
        # SIGPIPE would, and keep the interpreter's final flush from failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE
    except DaemonUnavailableError as exc:
        print(f"modeld: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ModeldError as exc:
        print(f"modeld: error: {exc} [{exc.reason}]", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
