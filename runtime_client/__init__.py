"""runtime_client: what a coding tool imports to use modeld.

    import runtime_client as rc

    with rc.connect() as client:                       # finds the running daemon
        session = client.open_session(rc.OpenSessionRequest(path="model.gguf", type="llama"))
        ctx = rc.ContextBuilder(identity=session.identity).system(SYSTEM).repo_map(MAP) \
            .user_turn("Fix the failing test.").build()
        session.ensure_prefix(ctx.prefix_input())      # warm after the first turn
        session.prefill_suffix(ctx.suffix_input())
        for chunk in session.decode(rc.DecodeConfig(max_tokens=256)):
            print(chunk.text, end="")

Constrained output and tools: ``DecodeConfig(constraint=rc.Constraint("json_schema", schema))``
always yields a document valid under the schema; ``tool_choice="required"`` (or a tool's name)
always yields a well-formed call; :func:`run_tools` runs a whole tool loop, prefilling only what
each round adds.

When the daemon restarts (not a takeover), open sessions resume at their next call: the session
is reopened on the new daemon and its context restored from the disk tier
(:mod:`runtime_client.resume`; ``connect(resume=False)`` turns it off).

The client implements the same Service/Session contract as the in-process engine and raises
the same typed errors (:mod:`modeld.errors`, every one of them exported here). It imports nothing from the daemon's engine or
backends, so it installs without the native engines.
"""

from modeld.contract import (
    Config,
    Constraint,
    ContextReport,
    DecodeConfig,
    Fence,
    ModelInfo,
    OpenSessionRequest,
    PrefillProgress,
    PrefixInput,
    PrefixStatus,
    ReuseDecision,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    ToolCall,
    ToolCallDelta,
    Usage,
    WarmContextInfo,
)
from modeld.errors import (
    BackendMismatchError,
    BackendUnavailableError,
    BusyError,
    ContextOverflowError,
    DaemonUnavailableError,
    DeadlineExceededError,
    EngineError,
    EngineRestartedError,
    InternalError,
    InvalidArgumentError,
    LimitExceededError,
    ManifestMismatchError,
    ModelChangedError,
    ModeldError,
    ModelLoadError,
    NoSlotAvailableError,
    NotOwnerError,
    OperationTimeoutError,
    PrefixRequiredError,
    SessionClosedError,
    SessionNotFoundError,
    ShuttingDownError,
    StaleFenceError,
    StallTimeoutError,
    UnauthenticatedError,
    UnsupportedError,
)
from modeld.manifest import ContextManifest, Segment
from modeld.observe.status import DaemonStatus, SessionSummary
from runtime_client.aio import AsyncClient, AsyncClientSession, aconnect
from runtime_client.builder import BuiltContext, ContextBuilder
from runtime_client.client import Client, ClientDecodeStream, ClientSession, connect
from runtime_client.discovery import Endpoint, discover
from runtime_client.resume import Resume
from runtime_client.tools import AsyncToolRunner, ToolLoopResult, ToolRound, ToolRunner, arun_tools, run_tools

__all__ = [
    "AsyncClient",
    "AsyncClientSession",
    "BackendMismatchError",
    "BackendUnavailableError",
    "BuiltContext",
    "BusyError",
    "Client",
    "ClientDecodeStream",
    "ClientSession",
    "Config",
    "Constraint",
    "ContextBuilder",
    "ContextManifest",
    "ContextOverflowError",
    "ContextReport",
    "DaemonStatus",
    "DaemonUnavailableError",
    "DeadlineExceededError",
    "DecodeConfig",
    "Endpoint",
    "EngineError",
    "EngineRestartedError",
    "Fence",
    "InternalError",
    "InvalidArgumentError",
    "LimitExceededError",
    "ManifestMismatchError",
    "ModelChangedError",
    "ModelInfo",
    "ModelLoadError",
    "ModeldError",
    "NoSlotAvailableError",
    "NotOwnerError",
    "OpenSessionRequest",
    "OperationTimeoutError",
    "PrefillProgress",
    "PrefixInput",
    "PrefixRequiredError",
    "PrefixStatus",
    "Resume",
    "ReuseDecision",
    "Segment",
    "SessionClosedError",
    "SessionNotFoundError",
    "SessionSummary",
    "ShuttingDownError",
    "StaleFenceError",
    "StallTimeoutError",
    "StreamChunk",
    "SuffixInput",
    "SuffixStatus",
    "ToolCall",
    "ToolCallDelta",
    "ToolLoopResult",
    "ToolRound",
    "ToolRunner",
    "AsyncToolRunner",
    "UnauthenticatedError",
    "UnsupportedError",
    "Usage",
    "WarmContextInfo",
    "aconnect",
    "arun_tools",
    "connect",
    "discover",
    "run_tools",
]
