"""The modeld contract: the value types and the Service/Session protocols every backend,
the engine and the runtime client implement.

The seam is ``ensure_prefix -> prefill_suffix -> decode`` (see
``blueprints/0001-the-seam.md``). Its invariants, which the contract suite in
``tests/contract/`` checks against every implementation and over the wire:

* ``ensure_prefix(p)`` makes the session's resident context equal to ``p`` (tokenized with the
  model's tokenizer and BOS policy). It reuses the longest common token prefix with what is
  resident in the engine *if and only if* the manifests are runtime-compatible, prefills the
  rest, and drops everything after the reused part (an old suffix, generated tokens, a
  diverging tail). ``reused + prefilled == prefix_tokens`` always. An incompatible manifest is a
  cold miss with the differing field as its reason, never an error and never a silent reuse.
* ``prefill_suffix(s)`` makes the resident context ``prefix + s``, replacing any earlier suffix
  and generated tokens. It needs a prefix first (:class:`~modeld.errors.PrefixRequiredError`).
* ``decode(cfg)`` generates from the resident context and streams text deltas that never split
  a UTF-8 character. The last chunk carries ``finish_reason`` and ``usage``. Generated tokens
  become resident; the next ``ensure_prefix`` drops them.
* Overflow of the context window raises :class:`~modeld.errors.ContextOverflowError` before
  anything resident changes.
* After ``close()`` every operation but ``explain_context`` and ``close`` raises
  :class:`~modeld.errors.SessionClosedError`. The KV a closed session leaves behind stays
  reusable by later sessions with a compatible manifest.

What not: what the daemon shows about itself (``modeld status``, ListSessions): those
telemetry types live in ``modeld/observe/status.py``; this module keeps what a Service and a
Session speak.

Types are frozen dataclasses; a backend's differences show as :class:`Capabilities`, never as
backend-specific fields on shared types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Protocol, Self, runtime_checkable

from modeld.manifest import ContextManifest

__all__ = [
    "BACKEND_TYPES",
    "FINISH_REASONS",
    "KV_CACHE_TYPES",
    "PROMPT_FORMATS",
    "REUSE_OUTCOMES",
    "REUSE_REASONS",
    "SPECULATION_MODES",
    "AsyncClosing",
    "AsyncDecodeStream",
    "AsyncService",
    "AsyncSession",
    "BackendType",
    "CONSTRAINT_KINDS",
    "TOOL_CHOICES",
    "TOOL_FORMATS",
    "Closing",
    "Constraint",
    "Footprint",
    "SpecialToken",
    "TokenLogprob",
    "TopLogprob",
    "ToolCall",
    "ToolCallDelta",
    "PrefillProgress",
    "ProgressCallback",
    "WarmContextInfo",
    "TIERS",
    "Capabilities",
    "Config",
    "ContextReport",
    "ChangingSegment",
    "DecodeConfig",
    "DecodeStream",
    "ErrorDetail",
    "Fence",
    "FinishReason",
    "ModelInfo",
    "OpenSessionRequest",
    "PrefixInput",
    "PrefixStatus",
    "ReuseDecision",
    "Service",
    "Session",
    "StreamChunk",
    "SuffixInput",
    "SuffixStatus",
    "Usage",
]

BackendType = Literal["llama", "openvino", "memory"]
BACKEND_TYPES: tuple[str, ...] = ("llama", "openvino", "memory")

SPECULATION_MODES: tuple[str, ...] = ("off", "ngram")
"""``DecodeConfig.speculation`` values (besides ``""``: the daemon's ``--speculation``)."""

FinishReason = Literal[
    "stop",
    "length",
    "stop_sequence",
    "canceled",
    "error",
    "tool_calls",
    "malformed_tool_call",
    "signal",
    "constraint_failed",
    "repeated_line",
]
FINISH_REASONS: tuple[str, ...] = (
    "stop",  # the model ended its turn
    "length",  # max_tokens or the context window
    "stop_sequence",  # a stop string appeared (it is not in the text)
    "canceled",  # the client cancelled
    "error",  # see StreamChunk.error
    "tool_calls",  # the model called tools: StreamChunk.tool_calls on the final chunk
    "malformed_tool_call",  # the model started a tool call that does not parse (the text keeps it)
    "signal",  # the model called an exit tool: StreamChunk.signal on the final chunk
    "constraint_failed",  # the constraint could no longer be satisfied (the output is not valid)
    "repeated_line",  # the same long line repeated too often in a row (DecodeConfig.repeated_line_*)
)

CONSTRAINT_KINDS: tuple[str, ...] = ("json", "json_schema", "regex", "grammar")
"""``json``: any JSON object. ``json_schema``: a JSON document valid under the schema in ``value``.
``regex``: text that the regular expression matches in full. ``grammar``: a GBNF grammar (llama.cpp
syntax) with a ``root`` rule. ``blueprints/0018-constraints-and-tool-calls.md`` lists what each
backend honours."""

TOOL_CHOICES: tuple[str, ...] = ("auto", "none", "required")
"""``DecodeConfig.tool_choice``: these, or the name of one tool (forced)."""

TOOL_FORMATS: tuple[str, ...] = (
    "",
    "hermes",
    "qwen3_coder",
    "harmony",
    "llama3",
    "mistral",
    "mistral_args",
    "mistral_ids",
    "glm45",
    "glm47",
    "kimi_k2",
    "deepseek_v31",
    "deepseek_r1",
    "minimax_m2",
    "seed_oss",
    "nemotron",
    "gemma4",
    "lfm2",
    "granite",
    "command_r",
    "none",
)
"""How tool calls look in a model's output (one per family: ``modeld.decoding.formats``).
``""``: recognised from the chat template."""

KV_CACHE_TYPES: tuple[str, ...] = ("f16", "f32", "bf16", "q8_0", "q4_0")
PROMPT_FORMATS: tuple[str, ...] = ("raw", "chat")
"""``raw``: the text is used as given. ``chat``: the text is rendered with the model's template."""

REUSE_OUTCOMES: tuple[str, ...] = ("warm", "partial", "cold")
REUSE_REASONS: tuple[str, ...] = (
    "full_match",  # warm: every prefix token was already resident
    "extended",  # warm: the resident prefix was kept whole and new tokens appended
    "diverged",  # partial or cold: the new prefix differs from the resident one at a token
    "empty_cache",  # cold: nothing was resident for this model
    "manifest_changed",  # cold: a runtime field of the manifest differs (``field`` says which)
    "truncation_unsupported",  # cold: the model's memory cannot be cut at an arbitrary token
    "engine_reset",  # cold: the engine's state was lost (a failed operation, a worker restart)
    "restored_from_ram",  # warm: the context came back from the RAM tier (a snapshot)
    "restored_from_disk",  # warm: the context came back from the disk tier (a snapshot)
    "restored_from_shared",  # warm: the context came back from the shared store (another box's snapshot)
    "evicted",  # cold: this session's warm context was evicted (``tier`` says where it went)
    "snapshot_rejected",  # cold: a snapshot that would have served was corrupt or stale: removed
    "model_changed",  # cold: the model file holds another model than its last warm context's
)
TIERS: tuple[str, ...] = ("kv", "ram", "disk", "shared")
"""Where a warm context lives: in the engine's KV pool, or snapshotted in the RAM or disk tier,
or in the shared store several daemons mount (``serve --shared-store``)."""


NUM_BATCH = 512
"""The prefill batch of a session that leaves ``Config.num_batch`` at 0, on a backend without a
choice of its own for the model (llama.cpp's default; the llama backend's choice:
:func:`modeld.backends.base.default_batch`)."""


@dataclass(frozen=True, slots=True)
class Config:
    """Runtime configuration of a session. Fields marked (KV) are part of the runtime digest."""

    num_ctx: int = 0  # (KV) context window in tokens; 0: the model's own, as the budget allows
    num_batch: int = 0  # (KV) prefill batch size; changes chunking and so numerics; 0: the backend's
    # choice for the model (llama.cpp: 64 for attention on the CPU without flash attention, else 512)
    num_threads: int = 0  # 0 = the backend's default; speed only, not part of the digest
    num_gpu_layers: int = 0  # (KV) layers offloaded to an accelerator
    tensor_split: tuple[float, ...] = ()  # (KV) split across devices
    flash_attn: bool = False  # (KV)
    kv_cache_type: str = "f16"  # (KV) one of KV_CACHE_TYPES
    prompt_format: str = "raw"  # one of PROMPT_FORMATS
    prompt_template_digest: str = ""  # the template the client rendered with ("" = the model's)
    disable_bos: bool = False  # never add a BOS token, whatever the model says


@dataclass(frozen=True, slots=True)
class Fence:
    """The owner a client expects. Empty means "whoever owns the machine now"."""

    owner_instance_id: str = ""


@dataclass(frozen=True, slots=True)
class OpenSessionRequest:
    """Which model to open, on which backend, under which config and owner fence.

    ``type`` empty means the service's default backend. ``digest`` empty means "whatever the
    file is"; a non-empty digest that does not match the model is refused.
    """

    model_name: str = ""
    type: str = ""
    digest: str = ""
    path: str = ""
    config: Config = field(default_factory=Config)
    fence: Fence = field(default_factory=Fence)
    pin: bool = False
    """Never evict this session's warm context from the KV pool while the session is open."""
    keep_alive_seconds: float = 0.0
    """Move this session's warm context out of the KV pool (to the RAM tier) after it has been
    idle this long; 0 keeps it until the pool needs the room."""
    no_wait: bool = False
    """When every slot of the model is busy, fail with ``no_slot_available`` at once instead of
    queueing (each operation may override it)."""
    chat_template: str = ""
    """A chat template to render with instead of the model file's (llama-server's
    ``--chat-template-file``); its digest is the session's template digest. "": the file's."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, so callers never need backend-specific fields.

    ``truncation``: resident KV can be cut at any token (False for recurrent, hybrid or
    sliding-window memory, which goes back to a checkpoint or a window still held instead:
    ``Footprint.cuts``). ``reuse``: ``exact`` when modeld controls
    the KV directly, ``engine`` when the engine reuses blocks itself and modeld tracks the
    logical reuse. ``sampling``: the DecodeConfig fields honoured; others are refused.
    ``extra``: the keys of ``DecodeConfig.extra`` the backend accepts. ``constraints``: the
    :data:`CONSTRAINT_KINDS` it can enforce (others are refused with ``unsupported``).
    ``speculation``: the ``DecodeConfig.speculation`` modes it honours (``off`` always; an
    unset one falls back to ``off`` where the daemon's default is not among them).
    """

    truncation: bool = True
    reuse: str = "exact"
    sampling: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    prompt_formats: tuple[str, ...] = ("raw",)
    constraints: tuple[str, ...] = ()
    speculation: tuple[str, ...] = ("off",)


@dataclass(frozen=True, slots=True)
class SpecialToken:
    """A control token of the vocabulary. ``kind``: bos, eos, eot (ends a turn), or control."""

    id: int
    text: str
    kind: str = "control"


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a model will take in memory here, computed from its file's header before loading
    (``modeld describe``; blueprint 0009 "Know before you load"). Bytes, not MiB.

    The model's own figures (from the backend): ``weights_bytes`` (its tensors, mapped from the
    file), ``kv_bytes_per_token`` (one token's K and V over every layer at the session's
    ``kv_cache_type``), and the engine's compute buffer for a context of ``c`` cells, estimated
    as ``max(compute_floor_bytes, compute_fixed_bytes + compute_bytes_per_token * c)`` (llama.cpp
    reserves it for its worst-case micro-batch; with flash attention off it grows by
    ``num_batch x (heads + 1) x 4`` bytes per cell, and at the trained window it can exceed the KV).

    The configured layout within the memory budget (from the engine): ``layout`` names it
    (``unified/4:8704``: 4 sequences sharing a pool of 8704 cells; ``split/4``: 4 streams of a
    window each), ``window`` tokens per sequence (the effective context), ``kv_bytes`` what the
    layout allocates when the model loads, ``compute_bytes`` at that size, ``overhead_bytes``
    the stated per-model rest (the worker process), ``total_bytes`` their sum with the weights;
    ``budget_bytes`` the memory budget, ``max_window`` the largest window whose layout fits in
    it (0: none; capped at the trained window); ``trained_kv_bytes`` one trained window's KV.

    What the model's memory is (blueprint 0016, "Checkpoints"): ``memory`` is ``attention``,
    ``sliding-window``, ``hybrid`` (recurrent layers beside attention ones: ``kv_bytes_per_token``
    counts the attention layers only) or ``recurrent``; ``sliding_window`` the local layers'
    window (0: none); ``state_bytes`` one sequence's recurrent state, which cannot be cut (0:
    none); ``cuts`` where a warm sequence can be cut (``any token``; ``back to a checkpoint``;
    ``where the window is held``); ``checkpoint_bytes`` what the layout's checkpoints may hold
    (``--checkpoints`` per sequence, each one ``state_bytes``). ``total_bytes`` counts the
    sequences' states and the checkpoints.

    Sliding windows (blueprint 0016, "Sliding windows"): ``swa_kv_bytes_per_token`` is the local
    layers' part of ``kv_bytes_per_token``; ``swa_ring`` says the local layers keep a ring of
    cells (``serve --no-swa-full``: ``n_swa x n_seq + n_ubatch`` cells, padded to 256, as
    llama.cpp sizes it) instead of a cell per token (llama.cpp's full-size SWA cache, modeld's
    default); ``kv_bytes`` is the setting in force, ``swa_full_kv_bytes`` and
    ``swa_ring_kv_bytes`` the layout's KV under each (0: no sliding window); ``warm`` says
    whether a warm context's output is a fresh evaluation's under the setting in force.
    ``micro_batch``: the tokens per engine call the session asked for (``num_batch``).
    """

    weights_bytes: int = 0
    kv_bytes_per_token: int = 0
    compute_floor_bytes: int = 0
    compute_fixed_bytes: int = 0
    compute_bytes_per_token: int = 0
    trained_window: int = 0
    trained_kv_bytes: int = 0
    layout: str = ""
    window: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0
    overhead_bytes: int = 0
    total_bytes: int = 0
    budget_bytes: int = 0
    max_window: int = 0
    memory: str = "attention"
    sliding_window: int = 0
    state_bytes: int = 0
    cuts: str = "any token"
    checkpoint_bytes: int = 0
    swa_kv_bytes_per_token: int = 0
    swa_ring: bool = False
    swa_full_kv_bytes: int = 0
    swa_ring_kv_bytes: int = 0
    warm: str = ""
    micro_batch: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a model can do on this machine, and the identity its manifests carry."""

    backend: str
    backend_version: str
    path: str
    model_digest: str
    model_max_context: int  # the context length the model was trained with
    effective_context: int  # min(trained, requested num_ctx, what fits in free memory)
    kv_bytes_per_token: int
    free_bytes: int
    weights_bytes: int
    vocab_size: int
    tokenizer_digest: str
    template_digest: str
    chat_template: str
    add_bos: bool
    device: str
    model_name: str = ""
    bos_token: str = ""  # the text of the BOS token (for chat templates)
    eos_token: str = ""  # the text of the end-of-turn token (for chat templates)
    capabilities: Capabilities = field(default_factory=Capabilities)
    special_tokens: tuple[SpecialToken, ...] = ()  # control tokens (vocab_size counts every token)
    tool_format: str = ""  # how the chat template writes tool calls (TOOL_FORMATS); "" unknown
    architecture: str = ""  # the model's architecture (GGUF ``general.architecture``); "" unknown
    footprint: Footprint = field(default_factory=Footprint)  # what it takes in memory (describe)
    template_source: str = ""  # where chat_template comes from: "model" (the file) or "override"
    reasoning_format: str = ""  # how the chat template marks thinking; "" none recognised


