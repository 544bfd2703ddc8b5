"""Settings of the daemon, in one typed place: each field is its own ``modeld serve`` flag, and
``modeld serve --help`` is this list (the command line adds only ``--address``/``--data-dir``).

``modeld serve`` sets them from its flags (each field's flag, parser and group are its
metadata, its docstring is the help and its default the default, written here once: adding a
setting touches one field, ``modeld/flags.py``) and ``modeld status`` shows them. The daemon
and its gRPC listener are :class:`Serving`, the HTTP APIs :class:`HttpSettings`, where warm
state lives :class:`Residency`, the timeout profile :class:`Timeouts`, worker restarts
:class:`RestartPolicy` and the limits on client input :class:`Limits` (blueprint 0006). Every
default of the warm state is chosen from a measurement recorded in
``blueprints/0016-warm-state.md``.

What not: true protocol or format constants (the Unix socket path length, a snapshot file's
header bound, GGUF header bounds, grammar engine bounds, HTTP request shape bounds): they stay
beside the code that reads them, fixed, and blueprint 0006 lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from modeld.contract import BACKEND_TYPES, KV_CACHE_TYPES, SPECULATION_MODES, TOOL_FORMATS, Config
from modeld.errors import LimitExceededError
from modeld.flags import count, flag_name, parse_duration, parse_positive_size, parse_size, setting

__all__ = [
    "ISOLATIONS",
    "LOG_LEVELS",
    "SETTINGS",
    "HttpSettings",
    "Limits",
    "RequestRecords",
    "Residency",
    "RestartPolicy",
    "Serving",
    "Timeouts",
    "parse_tool_formats",
]

ISOLATIONS = ("auto", "process", "inline")
LOG_LEVELS = ("debug", "info", "warning", "error")
MiB = 1 << 20

_SERVING = "serving (gRPC, the owner lease)"
_HTTP = "HTTP APIs (blueprints/0014, 0019)"
_WARM = "warm state (blueprints/0016)"
_FLEET = "fleet (blueprints/0020)"
_TIMEOUTS = "timeouts (0 switches one off; 90, 2.5m, 1h)"
_RESTARTS = "worker restarts"
_LIMITS = "limits (blueprints/0006)"
_RECORDS = "request records and the live page (blueprints/0022)"


@dataclass(frozen=True, slots=True)
class Serving:
    """The daemon: the engine it runs, where gRPC listens, the owner lease, its log."""

    backend: str = setting("llama", "--backend", _SERVING, choices=BACKEND_TYPES)
    """The engine every model runs on: llama (GGUF files through llama.cpp), openvino (OpenVINO
    GenAI) or memory (the reference backend, one token per byte)."""
    listen: str = setting("", "--listen", _SERVING, metavar="unix:PATH|HOST:PORT")
    """Where gRPC listens: unix:PATH or HOST:PORT ("": a unix socket under XDG_RUNTIME_DIR or
    the cache directory)."""
    token: bool = setting(True, "--token", _SERVING)
    """A TCP gRPC listener requires the token the daemon writes to its data directory; off
    (--no-token): it runs without one, and any local user can then drive the daemon."""
    allow_remote: bool = setting(False, "--allow-remote", _SERVING)
    """Allow a non-loopback --listen or --http address (a token or an API key is then
    required; no TLS)."""
    takeover: bool = setting(False, "--takeover", _SERVING)
    """Replace the daemon that owns the data directory (its sessions fail with stale_fence)."""
    takeover_seconds: float = setting(10.0, "--takeover-timeout", _SERVING, parse_duration)
    """How long a takeover waits for the old owner to let go before signalling it."""
    describe_seconds: float = setting(30.0, "--describe-timeout", _TIMEOUTS, parse_duration)
    """Describing a model (gRPC Describe, the HTTP APIs' model lists) gives up on a model file
    that takes longer to read (model_load_failed)."""
    speculation: str = setting("ngram", "--speculation", _SERVING, choices=SPECULATION_MODES)
    """ngram: draft tokens from the context (prompt lookup) and append the tokens a constraint
    forces, verified in one batch, output unchanged; off: one token per step. A request may
    choose with DecodeConfig.speculation or the HTTP field 'speculation' (blueprint 0021)."""
    log_level: str = setting("info", "--log-level", _SERVING, choices=LOG_LEVELS)
    """The daemon's log level, and its engine workers' (debug: llama.cpp's own lines too, in
    modeld logs)."""


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """The HTTP APIs (OpenAI, Responses, Anthropic, Ollama, the SGLang gateway's worker routes):
    where they listen, who may call them, the models they serve and the sessions they open."""

    http: str = setting("", "--http", _HTTP, metavar="HOST:PORT")
    """Also serve the HTTP APIs there (needs modeld[http]), e.g. 127.0.0.1:8080 ("": none)."""
    api_key: str = setting("", "--api-key", _HTTP, metavar="KEY")
    """Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on the HTTP APIs ("":
    MODELD_API_KEY, else none; a key is required off loopback)."""
    models: tuple[str, ...] = setting((), "--model", _HTTP, metavar="NAME=PATH", repeat=True)
    """A model the HTTP APIs serve under NAME (repeatable; none: the generated modeld-tiny,
    modeld-reply and modeld-tools)."""
    models_dir: str = setting("", "--models-dir", _HTTP, metavar="DIR")
    """Serve every model file in DIR under its file name (read again on an unknown name)."""
    num_ctx: int = setting(0, "--num-ctx", _HTTP, count(0, 1 << 24))
    """Context window of HTTP sessions (0: the model's own, as large as the memory budget allows)."""
    max_output_tokens: int = setting(0, "--max-output-tokens", _HTTP, count(0, 1 << 30))
    """The output limit of an HTTP request that sets none (llama-server's -n; Codex CLI sends
    none); 0: up to the window."""
    allowed_origins: tuple[str, ...] = setting((), "--allow-origin", _HTTP, metavar="ORIGIN", repeat=True)
    """A web origin (e.g. https://app.example) whose pages may call the HTTP APIs (repeatable;
    loopback http(s) origins always may, others never)."""
    kv_cache_type: str = setting(Config().kv_cache_type, "--kv-cache-type", _HTTP, choices=KV_CACHE_TYPES)
    """KV precision of HTTP sessions, as llama-server's -ctk/-ctv (q8_0: about half the KV
    memory; turns flash attention on; blueprint 0016)."""
    flash_attn: bool = setting(Config().flash_attn, "--flash-attn", _HTTP)
    """Flash attention for HTTP sessions (a smaller compute buffer at long windows; on by
    itself for a quantized KV cache)."""
    max_inflight_bytes: int = setting(64 * MiB, "--max-inflight-bytes", _HTTP, parse_positive_size)
    """Bytes of HTTP request bodies held at once; a request beyond them gets 503 with
    Retry-After (one body is at most --max-message-bytes)."""
    max_conversations: int = setting(16, "--max-conversations", _HTTP, count(1, 4096))
    """Conversations kept on sessions of their own; beyond them the least recently used idle
    one's session is closed."""
    conversation_idle_seconds: float = setting(600.0, "--conversation-idle", _HTTP, parse_duration)
    """A conversation idle this long has its session closed (0: never)."""
    chat_templates: tuple[str, ...] = setting(
        (), "--chat-template-file", _HTTP, metavar="NAME=PATH", repeat=True
    )
    """Render the model served as NAME with the Jinja chat template in PATH instead of its
    file's (repeatable; llama-server's --chat-template-file, per model)."""
    tool_formats: tuple[str, ...] = setting((), "--tool-format", _HTTP, metavar="NAME=FORMAT", repeat=True)
    """The tool-call format of the model served as NAME, instead of the one recognised from its
    chat template (repeatable; a family such as hermes, qwen3_coder, harmony, glm45; none: no
    calls are parsed; blueprint 0018 lists them)."""
    keepalive_seconds: float = setting(10.0, "--keepalive-interval", _HTTP, parse_duration)
    """A stream silent this long (a long prefill, hidden thinking) gets a keep-alive in its API's
    form: Anthropic's ping, an SSE comment with the prefill's progress, Responses'
    response.in_progress, an empty Ollama line (0: never). Claude Code warns after 30 s without
    a byte; llama-server's --sse-ping-interval is 30 s."""
    fit_tool_results: bool = setting(True, "--fit-tool-results", _HTTP)
    """An Anthropic Messages prompt beyond the window has its tool results cut, oldest first,
    until it fits, each marked where it was cut and listed in the answer's
    modeld.omitted_content, instead of the 400 'prompt is too long' (Claude Code's compaction
    request carries its tools and every tool result, so one tool result near the window ends
    the session for good). On by default: it changes only prompts that would be refused, and a
    prompt with no tool result to cut is still refused in Claude Code's words, which it compacts
    on (--no-fit-tool-results: always refuse)."""
    prefill_ahead: bool = setting(True, "--prefill-ahead", _HTTP)
    """When an answer ends without a tool call, compute the prefix of the conversation's next
    turn (the conversation with that answer as history, as the model's template renders it once
    a user message follows) while the user reads: templates that render earlier turns otherwise
    then (Qwen3 and others drop earlier reasoning) cost the next turn nothing extra. The next
    request waits for it if it comes first. It has a request record of its own (finish 'ahead')
    and explain-context shows it beside the turn's own reuse. --no-prefill-ahead: each turn
    computes what it needs itself (a regenerated answer then stays warm up to its prompt)."""
    aliases: tuple[str, ...] = setting((), "--alias", _HTTP, metavar="PATTERN=MODEL", repeat=True)
    """Requests for a model name matching the glob PATTERN are served by MODEL (repeatable, first
    match wins), e.g. 'claude-*=modeld-reply' or 'gpt-*=modeld-reply', so an agent's default
    model names work with no client setting; /v1/models lists the patterns."""


def parse_tool_formats(specs: tuple[str, ...]) -> dict[str, str]:
    """``--tool-format NAME=FORMAT`` values as {name: format}; ValueError names a bad one (FORMAT
    not one of ``TOOL_FORMATS``, a name given twice)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, fmt = spec.partition("=")
        if not sep or not name or not fmt or fmt not in TOOL_FORMATS:
            known = ", ".join(f for f in TOOL_FORMATS if f)
            raise ValueError(f"--tool-format wants NAME=FORMAT with FORMAT one of {known}, got {spec!r}")
        if name in out:
            raise ValueError(f"--tool-format {name} is given twice")
        out[name] = fmt
    return out


@dataclass(frozen=True, slots=True)
class Residency:
    """Where warm state lives, and how much of it."""

    sequences: int = setting(4, "--sequences", _WARM, count(1, 256))
    """Warm KV sequences per loaded model (each session's turn runs on its own)."""
    kv_unified: bool = setting(True, "--kv-unified", _WARM)
    """One KV pool shared by every sequence (llama.cpp ``kv_unified``, llama-server's default):
    any sequence may grow to the whole pool, a copied prefix is stored once, and the pool is
    one window, so a model takes one window of KV however many sequences it keeps warm (more
    warm contexts live in the RAM and disk tiers). Warm output is bit-identical to a fresh
    evaluation while a context is alone in the pool and can differ when contexts share it (the
    attention sums in another order); ``explain-context`` says which. Off: each sequence has its own window of
    cells (``sequences`` windows of memory), and warm output is bit-identical by construction.
    Chosen by measurement: blueprint 0016."""
    checkpoints: int = setting(8, "--checkpoints", _WARM, count(0, 256))
    """Checkpoints kept per warm sequence of a recurrent, hybrid or sliding-window model: its
    state at a token position (a segment or message start, a turn start, every few batches, a
    prompt's end), so an edit inside the prefix goes back to the last one before it instead of
    prefilling everything, after a restart or on another box too (they travel in snapshots).
    Each holds the model's recurrent state, or a sliding window's KV (``modeld describe``:
    checkpoints); counted in the memory budget. 0: none."""
    swa_full: bool = setting(True, "--swa-full", _WARM)
    """Sliding-window models (Gemma 3, gpt-oss) keep every token's KV in their local layers too
    (llama.cpp's full-size SWA cache): a warm context is cut at any token and its output is a
    fresh evaluation's. ``--no-swa-full``: the local layers keep a ring of about a window per
    sequence (llama-server's default), less memory (``modeld describe`` shows both), and cuts
    fall back to checkpoints (blueprint 0016, "Sliding windows")."""
    pool_tokens: int = setting(0, "--kv-pool-tokens", _WARM, count(0, 1 << 24))
    """With ``kv_unified``: KV cells in the pool (0: one window; a smaller pool caps the window).
    A pool of at least ``sequences`` windows is laid out as split streams: sharing it gains no
    room, and concurrent turns then attend only over their own cells (blueprint 0016)."""
    ram_tier_bytes: int = setting(-1, "--ram-tier-bytes", _WARM, parse_size)
    """RAM tier budget; -1 (``auto``): a quarter of the RAM available at start (at most 8 GiB); 0: off."""
    disk_tier_bytes: int = setting(-1, "--disk-tier-bytes", _WARM, parse_size)
    """Disk tier budget under the data directory; -1 (``auto``): a tenth of its free space (at most
    32 GiB); 0: off."""
    memory_budget_bytes: int = setting(-1, "--memory-budget", _WARM, parse_size)
    """The loaded models (weights, KV, compute) and the RAM tier; beyond it the RAM tier spills
    to disk, then the least recently used idle model is unloaded (its warm contexts saved to the
    tiers first). -1 (``auto``): 90% of the machine's RAM."""
    isolation: str = setting("auto", "--isolation", _WARM, choices=ISOLATIONS)
    """``process``: each loaded model runs in a supervised worker process; ``inline``: in the
    daemon (only sensible for the memory backend); ``auto``: inline for memory, else process."""
    slots: int = setting(0, "--slots", _WARM, count(0, 4096))
    """Operations a model runs at once (0: as many as ``sequences``)."""
    max_queue: int = setting(64, "--max-queue", _WARM, count(0, 1 << 16))
    """Operations that may wait for a slot of one model."""
    snapshot_min_tokens: int = setting(64, "--snapshot-min-tokens", _WARM, count(0, 1 << 24))
    """Shorter warm contexts are not worth a snapshot."""
    persist_min_tokens: int = setting(512, "--persist-min-tokens", _WARM, count(0, 1 << 24))
    """A prefix this long, just computed, is written to the disk tier at once."""
    shared_store: str = setting("", "--shared-store", _FLEET, metavar="DIR")
    """A directory several daemons mount (NFS, a shared volume): persisted snapshots are written
    through to it and a miss looks there, so a conversation moved to another box restores
    (blueprint 0020). "": none."""
    shared_store_bytes: int = setting(-1, "--shared-store-bytes", _FLEET, parse_size)
    """The shared store's budget; -1 (``auto``): a tenth of its file system's free space (at most 64
    GiB); give every daemon of a fleet the same value."""

    def as_dict(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Timeouts:
    """The daemon's timeout profile (``modeld serve`` flags; 0 switches one off)."""

    load_seconds: float = setting(600.0, "--load-timeout", _TIMEOUTS, parse_duration)
    """Loading a model (the worker's answer to ``Load``)."""
    stall_seconds: float = setting(120.0, "--stall-timeout", _TIMEOUTS, parse_duration)
    """A busy worker with no progress and no CPU time for this long is killed (``stall_timeout``)."""
    idle_stream_seconds: float = setting(300.0, "--idle-stream-timeout", _TIMEOUTS, parse_duration)
    """A decode that produces no token for this long is stopped (``timeout``)."""
    operation_seconds: float = setting(0.0, "--operation-timeout", _TIMEOUTS, parse_duration)
    """Any one operation (prefill or decode) longer than this is stopped (``timeout``); off by default."""
    drain_seconds: float = setting(60.0, "--drain-timeout", _FLEET, parse_duration)
    """On SIGTERM or ``modeld drain``: how long turns already running may take to finish before
    the daemon persists its warm contexts and exits (new turns get 503 at once; blueprint 0020)."""
    stream_interval_seconds: float = setting(0.05, "--stream-interval", _TIMEOUTS, parse_duration)
    """A decode's tokens that come faster than this are streamed together, each at most this
    late (the first at once); 0: every token on its own. Each message costs the daemon and its
    client CPU that the engine's threads lose: 50 ms is 20 updates a second and measured
    decode tok/s over gRPC at 0.97 of direct llama.cpp, against 0.93 token by token
    (blueprint 0017)."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a dead engine worker is restarted (blueprint 0017)."""

    backoff_initial: float = setting(0.5, "--restart-backoff", _RESTARTS, parse_duration)
    """The first restart's delay; each further one doubles it."""
    backoff_max: float = setting(30.0, "--restart-backoff-max", _RESTARTS, parse_duration)
    """The longest restart delay."""
    crash_limit: int = setting(5, "--crash-limit", _RESTARTS, count(1, 1000))
    """Deaths within the crash window that mark a model failed."""
    crash_window: float = setting(300.0, "--crash-window", _RESTARTS, parse_duration)
    """The window the crash limit counts deaths in."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Explicit limits on client input and on what the daemon holds (blueprint 0006). Beyond a
    limit the caller gets :class:`~modeld.errors.LimitExceededError` (or
    ``InvalidArgumentError`` for a malformed value) and the daemon keeps serving. Text limits
    count UTF-8 bytes."""

    max_sessions: int = setting(64, "--max-sessions", _LIMITS, count(1, 100_000))
    """Open sessions at once (attached or not)."""
    max_text_bytes: int = setting(8 * MiB, "--max-text-bytes", _LIMITS, parse_positive_size)
    """Text of one call: prefix text + tools JSON, or suffix text."""
    max_message_bytes: int = setting(16 * MiB, "--max-message-bytes", _LIMITS, parse_positive_size)
    """One gRPC message, either direction (must exceed max_text_bytes plus the manifest)."""
    max_segments: int = setting(4096, "--max-segments", _LIMITS, count(1, 1 << 20))
    """Segments in one manifest."""
    max_string_bytes: int = setting(4096, "--max-string-bytes", _LIMITS, count(256, 1 << 20))
    """Any name, path, digest, stop string or extra value."""
    max_stop_strings: int = setting(16, "--max-stop-strings", _LIMITS, count(0, 1024))
    """Stop strings of one decode."""
    max_extra_entries: int = setting(32, "--max-extra-entries", _LIMITS, count(0, 1024))
    """Extra (backend-specific) entries of one decode."""
    max_messages: int = setting(4096, "--max-messages", _LIMITS, count(1, 1 << 20))
    """Messages of one HTTP request (chat messages, Responses input items, one message's content blocks)."""
    max_tools: int = setting(256, "--max-tools", _LIMITS, count(1, 1 << 16))
    """Tool definitions of one HTTP request, and of one decode."""
    max_choices: int = setting(8, "--max-choices", _LIMITS, count(1, 256))
    """Choices (``n``) of one decode."""
    max_constraint_bytes: int = setting(256 << 10, "--max-constraint-bytes", _LIMITS, parse_positive_size)
    """Constraint text of one decode: a JSON schema, regex or grammar (or the grammar of a forced tool call)."""
    max_context_tokens: int = setting(1 << 20, "--max-context-tokens", _LIMITS, count(1, 1 << 24))
    """Largest num_ctx a session may ask for (the model and memory may allow less)."""
    max_loaded_models: int = setting(2, "--max-loaded-models", _LIMITS, count(1, 1024))
    """Models kept loaded; the least recently used idle one is unloaded beyond this."""
    model_wait_seconds: float = setting(300.0, "--queue-wait", _TIMEOUTS, parse_duration)
    """How long an operation waits for a model busy with other sessions (a slot, or KV cells
    that running operations hold) before ``busy``."""
    attach_timeout_seconds: float = setting(30.0, "--attach-timeout", _TIMEOUTS, parse_duration)
    """How long an opened session may stay without a Session stream before it is closed."""
    closed_reports_kept: int = setting(64, "--closed-reports-kept", _LIMITS, count(0, 1 << 16))
    """Closed sessions whose last report stays visible to explain-context."""

    def as_dict(self) -> dict[str, int | float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check(self, name: str, value: int, what: str) -> None:
        """``value`` (a count of ``what``) within the limit ``name``, else ``limit_exceeded``
        naming it (and the flag that raises it)."""
        maximum = getattr(self, name)
        if value > maximum:
            raise LimitExceededError(
                f"{value} {what}; the limit is {maximum} (modeld serve {flag_name(Limits, name)})",
                limit=name,
                value=value,
                maximum=maximum,
            )


@dataclass(frozen=True, slots=True)
class RequestRecords:
    """Request records (one per turn, every API and gRPC) and the live page at ``/ui``."""

    records_kept: int = setting(4096, "--records-kept", _RECORDS, count(1, 1 << 20))
    """Records kept in memory (the page, ``/v1/requests``, ``modeld top``); older ones are read
    from the file."""
    records_max_age_seconds: float = setting(7 * 86400.0, "--records-max-age", _RECORDS, parse_duration)
    """Records older than this leave the file under the data directory (0: kept until the
    byte budget needs the room)."""
    records_max_bytes: int = setting(64 * MiB, "--records-max-bytes", _RECORDS, parse_size)
    """The records file's byte budget (the oldest go first; 0: no file, memory only)."""
    ui_show_prompts: bool = setting(False, "--ui-show-prompts", _RECORDS)
    """Keep a slice of the prompt where a prefix diverged in its record, shown on the page and
    in /v1/requests (off: ids, token counts and segment kinds only, never prompt text)."""


SETTINGS: tuple[type, ...] = (
    Serving,
    HttpSettings,
    Residency,
    Timeouts,
    RestartPolicy,
    Limits,
    RequestRecords,
)
"""Every settings dataclass; each of their fields is one ``modeld serve`` flag."""
