"""The ``modeld`` command line: serve, drain, describe, explain-context, status, logs, metrics.

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
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from modeld.contract import BACKEND_TYPES, KV_CACHE_TYPES, Config, ContextReport, OpenSessionRequest
from modeld.errors import DaemonUnavailableError, ModeldError

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


def _short(digest: str, n: int = 12) -> str:
    return digest[:n] if digest else "-"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{(seconds % 3600) // 60:02.0f}m"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


# --- values of flags ------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_FLAG_CHARS = 64


def parse_size(text: str) -> int:
    """A byte count: ``4096``, ``512M``, ``8G``, ``1.5G`` (K, M, G, T are powers of 1024; a
    trailing ``i``/``iB``/``B`` is accepted), ``0`` (off), ``auto`` (-1: the default)."""
    raw = text.strip()
    if raw.lower() == "auto":
        return -1
    body = raw.upper().removesuffix("B").removesuffix("I")
    number, unit = (body[:-1], body[-1]) if body and body[-1] in "KMGT" else (body, "")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not number or value < 0 or value != value or len(raw) > MAX_FLAG_CHARS:
        raise argparse.ArgumentTypeError(
            f"invalid size {raw[:MAX_FLAG_CHARS]!r}: give bytes with an optional K, M, G or T suffix "
            "(512M, 8G), 0 for off, or auto"
        )
    size = value * _SIZE_UNITS[unit]
    if size >= 1 << 60:
        raise argparse.ArgumentTypeError(f"size {raw!r} is too large")
    return int(size)


def parse_duration(text: str) -> float:
    """Seconds: ``90``, ``90s``, ``2.5m``, ``1h``, ``50ms``; ``0`` switches a timeout off."""
    raw = text.strip()
    unit = next((u for u in ("ms", "s", "m", "h") if raw.lower().endswith(u)), "")
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not number or value < 0 or value != value or value == float("inf") or len(raw) > MAX_FLAG_CHARS:
        raise argparse.ArgumentTypeError(
            f"invalid duration {raw[:MAX_FLAG_CHARS]!r}: give seconds, or a number with ms, s, m or h (90, 2.5m, 1h, 50ms)"
        )
    return value * _DURATION_UNITS[unit]


def parse_positive_size(text: str) -> int:
    """A byte count that must be above 0 (a limit)."""
    size = parse_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text[:MAX_FLAG_CHARS]!r}: give a size above 0 (512K, 16M)")
    return size


def _count(low: int, high: int) -> Any:
    """An argparse type: an integer from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text[:MAX_FLAG_CHARS]!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range ({low} to {high})")
        return value

    parse.__name__ = "number"
    return parse


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
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), handlers=[handler])
    return run(options)


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The daemon's options from ``modeld serve``'s flags (raises ValueError, one line, on a
    combination that cannot work). Unset flags keep the defaults of ``modeld/settings.py``
    and :class:`~modeld.engine.limits.Limits`."""
    from modeld.daemon import ServeOptions
    from modeld.engine import Limits
    from modeld.settings import Residency, RestartPolicy, Timeouts

    def pick(defaults: Any, **flags: Any) -> Any:
        return dataclasses.replace(defaults, **{k: v for k, v in flags.items() if v is not None})

    limits = pick(
        Limits(),
        max_sessions=args.max_sessions,
        max_text_bytes=args.max_text_bytes,
        max_message_bytes=args.max_message_bytes,
        max_loaded_models=args.max_loaded_models,
        model_wait_seconds=args.queue_wait,
        attach_timeout_seconds=args.attach_timeout,
    )
    if limits.max_message_bytes < limits.max_text_bytes + (64 << 10):
        raise ValueError(
            "--max-message-bytes must exceed --max-text-bytes by at least 64 KiB (room for the manifest)"
        )
    residency = pick(
        Residency(),
        sequences=args.sequences,
        kv_unified=args.kv_unified,
        pool_tokens=args.kv_pool_tokens,
        ram_tier_bytes=args.ram_tier_bytes,
        disk_tier_bytes=args.disk_tier_bytes,
        memory_budget_bytes=args.memory_budget,
        isolation=args.isolation,
        slots=args.slots,
        max_queue=args.max_queue,
        snapshot_min_tokens=args.snapshot_min_tokens,
        persist_min_tokens=args.persist_min_tokens,
        shared_store=args.shared_store,
        shared_store_bytes=args.shared_store_bytes,
    )
    if residency.shared_store_bytes == 0:
        raise ValueError(
            "--shared-store-bytes 0 leaves the shared store no room (leave out --shared-store instead)"
        )
    if args.shared_store_bytes is not None and not residency.shared_store:
        raise ValueError("--shared-store-bytes is the budget of --shared-store DIR: add it")
    if residency.pool_tokens and not residency.kv_unified:
        raise ValueError("--kv-pool-tokens sizes the unified KV pool: drop --no-kv-unified")
    if residency.memory_budget_bytes == 0:
        raise ValueError("--memory-budget 0 leaves no room for any model (use auto for the default)")
    timeouts = pick(
        Timeouts(),
        load_seconds=args.load_timeout,
        stall_seconds=args.stall_timeout,
        idle_stream_seconds=args.idle_stream_timeout,
        operation_seconds=args.operation_timeout,
        stream_interval_seconds=args.stream_interval,
        drain_seconds=args.drain_timeout,
    )
    if timeouts.stream_interval_seconds > 10:
        raise ValueError("--stream-interval is at most 10s (a held token is that much late)")
    restart = pick(
        RestartPolicy(),
        backoff_initial=args.restart_backoff,
        backoff_max=args.restart_backoff_max,
        crash_limit=args.crash_limit,
        crash_window=args.crash_window,
    )
    if restart.backoff_max < restart.backoff_initial:
        raise ValueError("--restart-backoff-max must be at least --restart-backoff")
    if args.max_output_tokens < 0 or args.num_ctx < 0:
        raise ValueError("--max-output-tokens and --num-ctx take a number of tokens (0: the default)")
    options = ServeOptions(
        backend=args.backend,
        listen=args.listen or "",
        takeover=args.takeover,
        takeover_timeout=args.takeover_timeout,
        allow_remote=args.allow_remote,
        limits=limits,
        require_token=not args.no_token,
        http=args.http or "",
        api_key=args.api_key or os.environ.get("MODELD_API_KEY", ""),
        models=tuple(args.model or ()),
        models_dir=Path(args.models_dir) if args.models_dir else None,
        num_ctx=args.num_ctx or 0,
        allowed_origins=tuple(args.allow_origin or ()),
        max_output_tokens=args.max_output_tokens,
        kv_cache_type=args.kv_cache_type,
        flash_attn=_flash_attn(args),
        speculation=args.speculation,
        residency=residency,
        timeouts=timeouts,
        restart=restart,
        worker_log_level=args.log_level.upper(),
    )
    if args.describe_timeout is not None:
        options.describe_timeout = args.describe_timeout
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
    from modeld.settings import Residency

    request = OpenSessionRequest(
        type=args.type,
        path=args.path,
        digest=args.digest or "",
        config=Config(num_ctx=args.num_ctx, kv_cache_type=args.kv_cache_type, flash_attn=_flash_attn(args)),
    )
    flags = {
        "sequences": args.sequences,
        "kv_unified": args.kv_unified,
        "pool_tokens": args.kv_pool_tokens,
        "memory_budget_bytes": args.memory_budget,
    }
    residency = dataclasses.replace(Residency(), **{k: v for k, v in flags.items() if v is not None})
    info = Engine(backends=(args.type,), residency=residency).describe(request)
    if args.json:
        print(_json(info))
        return 0
    fp = info.footprint
    rows = [
        ("model", f"{info.model_name}  ({info.path})"),
        ("backend", f"{info.backend} {info.backend_version} on {info.device}"),
        ("digest", info.model_digest),
        (
            "context",
            f"{info.effective_context} tokens effective (trained {info.model_max_context}, asked {args.num_ctx})",
        ),
        (
            "kv cache",
            f"{info.kv_bytes_per_token} bytes per token ({args.kv_cache_type}); "
            f"{_bytes(info.kv_bytes_per_token * info.effective_context)} at the effective context",
        ),
        ("weights", _bytes(info.weights_bytes)),
    ]
    if fp.layout:
        attention = "flash attention on" if _flash_attn(args) else "flash attention off"
        rows += [
            (
                "trained kv",
                f"{_bytes(fp.trained_kv_bytes)} for one trained window ({fp.trained_window} tokens)",
            ),
            (
                "layout",
                f"{fp.layout}: {_bytes(fp.kv_bytes)} of KV allocated at load ({_layout_words(fp.layout)})",
            ),
            ("compute", f"~{_bytes(fp.compute_bytes)} (llama.cpp's compute buffer, {attention})"),
            (
                "total",
                f"~{_bytes(fp.total_bytes)} = weights + KV + compute + {_bytes(fp.overhead_bytes)} per model "
                f"(budget {_bytes(fp.budget_bytes)})",
            ),
            ("max window", f"{fp.max_window} tokens fit the budget under this layout"),
        ]
    rows += [
        ("free memory", _bytes(info.free_bytes)),
        ("vocabulary", f"{info.vocab_size} tokens, tokenizer {_short(info.tokenizer_digest)}"),
        (
            "template",
            f"{_short(info.template_digest)}"
            + (" (chat template present)" if info.chat_template else " (none)"),
        ),
        ("bos", "added" if info.add_bos else "not added"),
        (
            "capabilities",
            f"truncation={'yes' if info.capabilities.truncation else 'no'} reuse={info.capabilities.reuse} "
            f"formats={','.join(info.capabilities.prompt_formats)}",
        ),
    ]
    print("\n".join(f"{k:<13} {v}" for k, v in rows))
    return 0


def _flash_attn(args: argparse.Namespace) -> bool:
    """``--flash-attn``, implied by a quantized KV cache (llama.cpp needs it to quantize V, and
    llama-server's ``-fa auto`` turns it on for one)."""
    return bool(args.flash_attn or args.kv_cache_type in ("q8_0", "q4_0"))


def _layout_words(layout: str) -> str:
    """``unified/4:8704`` -> "4 sequences share 8704 cells"; ``split/4`` -> "4 streams of a window"."""
    shape, _, n = layout.partition("/")
    if shape == "unified":
        seqs, _, pool = n.partition(":")
        return (
            f"{seqs} sequences share {pool} cells; warm output is bit-identical to a fresh evaluation "
            "for a context alone in the pool and can differ when contexts share it"
        )
    streams = "1 stream" if n == "1" else f"{n} streams"
    return f"{streams} of a window each; warm output bit-identical to a fresh evaluation"


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
            now = time.time()
            # TOKENS: the session's context (prefix, suffix, generated); IN KV: how many of
            # them the engine holds now (fewer once evicted: the next operation restores them).
            rows = [
                ("SESSION", "MODEL", "BACKEND", "TOKENS/CTX", "IN KV", "PREFIX", "LAST", "STREAM", "IDLE")
            ]
            for s in sessions:
                rows.append(
                    (
                        s.session_id,
                        s.model_name,
                        s.backend,
                        f"{s.resident_tokens}/{s.num_ctx}",
                        str(s.kv_tokens),
                        str(s.prefix_tokens),
                        s.last_outcome or "-",
                        "attached" if s.attached else "detached",
                        _age(now - s.last_used_at),
                    )
                )
            print(_table(rows))
            return 0
        report = client.explain_context(args.session_id)
    if args.json:
        print(_json(report))
        return 0
    print(_format_report(report))
    return 0


def _numerics(r: ContextReport) -> str:
    """Whether warm output equals a fresh evaluation here, and why (blueprint 0016)."""
    if r.warm_exact:
        return f"warm output is bit-identical to a fresh evaluation (KV layout {r.kv_layout})"
    return (
        f"warm output can differ from a fresh evaluation (KV layout {r.kv_layout}: a unified pool; "
        "the attention sums in another order when other contexts hold cells, enough to change greedy "
        "tokens; bit-identical while this context is alone in the pool; "
        "`modeld serve --no-kv-unified` makes it exact by construction, at a window of memory per sequence)"
    )


def _speculation(r: ContextReport) -> str:
    """What speculation did over the session's decodes (blueprint 0021)."""
    line = f"speculation {r.speculation} (last decode)"
    if r.draft_batches:
        line += (
            f"; {r.accepted_tokens} of {r.drafted_tokens} drafted tokens accepted "
            f"({r.accepted_tokens / r.drafted_tokens:.0%}) in {r.draft_batches} batches "
            f"(mean draft {r.drafted_tokens / r.draft_batches:.1f})"
        )
    if r.forced_tokens:
        line += f"; {r.forced_tokens} tokens forced by constraints"
    return line


def _format_report(r: ContextReport) -> str:
    state = "closed" if r.closed else "open"
    out = [
        f"session   {r.session_id}  ({r.backend} model {r.model_name!r}, owner epoch {r.owner_epoch}, {state})",
        f"context   {r.resident_tokens} of {r.num_ctx} tokens: prefix {r.prefix_tokens}, suffix {r.suffix_tokens}, "
        f"generated {r.generated_tokens}; {r.available_tokens} available; {r.kv_tokens} of them in the KV now",
        f"manifest  {r.manifest_digest or '-'}",
    ]
    if r.kv_layout:
        out.append(f"numerics  {_numerics(r)}")
    if r.speculation:
        out.append(f"decode    {_speculation(r)}")
    m = r.manifest
    if m is not None:
        out.append(
            f"  backend {m.backend} {m.backend_version} · model {_short(m.model_digest)} · tokenizer "
            f"{_short(m.tokenizer_digest)} · format {m.prompt_format} · template {_short(m.prompt_template_digest)} · "
            f"runtime {_short(m.runtime_digest)} · bos {'yes' if m.add_bos else 'no'}"
            + (f" · profile {m.profile_id}" if m.profile_id else "")
        )
        out.append(
            f"  stable {m.stable_bytes} bytes (bytes {_short(m.stable_byte_hash)}, tokens {_short(m.stable_token_hash)}) · "
            f"total {m.total_bytes} bytes · volatile tokens {_short(m.volatile_token_hash)}"
        )
        if m.segments:
            rows = [("  KIND", "TOKENS", "BYTES", "STABLE", "CLASS", "HASH")]
            for s in m.segments:
                tokens = f"{s.token_start}-{s.token_end}" if s.token_start is not None else "?"
                rows.append(
                    (
                        f"  {s.kind}",
                        tokens,
                        f"{s.byte_start}-{s.byte_end}",
                        "yes" if s.stable else "no",
                        s.cache_class or "-",
                        _short(s.hash),
                    )
                )
            if r.tools_token_start is not None and r.tools_token_end is not None:
                # Not a segment of the text: the template renders tools_json (often the largest part).
                rows.append(
                    ("  tools", f"{r.tools_token_start}-{r.tools_token_end}", "(template)", "yes", "-", "-")
                )
            out.append("segments")
            out.append(_table(rows))
    if r.last_reuse is not None:
        d = r.last_reuse
        out.append(
            f"last ensure_prefix: {d.outcome.upper()} ({d.reason}{': ' + d.field if d.field else ''}) - {d.message}"
        )
        if d.diverged_at_token is not None:
            out.append(
                f"  diverged at token {d.diverged_at_token}"
                + (f", byte {d.diverged_at_byte}" if d.diverged_at_byte is not None else "")
                + (f", in segment {d.diverged_segment!r}" if d.diverged_segment else "")
            )
        if r.last_prefix is not None:
            p = r.last_prefix
            out.append(
                f"  reused {p.reused_tokens} · prefilled {p.prefilled_tokens} · dropped {p.dropped_tokens}"
            )
    else:
        out.append("last ensure_prefix: none yet")
    for c in r.changing_segments:
        out.append(
            f"likely cause of repeated misses: stable segment {c.kind!r} #{c.position} (segment {c.index}) "
            f"changed on each of the last {c.turns} prefixes; move what changes (a timestamp, a request id) "
            "into the volatile suffix"
        )
    out.extend(_warm_state_lines(r))
    return "\n".join(out)


_COLD_WHY = {
    "empty_cache": "nothing compatible was warm",
    "engine_reset": "the engine's state was lost (a failed operation or a worker restart)",
    "manifest_changed": "a runtime field of the manifest changed, so no warm context was compatible",
    "truncation_unsupported": "the model's memory cannot be cut inside a warm context",
    "snapshot_rejected": "the snapshot that would have served was refused and removed",
    "diverged": "the prefix differs from every warm context from its first token",
}


def _warm_state_lines(r: ContextReport) -> list[str]:
    """Where the session's warm context lives, why its last turn was warm, restored or cold, its
    place in the model's queue, pin and keep-alive, and the server-side timings."""
    from modeld.observe.views import age, format_bytes, table

    now = time.time()
    out = ["warm state"]
    own = next((c for c in r.contexts if c.id == r.context_id), None) if r.context_id else None
    where = (
        f"context {own.id} in the {own.tier} tier ({own.tokens} tokens, {format_bytes(own.bytes)})"
        if own is not None
        else "no warm context in the KV now"
        + (" (closed)" if r.closed else " (the next operation restores or recomputes it)")
    )
    keep = (
        f"keep-alive {_num(r.keep_alive_seconds)}s"
        if r.keep_alive_seconds
        else "kept until the pool needs room"
    )
    out.append(f"  this session  {where} · {'pinned' if r.pinned else 'not pinned'} · {keep}")
    d, p = r.last_reuse, r.last_prefix
    if d is not None:
        if d.reason == "restored_from_shared" or (d.outcome != "cold" and d.tier == "shared"):
            turn = f"{d.outcome}: restored from the shared store (snapshot {d.context or '?'}, written by this or another box)"
        elif d.reason in ("restored_from_ram", "restored_from_disk") or (
            d.outcome != "cold" and d.tier in ("ram", "disk")
        ):
            turn = f"{d.outcome}: restored from the {d.tier} tier (snapshot {d.context or '?'})"
        elif d.outcome != "cold":
            turn = f"{d.outcome}: reused from the KV" + (f" (warm context {d.context})" if d.context else "")
        elif d.reason == "evicted":
            went = f"evicted to the {d.tier} tier" if d.tier in ("ram", "disk") else "evicted and dropped"
            turn = f"cold: this session's warm context had been {went}"
        else:
            turn = f"cold: {_COLD_WHY.get(d.reason, d.reason)}"
        if p is not None:
            turn += f" · reused {p.reused_tokens} of {p.prefix_tokens} tokens · prefill {p.prefill_ms:.1f} ms"
            if p.restore_ms or d.tier in ("ram", "disk", "shared"):
                turn += f" · restore {p.restore_ms:.1f} ms"
        out.append(f"  last turn     {turn}")
    if r.queue_position:
        out.append(
            f"  queue         waiting for a slot: position {r.queue_position}, {r.queue_wait_seconds:.1f}s so far"
        )
    else:
        out.append(f"  queue         not waiting (last wait {r.queue_wait_seconds:.1f}s)")
    if r.contexts:
        rows = [("ID", "TIER", "TOKENS", "PREFIX", "BYTES", "SHARED", "LAST USE", "PINNED", "SESSION")]
        for c in r.contexts:
            rows.append(
                (
                    c.id + (" *" if c.id == r.context_id else ""),
                    c.tier,
                    str(c.tokens),
                    str(c.prefix_tokens),
                    format_bytes(c.bytes),
                    format_bytes(c.shared_bytes),
                    f"{age(now - c.last_used_at)} ago",
                    "yes" if c.pinned else "no",
                    c.session_id or "-",
                )
            )
        out.append("  the model's warm contexts (* this session's)")
        out.extend(table(rows, indent="    "))
    return out


def _cmd_metrics(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        text = client.metrics()
    sys.stdout.write(text)
    return 0


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


def _serve_settings(s: argparse.ArgumentParser) -> None:
    """``modeld serve``'s flags for every setting (``modeld/settings.py``, the limits); unset
    ones keep their defaults. ``modeld status`` shows the values in force."""
    from modeld.settings import ISOLATIONS

    size = "SIZE"
    w = s.add_argument_group("warm state (blueprints/0016)")
    w.add_argument(
        "--sequences", type=_count(1, 256), metavar="N", help="warm KV sequences per loaded model (default 4)"
    )
    w.add_argument(
        "--kv-unified",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one KV pool of one window shared by every sequence (default on: llama-server's layout; "
        "--no-kv-unified gives each sequence its own window, bit-exact warm output, sequences x the memory)",
    )
    w.add_argument(
        "--kv-pool-tokens",
        type=_count(0, 1 << 24),
        metavar="N",
        help="KV cells of the unified pool (default: one window)",
    )
    w.add_argument(
        "--ram-tier-bytes",
        type=parse_size,
        metavar=size,
        help="RAM tier budget, e.g. 2G (default auto: a quarter of free RAM, at most 8 GiB; 0: off)",
    )
    w.add_argument(
        "--disk-tier-bytes",
        type=parse_size,
        metavar=size,
        help="disk tier budget under the data directory (default auto: a tenth of free space, at most 32 GiB; 0: off)",
    )
    w.add_argument(
        "--memory-budget",
        type=parse_size,
        metavar=size,
        help="the loaded models (weights, KV, compute) and the RAM tier; beyond it the RAM tier spills to disk, then "
        "idle models are unloaded (default auto: 90%% of RAM)",
    )
    w.add_argument(
        "--isolation",
        choices=ISOLATIONS,
        help="process: each model in a supervised worker; inline: in the daemon (default auto: inline "
        "for memory, else process)",
    )
    w.add_argument(
        "--slots",
        type=_count(0, 4096),
        metavar="N",
        help="operations a model runs at once (default 0: as many as sequences)",
    )
    w.add_argument(
        "--max-queue",
        type=_count(0, 1 << 16),
        metavar="N",
        help="operations that may wait for one model (default 64)",
    )
    w.add_argument(
        "--snapshot-min-tokens",
        type=_count(0, 1 << 24),
        metavar="N",
        help="shorter contexts are not snapshotted (64)",
    )
    w.add_argument(
        "--persist-min-tokens",
        type=_count(0, 1 << 24),
        metavar="N",
        help="a prefix this long is written to the disk tier at once (512)",
    )
    f = s.add_argument_group("fleet (blueprints/0020)")
    f.add_argument(
        "--shared-store",
        metavar="DIR",
        help="a directory several daemons mount (NFS, a shared volume): persisted snapshots are "
        "written through to it and a miss looks there, so a conversation moved to another box restores",
    )
    f.add_argument(
        "--shared-store-bytes",
        type=parse_size,
        metavar=size,
        help="the shared store's budget, the same on every daemon (default auto: a tenth of its free "
        "space, at most 64 GiB)",
    )
    f.add_argument(
        "--drain-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="on SIGTERM or modeld drain, how long running turns may finish before the daemon "
        "persists its warm contexts and exits (60)",
    )
    t = s.add_argument_group("timeouts (0 switches one off; 90, 2.5m, 1h)")
    t.add_argument("--load-timeout", type=parse_duration, metavar="DURATION", help="loading a model (600)")
    t.add_argument(
        "--stall-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="a busy worker without progress and CPU time is killed (120)",
    )
    t.add_argument(
        "--idle-stream-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="a decode without a token (300)",
    )
    t.add_argument(
        "--operation-timeout", type=parse_duration, metavar="DURATION", help="any one operation (default off)"
    )
    t.add_argument(
        "--stream-interval",
        type=parse_duration,
        metavar="DURATION",
        help="a decode's tokens that come faster than this are streamed together (50ms; 0: each token alone)",
    )
    t.add_argument(
        "--queue-wait",
        type=parse_duration,
        metavar="DURATION",
        help="how long an operation waits for a busy model before 'busy' (300)",
    )
    t.add_argument(
        "--attach-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="an opened session without a Session stream is closed (30)",
    )
    t.add_argument(
        "--describe-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="Describe gives up on a model file that takes longer to read (30)",
    )
    r = s.add_argument_group("worker restarts")
    r.add_argument(
        "--restart-backoff", type=parse_duration, metavar="DURATION", help="first restart delay (0.5)"
    )
    r.add_argument(
        "--restart-backoff-max", type=parse_duration, metavar="DURATION", help="longest restart delay (30)"
    )
    r.add_argument(
        "--crash-limit",
        type=_count(1, 1000),
        metavar="N",
        help="deaths within the crash window that mark a model failed (5)",
    )
    r.add_argument("--crash-window", type=parse_duration, metavar="DURATION", help="(300)")
    lim = s.add_argument_group("limits (blueprints/0006)")
    lim.add_argument("--max-sessions", type=_count(1, 100_000), metavar="N", help="open sessions (64)")
    lim.add_argument("--max-text-bytes", type=parse_positive_size, metavar=size, help="text of one call (8M)")
    lim.add_argument(
        "--max-message-bytes", type=parse_positive_size, metavar=size, help="one gRPC message (16M)"
    )
    lim.add_argument("--max-loaded-models", type=_count(1, 1024), metavar="N", help="models kept loaded (2)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="modeld", description="Local warm-prefix inference daemon.")
    _global_options(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the daemon")
    _global_options(s, top=False)
    s.add_argument("--backend", choices=BACKEND_TYPES, default="llama")
    s.add_argument(
        "--listen",
        help="unix:PATH or HOST:PORT (default: a unix socket under XDG_RUNTIME_DIR or the cache directory)",
    )
    s.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible API there (needs modeld[http]); e.g. 127.0.0.1:8080",
    )
    s.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on the HTTP API (default: MODELD_API_KEY; "
        "required off loopback)",
    )
    s.add_argument(
        "--model",
        action="append",
        metavar="NAME=PATH",
        help="a model the HTTP API serves under NAME (repeatable; default: the generated tiny model)",
    )
    s.add_argument("--models-dir", metavar="DIR", help="serve every model file in DIR under its file name")
    s.add_argument(
        "--num-ctx",
        type=int,
        default=0,
        help="context window of HTTP sessions (default: the model's own, as large as the memory budget allows)",
    )
    s.add_argument(
        "--max-output-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the output limit of an HTTP request that sets none (llama-server's -n; Codex CLI sends none); "
        "default: up to the window",
    )
    s.add_argument(
        "--allow-origin",
        action="append",
        metavar="ORIGIN",
        help="a web origin (e.g. https://app.example) whose pages may call the HTTP API (repeatable; "
        "loopback http(s) origins always may, others never)",
    )
    s.add_argument(
        "--kv-cache-type",
        default="f16",
        choices=KV_CACHE_TYPES,
        help="KV precision of HTTP sessions, as llama-server's -ctk/-ctv (q8_0: about half the KV memory; "
        "turns flash attention on; blueprint 0016)",
    )
    s.add_argument(
        "--flash-attn",
        action="store_true",
        help="flash attention for HTTP sessions (a smaller compute buffer at long windows; default off)",
    )
    s.add_argument(
        "--speculation",
        default="ngram",
        choices=("off", "ngram"),
        help="ngram (default): draft tokens from the context (prompt lookup) and append the tokens a "
        "constraint forces, verified in one batch, output unchanged; off: one token per step. A request "
        "may choose with DecodeConfig.speculation or the HTTP field 'speculation' (blueprint 0021)",
    )
    s.add_argument(
        "--no-token",
        action="store_true",
        help="let a TCP gRPC listener run without its token (any local user can then drive the daemon)",
    )
    s.add_argument("--takeover", action="store_true", help="replace the daemon that owns the machine")
    s.add_argument(
        "--takeover-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the old owner before signalling it",
    )
    s.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --listen/--http address (token / API key required; no TLS)",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _serve_settings(s)
    s.set_defaults(func=_cmd_serve)

    d = sub.add_parser("describe", help="what a model is and can do on this machine (no daemon needed)")
    _global_options(d, top=False)
    d.add_argument("--type", required=True, choices=BACKEND_TYPES)
    d.add_argument("--path", required=True)
    d.add_argument("--digest", help="expected model digest")
    d.add_argument("--num-ctx", type=int, default=Config().num_ctx)
    d.add_argument("--kv-cache-type", default="f16", choices=KV_CACHE_TYPES)
    d.add_argument(
        "--flash-attn", action="store_true", help="size for flash attention (needed by a q8_0/q4_0 KV cache)"
    )
    d.add_argument("--sequences", type=_count(1, 256), metavar="N", help="as modeld serve's")
    d.add_argument(
        "--kv-unified", action=argparse.BooleanOptionalAction, default=None, help="as modeld serve's"
    )
    d.add_argument("--kv-pool-tokens", type=_count(0, 1 << 24), metavar="N", help="as modeld serve's")
    d.add_argument(
        "--memory-budget", type=parse_size, metavar="SIZE", help="as modeld serve's (default: 90%% of RAM)"
    )
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