@dataclass(frozen=True, slots=True)
class PrefixInput:
    """The stable prefix. ``manifest`` is optional: without one the daemon builds a minimal one.
    ``tools_json`` (a JSON array of tool definitions) and ``template_args_json`` (a JSON object:
    ``enable_thinking``, ``reasoning_effort``, a request's ``chat_template_kwargs``) are passed
    to the model's chat template (prompt_format ``chat``; blueprint 0010)."""

    text: str
    manifest: ContextManifest | None = None
    tools_json: str = ""
    no_wait: bool | None = None  # None: the session's choice (OpenSessionRequest.no_wait)
    template_args_json: str = ""
    ahead: bool = False
    """Computed ahead of a turn that may follow (the HTTP layer's ``--prefill-ahead``), not a
    turn of its own: the session reports it apart (:attr:`ContextReport.ahead`), and its last
    turn's report (``last_prefix``, ``last_reuse``) stays that turn's."""


@dataclass(frozen=True, slots=True)
class ReuseDecision:
    """Why the last ensure_prefix was warm, partial or cold. ``reason`` is from REUSE_REASONS."""

    outcome: str
    reason: str
    message: str
    field: str = ""  # for manifest_changed: the differing manifest field
    diverged_at_token: int | None = None  # for diverged: first token that differed
    diverged_segment: str = ""  # the segment kind holding that token, when known
    diverged_at_byte: int | None = None  # its byte offset in the prefix, when known
    tier: str = ""  # where the reused tokens came from (kv, ram, disk); for evicted: where it went
    context: str = ""  # the warm context reused (its id in explain-context)


@dataclass(frozen=True, slots=True)
class PrefixStatus:
    """Exact accounting of an ensure_prefix: ``reused + prefilled == prefix_tokens``."""

    reused_tokens: int
    prefilled_tokens: int
    dropped_tokens: int
    prefix_tokens: int
    resident_tokens: int
    available_tokens: int
    stable_byte_hash: str
    stable_token_hash: str
    manifest_digest: str
    reuse: ReuseDecision
    prefill_ms: float = 0.0  # server-side time evaluating tokens
    restore_ms: float = 0.0  # server-side time restoring a snapshot from a tier
    diverged_segment_index: int | None = None
    """When the prefix diverged (``reuse.diverged_at_token``): the index, in this prefix's
    manifest, of the segment holding that token (a chat prefix's message), when known."""
    diverged_part: str = ""
    """When a chat prefix diverged: the part of the prompt holding that token, ``system`` (the
    system message, or the template's head before any message), ``tools`` (where the template
    put the tool definitions) or ``messages``; "" for a text prefix or no divergence."""
    context_id: str = ""
    """The session's warm context once the prefix is in place (its id in explain-context;
    "" when it holds none): what a later turn's ``reuse.context`` is compared with."""


@dataclass(frozen=True, slots=True)
class SuffixInput:
    """The volatile suffix. ``manifest``, when given, must describe the resident prefix too."""

    text: str
    manifest: ContextManifest | None = None
    no_wait: bool | None = None


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """A long prefill's progress (sent at most every 0.5 s): ``done`` of ``total`` tokens."""

    stage: str  # prefix, suffix or decode
    done: int
    total: int
    elapsed_ms: float


ProgressCallback = Callable[[PrefillProgress], None]


@dataclass(frozen=True, slots=True)
class SuffixStatus:
    """``restored_tokens``: prefix tokens re-prefilled because another session displaced them.
    ``reused_tokens``: suffix tokens still resident from the session's last turn (the same
    request sent again, a retry, a rerun with the same first message): not recomputed."""

    suffix_tokens: int
    prefix_tokens: int
    resident_tokens: int
    available_tokens: int
    manifest_digest: str
    restored_tokens: int = 0
    prefill_ms: float = 0.0
    restore_ms: float = 0.0
    reused_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must be. ``kind`` is one of :data:`CONSTRAINT_KINDS`; ``value`` is the JSON
    schema (JSON text), the regular expression or the GBNF grammar (empty for ``json``).

    An invalid value is ``invalid_argument`` with the position of the error; a constraint the
    backend cannot enforce is ``unsupported``; a decode whose constraint can no longer be met ends
    with finish reason ``constraint_failed``, never with invalid output reported as success.
    """

    kind: str
    value: str = ""


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Sampling and stopping. ``temperature == 0`` is greedy.

    ``top_k == 0`` and ``top_p == 1`` and ``min_p == 0`` and ``repeat_penalty == 1`` disable
    those samplers. ``seed`` None means a random seed. ``extra`` is passed to the backend; keys it
    does not know are refused with :class:`~modeld.errors.UnsupportedError`.

    Constrained output and tools (``blueprints/0018-constraints-and-tool-calls.md``):

    * ``constraint``: the output must match it (see :class:`Constraint`).
    * ``tool_choice``: ``auto`` (parse calls out of the output), ``none`` (do not parse), ``required``
      (the output is forced to be a call of one of the tools), or a tool's name (forced call of
      it). Forcing is a constraint, so it cannot be combined with ``constraint``.
    * ``tools_json``: the tools the output may call (a JSON array of OpenAI-style definitions);
      empty means the prefix's ``tools_json``. ``exit_tools_json``: exit tools (same shape); a
      call of one is returned as ``StreamChunk.signal`` with no tool-result round trip, and with
      ``stop_on_signal`` it ends generation at once. ``tool_format``: one of
      :data:`TOOL_FORMATS` (``""``: recognised from the chat template).
    * ``repeated_line_min_chars`` / ``repeated_line_max``: a line of at least that many
      characters (whitespace stripped) repeated ``repeated_line_max`` times in a row ends the
      decode with ``repeated_line``; 0 in either turns the guard off.
    * ``logit_bias`` (token id -> added logit), ``presence_penalty``, ``frequency_penalty`` (as
      OpenAI defines them), ``logprobs`` and ``top_logprobs``: honoured where the backend lists
      them in ``Capabilities.sampling``, refused otherwise.
    * ``speculation``: ``ngram`` drafts tokens from the context (prompt lookup) and appends the
      tokens a constraint forces in one batch; ``off`` decodes one token per step; ``""`` is the
      daemon's choice (``modeld serve --speculation``). The output is the same either way
      (``blueprints/0021-speculation.md``); a backend that cannot speculate decodes plainly.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repeat_penalty: float = 1.0
    extra: Mapping[str, str] = field(default_factory=dict)
    no_wait: bool | None = None  # None: the session's choice (OpenSessionRequest.no_wait)
    constraint: Constraint | None = None
    tool_choice: str = "auto"
    tools_json: str = ""
    exit_tools_json: str = ""
    stop_on_signal: bool = True
    tool_format: str = ""
    repeated_line_min_chars: int = 16
    repeated_line_max: int = 8
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    speculation: str = ""
    n: int = 1
    """Choices (OpenAI's ``n``, 1-8): decoded together from the same prompt where the backend
    and the KV pool allow (else refused as ``unsupported`` naming ``n``); choice ``i`` samples
    with ``seed + i``. Chunks name their choice (``StreamChunk.choice``). HTTP only."""


@dataclass(frozen=True, slots=True)
class Usage:
    """``cached_tokens``: prompt tokens not computed during this turn (since ensure_prefix).

    Speculation (``DecodeConfig.speculation``, ``blueprints/0021-speculation.md``):
    ``drafted_tokens`` were drafted from the context and verified in ``draft_batches`` batches,
    ``accepted_tokens`` of them were what the model chose (each saved a decode step), and
    ``forced_tokens`` were the only continuation a constraint allowed (appended in a batch)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_ms: float = 0.0  # server-side prefill time of the turn (ensure_prefix to decode)
    restore_ms: float = 0.0  # server-side time restoring snapshots during the turn
    decode_ms: float = 0.0  # server-side time from the decode's first to its last token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_batches: int = 0
    forced_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ErrorDetail:
    """Why a decode ended with ``finish_reason == "error"``."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete tool call parsed out of the output. ``arguments`` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the ``index``-th tool call, as it is parsed: the first delta of a call has its
    ``id`` and ``name``; ``arguments`` pieces concatenate to the call's arguments JSON."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability, and the most likely alternatives (``top``).

    ``text`` is the token's bytes as UTF-8, or ``bytes:\\xNN...`` for a token that is not
    whole UTF-8 on its own (OpenAI's convention); filled by the daemon."""

    token: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    text: str = ""


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a step (``TokenLogprob.top``), best first."""

    token: int
    logprob: float
    text: str = ""


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """A text delta (whole UTF-8 characters). The last chunk has finish_reason and usage.

    Tool calls: the text of a call is not in ``text``; it arrives as ``tool_call_deltas`` and
    the final chunk lists the complete calls in ``tool_calls`` (finish reason ``tool_calls``),
    or the exit tool's call in ``signal`` (finish reason ``signal``). A call that does not
    parse ends with ``malformed_tool_call`` and its raw text in ``text``. ``tool_text`` (final
    chunk) is the calls' text exactly as generated: ``text`` + ``tool_text`` is the assistant
    turn to append to the history so that the next turn reuses the generated tokens.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    error: ErrorDetail | None = None
    tool_call_deltas: tuple[ToolCallDelta, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    signal: ToolCall | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_text: str = ""  # final chunk: the calls' text as the model wrote it (to append to history)
    stop_sequence: str = ""  # final chunk with finish_reason stop_sequence: the stop string that matched
    choice: int = 0  # the choice this chunk belongs to (DecodeConfig.n); each choice has its final chunk

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class ContextReport:
    """What a session has resident, for observability (explain-context).

    ``resident_tokens`` counts the session's context (prefix + suffix + generated).
    ``kv_tokens`` counts how many of those are in the engine's KV right now: fewer when another
    session displaced them (the next operation restores them, reusing what it can).
    """

    session_id: str
    model_name: str
    backend: str
    num_ctx: int
    resident_tokens: int
    prefix_tokens: int
    suffix_tokens: int
    generated_tokens: int
    available_tokens: int
    kv_tokens: int
    stable_byte_hash: str
    stable_token_hash: str
    volatile_token_hash: str
    manifest_digest: str
    manifest: ContextManifest | None
    closed: bool
    last_reuse: ReuseDecision | None
    last_prefix: PrefixStatus | None = None
    owner_epoch: int = 0
    opened_at: float = 0.0
    last_used_at: float = 0.0
    context_id: str = ""  # this session's warm context in the model's KV pool ("" = none now)
    contexts: tuple[WarmContextInfo, ...] = ()  # every warm context of the model, every tier
    queue_position: int = 0  # 1 = next, while this session waits for a slot; 0 = not waiting
    queue_wait_seconds: float = 0.0  # how long it has waited (or waited last)
    pinned: bool = False
    keep_alive_seconds: float = 0.0
    changing_segments: tuple[ChangingSegment, ...] = ()
    """Stable segments whose text changed on each of the session's last prefixes (see
    :class:`ChangingSegment`): the likely cause of a prefix that is cold every turn."""
    tools_token_start: int | None = None
    """Where the chat template put the tool definitions (``tools_json``) in the prefix's tokens:
    they are no segment of the text, but often its largest part."""
    tools_token_end: int | None = None
    kv_layout: str = ""
    """How the model's KV is laid out: ``unified/4:8704`` (4 sequences share a pool of 8704
    cells), ``split/4`` (4 streams of a window each); blueprint 0016."""
    warm_exact: bool = True
    """Warm output is bit-identical to a fresh evaluation of the same tokens by construction.
    False on a unified pool: a context's cells can interleave with other contexts' there, and
    its output can then differ from a fresh evaluation (the attention sums in another order;
    it is bit-identical while the context is alone in the pool)."""
    speculation: str = ""
    """The speculation mode of the session's last decode (``off``, ``ngram``; "" before one)."""
    drafted_tokens: int = 0
    """Over the session's decodes: tokens drafted from the context and verified (blueprint 0021),"""
    accepted_tokens: int = 0
    """of which the model chose these (acceptance rate = accepted / drafted),"""
    draft_batches: int = 0
    """in this many verify batches (mean draft length = drafted / batches);"""
    forced_tokens: int = 0
    """and tokens a constraint forced, appended without a decode step."""
    ahead: PrefixStatus | None = None
    """The session's last prefix computed ahead of a turn (``PrefixInput.ahead``: the next
    turn's prefix put in place while the user read the answer), apart from its turns: a turn
    after it reuses what it computed, and where it diverged (the template re-rendering an
    earlier turn) is said here."""


@dataclass(frozen=True, slots=True)
class ChangingSegment:
    """A stable segment that changed on each of the last ``turns`` ensure_prefix calls of a
    session, at the same place: the ``position``-th stable segment of its ``kind`` (``index`` in
    the current manifest). A timestamp or a request id in the system prompt does this; move it
    into the volatile suffix (``ContextBuilder.runtime``) and the prefix stays warm."""

    kind: str
    position: int
    index: int
    turns: int


@dataclass(frozen=True, slots=True)
class WarmContextInfo:
    """A warm context of a model, wherever it lives (``tier``: kv, ram or disk).

    ``bytes`` counts what only this context holds; ``shared_bytes`` KV cells it shares with
    other contexts (a common prefix is stored, and counted, once). ``checkpoint_bytes``: in the
    KV tier, what its checkpoints hold beside its cells (memory that cannot be cut at any token:
    recurrent states, sliding windows; blueprint 0016); in RAM or on disk they are part of
    ``bytes``, inside its snapshot."""

    id: str
    tier: str
    tokens: int
    prefix_tokens: int
    bytes: int
    shared_bytes: int
    last_used_at: float
    pinned: bool
    session_id: str
    checkpoint_bytes: int = 0


class Closing:
    """``with x:`` closes ``x`` when the block ends: the ``__enter__``/``__exit__`` every
    Session and DecodeStream has (a class with a ``close`` inherits them from here)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClosing:
    """``async with x:`` closes ``x`` when the block ends (an AsyncSession's, an AsyncService's)."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


@runtime_checkable
class DecodeStream(Protocol):
    """An iterator of chunks that can be cancelled. Cancelling yields a final "canceled" chunk.

    Closing it (or leaving a ``with`` block) cancels the generation if it is still running and
    waits until the engine has stopped.
    """

    def __iter__(self) -> Iterator[StreamChunk]: ...

    def __next__(self) -> StreamChunk: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> DecodeStream: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Session(Protocol):
    """One client's context on one model. Not for concurrent use by several threads."""

    @property
    def session_id(self) -> str: ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def identity(self) -> ContextManifest:
        """The runtime fields (backend, digests, BOS policy, runtime digest) of this session."""
        ...

    def ensure_prefix(
        self, prefix: PrefixInput, progress: ProgressCallback | None = None
    ) -> PrefixStatus: ...

    def prefill_suffix(
        self, suffix: SuffixInput, progress: ProgressCallback | None = None
    ) -> SuffixStatus: ...

    def decode(self, config: DecodeConfig) -> DecodeStream: ...

    def explain_context(self) -> ContextReport: ...

    def close(self) -> None: ...

    def __enter__(self) -> Session: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Service(Protocol):
    """Describes models and opens sessions on them."""

    def describe(self, request: OpenSessionRequest) -> ModelInfo: ...

    def open_session(self, request: OpenSessionRequest) -> Session: ...


class AsyncDecodeStream(Protocol):
    """The asyncio shape of :class:`DecodeStream`."""

    def __aiter__(self) -> AsyncIterator[StreamChunk]: ...

    async def __anext__(self) -> StreamChunk: ...

    async def cancel(self) -> None: ...

    async def aclose(self) -> None: ...


class AsyncSession(Protocol):
    """The asyncio shape of :class:`Session`."""

    @property
    def session_id(self) -> str: ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def identity(self) -> ContextManifest: ...

    async def ensure_prefix(
        self, prefix: PrefixInput, progress: ProgressCallback | None = None
    ) -> PrefixStatus: ...

    async def prefill_suffix(
        self, suffix: SuffixInput, progress: ProgressCallback | None = None
    ) -> SuffixStatus: ...

    async def decode(self, config: DecodeConfig) -> AsyncDecodeStream: ...

    async def explain_context(self) -> ContextReport: ...

    async def close(self) -> None: ...


class AsyncService(Protocol):
    """The asyncio shape of :class:`Service`."""

    async def describe(self, request: OpenSessionRequest) -> ModelInfo: ...

    async def open_session(self, request: OpenSessionRequest) -> AsyncSession: ...
