"""Conversion between the contract's dataclasses and the modeld.v1 protobuf messages.

The one place where protobuf meets the contract, used by both the servicer and the runtime
client. Field names match one to one, so flat types convert generically (:func:`_to_pb`,
:func:`_from_pb`); nested and enum fields are spelled out. Optional fields left unset (for
example by a grpcurl user) take the contract's defaults; the runtime client always sets them,
so a value the contract refuses in process is refused over the wire too.

Anything that cannot be converted (a wrong type, a negative count) raises
:class:`~modeld.errors.InvalidArgumentError` naming the message, never a bare TypeError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.rpc import error_details_pb2

from modeld.contract import (
    Capabilities,
    ChangingSegment,
    Config,
    Constraint,
    ContextReport,
    DecodeConfig,
    ErrorDetail,
    Fence,
    Footprint,
    ModelInfo,
    OpenSessionRequest,
    PrefillProgress,
    PrefixInput,
    PrefixStatus,
    ReuseDecision,
    SpecialToken,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
    WarmContextInfo,
)
from modeld.errors import InvalidArgumentError, UnsupportedError, echo
from modeld.manifest import ContextManifest, Segment
from modeld.observe.status import (
    Accelerator,
    DaemonMemory,
    DaemonStatus,
    LoadedModelSummary,
    Machine,
    ModelMemory,
    SessionSummary,
    TierStatus,
    WorkerInfo,
)
from modeld.v1 import modeld_pb2 as pb

__all__ = [
    "count_tokens_request_from_pb",
    "count_tokens_request_to_pb",
    "config_from_pb",
    "config_to_pb",
    "decode_config_from_pb",
    "decode_config_to_pb",
    "manifest_from_pb",
    "manifest_to_pb",
    "model_info_from_pb",
    "model_info_to_pb",
    "open_request_from_pb",
    "open_request_to_pb",
    "prefix_input_from_pb",
    "prefix_input_to_pb",
    "prefix_status_from_pb",
    "prefix_status_to_pb",
    "report_from_pb",
    "report_to_pb",
    "status_from_pb",
    "status_to_pb",
    "chunk_from_pb",
    "chunk_to_pb",
    "suffix_input_from_pb",
    "suffix_input_to_pb",
    "suffix_status_from_pb",
    "suffix_status_to_pb",
    "summary_from_pb",
    "summary_to_pb",
]

_M = TypeVar("_M", bound=Message)
_T = TypeVar("_T")

_BACKEND_TO_PB = {
    "": pb.BACKEND_TYPE_UNSPECIFIED,
    "llama": pb.BACKEND_TYPE_LLAMA,
    "openvino": pb.BACKEND_TYPE_OPENVINO,
    "memory": pb.BACKEND_TYPE_MEMORY,
}
_BACKEND_FROM_PB = {v: k for k, v in _BACKEND_TO_PB.items()}
_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "stop_sequence": pb.FINISH_REASON_STOP_SEQUENCE,
    "canceled": pb.FINISH_REASON_CANCELED,
    "error": pb.FINISH_REASON_ERROR,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
    "malformed_tool_call": pb.FINISH_REASON_MALFORMED_TOOL_CALL,
    "signal": pb.FINISH_REASON_SIGNAL,
    "constraint_failed": pb.FINISH_REASON_CONSTRAINT_FAILED,
    "repeated_line": pb.FINISH_REASON_REPEATED_LINE,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def _guard(what: str) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Turn conversion failures into InvalidArgumentError naming the message."""

    def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
        def inner(*args: Any) -> _T:
            try:
                return fn(*args)
            except InvalidArgumentError:
                raise
            except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
                raise InvalidArgumentError(f"invalid {what}: {exc}", field=what) from exc

        inner.__name__ = fn.__name__
        inner.__doc__ = fn.__doc__
        return inner

    return wrap


_UNSIGNED = (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64)


def _to_pb(obj: Any, msg: _M, *, skip: tuple[str, ...] = ()) -> _M:
    """Copy a flat dataclass into a message with the same field names (None = unset).

    A value the field cannot hold (a negative count, a wrong type) is an InvalidArgumentError
    naming that field, the same field the daemon would name.
    """
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        if value is None:
            continue
        target = getattr(msg, f.name)
        descriptor = msg.DESCRIPTOR.fields_by_name[f.name]
        if descriptor.type in _UNSIGNED and isinstance(value, int) and value < 0:
            raise InvalidArgumentError(f"{f.name} must not be negative, got {value}", field=f.name)
        try:
            if isinstance(value, tuple | list):
                target.extend(value)
            elif isinstance(value, dict) or (hasattr(value, "items") and hasattr(target, "update")):
                target.update(value)
            else:
                setattr(msg, f.name, value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgumentError(f"{f.name}={echo(value)} is invalid: {exc}", field=f.name) from exc
    return msg


def _from_pb(msg: Message, cls: type[_T], *, skip: tuple[str, ...] = (), **given: Any) -> _T:
    """Build a flat dataclass from a message with the same field names."""
    values: dict[str, Any] = dict(given)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in skip or f.name in values:
            continue
        descriptor = msg.DESCRIPTOR.fields_by_name[f.name]
        if descriptor.has_presence and not msg.HasField(f.name):
            values[f.name] = None
            continue
        value = getattr(msg, f.name)
        if descriptor.is_repeated:
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


# --- requests -----------------------------------------------------------------------------


@_guard("config")
def config_to_pb(config: Config) -> pb.Config:
    return _to_pb(config, pb.Config())


@_guard("config")
def config_from_pb(msg: pb.Config) -> Config:
    defaults = Config()
    optional = {
        name: getattr(msg, name) if msg.HasField(name) else getattr(defaults, name)
        for name in ("num_ctx", "num_batch", "kv_cache_type", "prompt_format")
    }
    return Config(
        num_threads=msg.num_threads,
        num_gpu_layers=msg.num_gpu_layers,
        tensor_split=tuple(msg.tensor_split),
        flash_attn=msg.flash_attn,
        prompt_template_digest=msg.prompt_template_digest,
        disable_bos=msg.disable_bos,
        **optional,
    )


@_guard("open_session request")
def open_request_to_pb(request: OpenSessionRequest) -> pb.OpenSessionRequest:
    if request.type not in _BACKEND_TO_PB:
        raise InvalidArgumentError(
            f"unknown backend type {request.type!r}; expected llama, openvino or memory",
            field="type",
        )
    return pb.OpenSessionRequest(
        model_name=request.model_name,
        type=_BACKEND_TO_PB[request.type],
        digest=request.digest,
        path=request.path,
        config=config_to_pb(request.config),
        fence=pb.Fence(owner_instance_id=request.fence.owner_instance_id),
        pin=request.pin,
        keep_alive_seconds=request.keep_alive_seconds,
        no_wait=request.no_wait,
        chat_template=request.chat_template,
    )


@_guard("open_session request")
def open_request_from_pb(msg: pb.OpenSessionRequest) -> OpenSessionRequest:
    if msg.type not in _BACKEND_FROM_PB:
        raise InvalidArgumentError(f"unknown backend type {msg.type}", field="type")
    return OpenSessionRequest(
        model_name=msg.model_name,
        type=_BACKEND_FROM_PB[msg.type],
        digest=msg.digest,
        path=msg.path,
        config=config_from_pb(msg.config),
        fence=Fence(owner_instance_id=msg.fence.owner_instance_id),
        pin=msg.pin,
        keep_alive_seconds=msg.keep_alive_seconds,
        no_wait=msg.no_wait,
        chat_template=msg.chat_template,
    )


@_guard("count_tokens request")
def count_tokens_request_to_pb(
    request: OpenSessionRequest, text: str, return_token_ids: bool
) -> pb.CountTokensRequest:
    return pb.CountTokensRequest(
        model=open_request_to_pb(request), text=text, return_token_ids=return_token_ids
    )


@_guard("count_tokens request")
def count_tokens_request_from_pb(msg: pb.CountTokensRequest) -> tuple[OpenSessionRequest, str, bool]:
    return open_request_from_pb(msg.model), msg.text, msg.return_token_ids


@_guard("manifest")
def manifest_to_pb(manifest: ContextManifest) -> pb.ContextManifest:
    msg = _to_pb(manifest, pb.ContextManifest(), skip=("segments",))
    msg.segments.extend(_to_pb(s, pb.Segment()) for s in manifest.segments)
    return msg


@_guard("manifest")
def manifest_from_pb(msg: pb.ContextManifest) -> ContextManifest:
    segments = tuple(_from_pb(s, Segment) for s in msg.segments)
    return _from_pb(msg, ContextManifest, segments=segments)


@_guard("prefix")
def prefix_input_to_pb(prefix: PrefixInput) -> pb.PrefixInput:
    msg = pb.PrefixInput(
        text=prefix.text, tools_json=prefix.tools_json, template_args_json=prefix.template_args_json
    )
    if prefix.no_wait is not None:
        msg.no_wait = prefix.no_wait
    if prefix.manifest is not None:
        msg.manifest.CopyFrom(manifest_to_pb(prefix.manifest))
    return msg


@_guard("prefix")
def prefix_input_from_pb(msg: pb.PrefixInput) -> PrefixInput:
    manifest = manifest_from_pb(msg.manifest) if msg.HasField("manifest") else None
    no_wait = msg.no_wait if msg.HasField("no_wait") else None
    return PrefixInput(
        text=msg.text,
        manifest=manifest,
        tools_json=msg.tools_json,
        no_wait=no_wait,
        template_args_json=msg.template_args_json,
    )


@_guard("suffix")
def suffix_input_to_pb(suffix: SuffixInput) -> pb.SuffixInput:
    msg = pb.SuffixInput(text=suffix.text)
    if suffix.no_wait is not None:
        msg.no_wait = suffix.no_wait
    if suffix.manifest is not None:
        msg.manifest.CopyFrom(manifest_to_pb(suffix.manifest))
    return msg


@_guard("suffix")
def suffix_input_from_pb(msg: pb.SuffixInput) -> SuffixInput:
    manifest = manifest_from_pb(msg.manifest) if msg.HasField("manifest") else None
    no_wait = msg.no_wait if msg.HasField("no_wait") else None
    return SuffixInput(text=msg.text, manifest=manifest, no_wait=no_wait)


_DECODE_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "tool_choice",
    "stop_on_signal",
    "repeated_line_min_chars",
    "repeated_line_max",
)


@_guard("decode config")
def decode_config_to_pb(config: DecodeConfig) -> pb.DecodeConfig:
    if config.n != 1:
        raise UnsupportedError("n (several choices) is served over HTTP only", field="n")
    msg = _to_pb(config, pb.DecodeConfig(), skip=("constraint", "logit_bias", "n"))
    if config.constraint is not None:
        msg.constraint.CopyFrom(pb.Constraint(kind=config.constraint.kind, value=config.constraint.value))
    for token, bias in config.logit_bias.items():
        msg.logit_bias[token] = bias
    return msg


@_guard("decode config")
def decode_config_from_pb(msg: pb.DecodeConfig) -> DecodeConfig:
    defaults = DecodeConfig()
    values: dict[str, Any] = {}
    for name in _DECODE_OPTIONAL:
        values[name] = getattr(msg, name) if msg.HasField(name) else getattr(defaults, name)
    constraint = Constraint(msg.constraint.kind, msg.constraint.value) if msg.HasField("constraint") else None
    return DecodeConfig(
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        extra=dict(msg.extra),
        no_wait=msg.no_wait if msg.HasField("no_wait") else None,
        constraint=constraint,
        tools_json=msg.tools_json,
        exit_tools_json=msg.exit_tools_json,
        tool_format=msg.tool_format,
        logit_bias=dict(msg.logit_bias),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        speculation=msg.speculation,
        **values,
    )


# --- results ------------------------------------------------------------------------------


@_guard("model info")
def model_info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    msg = _to_pb(info, pb.ModelInfo(), skip=("capabilities", "special_tokens", "footprint"))
    msg.capabilities.CopyFrom(_to_pb(info.capabilities, pb.Capabilities()))
    msg.footprint.CopyFrom(_to_pb(info.footprint, pb.Footprint()))
    msg.special_tokens.extend(_to_pb(t, pb.SpecialToken()) for t in info.special_tokens)
    return msg


@_guard("model info")
def model_info_from_pb(msg: pb.ModelInfo) -> ModelInfo:
    caps = _from_pb(msg.capabilities, Capabilities)
    special = tuple(_from_pb(t, SpecialToken) for t in msg.special_tokens)
    footprint = _from_pb(msg.footprint, Footprint)
    return _from_pb(msg, ModelInfo, capabilities=caps, special_tokens=special, footprint=footprint)


def _reuse_to_pb(decision: ReuseDecision) -> pb.ReuseDecision:
    return _to_pb(decision, pb.ReuseDecision())


def _reuse_from_pb(msg: pb.ReuseDecision) -> ReuseDecision:
    return _from_pb(msg, ReuseDecision)


@_guard("prefix status")
def prefix_status_to_pb(status: PrefixStatus) -> pb.PrefixStatus:
    msg = _to_pb(status, pb.PrefixStatus(), skip=("reuse",))
    msg.reuse.CopyFrom(_reuse_to_pb(status.reuse))
    return msg


@_guard("prefix status")
def prefix_status_from_pb(msg: pb.PrefixStatus) -> PrefixStatus:
    return _from_pb(msg, PrefixStatus, reuse=_reuse_from_pb(msg.reuse))


@_guard("suffix status")
def suffix_status_to_pb(status: SuffixStatus) -> pb.SuffixStatus:
    return _to_pb(status, pb.SuffixStatus())


@_guard("suffix status")
def suffix_status_from_pb(msg: pb.SuffixStatus) -> SuffixStatus:
    return _from_pb(msg, SuffixStatus)


@_guard("chunk")
def chunk_to_pb(chunk: StreamChunk) -> pb.StreamChunk:
    msg = pb.StreamChunk(
        text=chunk.text,
        tool_text=chunk.tool_text,
        stop_sequence=chunk.stop_sequence,
        token_ids=chunk.token_ids,
        finish_reason=_FINISH_TO_PB[chunk.finish_reason],
    )
    if chunk.usage is not None:
        msg.usage.CopyFrom(_to_pb(chunk.usage, pb.Usage()))
    if chunk.error is not None:
        info = error_details_pb2.ErrorInfo(reason=chunk.error.reason, domain="modeld")
        msg.error.CopyFrom(pb.ErrorDetail(reason=chunk.error.reason, message=chunk.error.message, info=info))
    msg.tool_call_deltas.extend(_to_pb(d, pb.ToolCallDelta()) for d in chunk.tool_call_deltas)
    msg.tool_calls.extend(_to_pb(c, pb.ToolCall()) for c in chunk.tool_calls)
    if chunk.signal is not None:
        msg.signal.CopyFrom(_to_pb(chunk.signal, pb.ToolCall()))
    for lp in chunk.logprobs:
        msg.logprobs.append(
            pb.TokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                top=[pb.TopLogprob(token=t.token, logprob=t.logprob, text=t.text) for t in lp.top],
                text=lp.text,
            )
        )
    return msg


@_guard("chunk")
def chunk_from_pb(msg: pb.StreamChunk) -> StreamChunk:
    finish = _FINISH_FROM_PB.get(msg.finish_reason, "error")
    return StreamChunk(
        text=msg.text,
        tool_text=msg.tool_text,
        stop_sequence=msg.stop_sequence,
        token_ids=tuple(msg.token_ids),
        finish_reason=finish,
        usage=_from_pb(msg.usage, Usage) if msg.HasField("usage") else None,
        error=ErrorDetail(msg.error.reason, msg.error.message) if msg.HasField("error") else None,
        tool_call_deltas=tuple(_from_pb(d, ToolCallDelta) for d in msg.tool_call_deltas),
        tool_calls=tuple(_from_pb(c, ToolCall) for c in msg.tool_calls),
        signal=_from_pb(msg.signal, ToolCall) if msg.HasField("signal") else None,
        logprobs=tuple(
            TokenLogprob(
                lp.token, lp.logprob, tuple(TopLogprob(t.token, t.logprob, t.text) for t in lp.top), lp.text
            )
            for lp in msg.logprobs
        ),
    )


def _contexts_to_pb(contexts: tuple[WarmContextInfo, ...]) -> list[pb.WarmContext]:
    return [_to_pb(c, pb.WarmContext()) for c in contexts]


def _contexts_from_pb(msgs: Any) -> tuple[WarmContextInfo, ...]:
    return tuple(_from_pb(m, WarmContextInfo) for m in msgs)


@_guard("progress")
def progress_to_pb(progress: PrefillProgress) -> pb.PrefillProgress:
    return _to_pb(progress, pb.PrefillProgress())


@_guard("progress")
def progress_from_pb(msg: pb.PrefillProgress) -> PrefillProgress:
    return _from_pb(msg, PrefillProgress)


@_guard("context report")
def report_to_pb(report: ContextReport) -> pb.ContextReport:
    msg = _to_pb(
        report,
        pb.ContextReport(),
        skip=("manifest", "last_reuse", "last_prefix", "contexts", "changing_segments", "ahead"),
    )
    msg.contexts.extend(_contexts_to_pb(report.contexts))
    msg.changing_segments.extend(_to_pb(c, pb.ChangingSegment()) for c in report.changing_segments)
    if report.manifest is not None:
        msg.manifest.CopyFrom(manifest_to_pb(report.manifest))
    if report.last_reuse is not None:
        msg.last_reuse.CopyFrom(_reuse_to_pb(report.last_reuse))
    if report.last_prefix is not None:
        msg.last_prefix.CopyFrom(prefix_status_to_pb(report.last_prefix))
    if report.ahead is not None:
        msg.ahead.CopyFrom(prefix_status_to_pb(report.ahead))
    return msg


@_guard("context report")
def report_from_pb(msg: pb.ContextReport) -> ContextReport:
    return _from_pb(
        msg,
        ContextReport,
        manifest=manifest_from_pb(msg.manifest) if msg.HasField("manifest") else None,
        last_reuse=_reuse_from_pb(msg.last_reuse) if msg.HasField("last_reuse") else None,
        last_prefix=prefix_status_from_pb(msg.last_prefix) if msg.HasField("last_prefix") else None,
        ahead=prefix_status_from_pb(msg.ahead) if msg.HasField("ahead") else None,
        contexts=_contexts_from_pb(msg.contexts),
        changing_segments=tuple(_from_pb(c, ChangingSegment) for c in msg.changing_segments),
    )


@_guard("session summary")
def summary_to_pb(summary: SessionSummary) -> pb.SessionSummary:
    return _to_pb(summary, pb.SessionSummary())


@_guard("session summary")
def summary_from_pb(msg: pb.SessionSummary) -> SessionSummary:
    return _from_pb(msg, SessionSummary)


def machine_to_pb(machine: Machine) -> pb.Machine:
    msg = _to_pb(machine, pb.Machine(), skip=("accelerators",))
    msg.accelerators.extend(_to_pb(a, pb.Accelerator()) for a in machine.accelerators)
    return msg


def machine_from_pb(msg: pb.Machine) -> Machine:
    return _from_pb(msg, Machine, accelerators=tuple(_from_pb(a, Accelerator) for a in msg.accelerators))


def _model_to_pb(model: LoadedModelSummary) -> pb.LoadedModel:
    msg = _to_pb(model, pb.LoadedModel(), skip=("contexts", "worker", "memory"))
    msg.contexts.extend(_contexts_to_pb(model.contexts))
    if model.worker is not None:
        msg.worker.CopyFrom(_to_pb(model.worker, pb.Worker()))
    msg.memory.CopyFrom(_to_pb(model.memory, pb.ModelMemory()))
    return msg


def _model_from_pb(msg: pb.LoadedModel) -> LoadedModelSummary:
    return _from_pb(
        msg,
        LoadedModelSummary,
        contexts=_contexts_from_pb(msg.contexts),
        counters=dict(msg.counters),
        worker=_from_pb(msg.worker, WorkerInfo) if msg.HasField("worker") else None,
        memory=_from_pb(msg.memory, ModelMemory) if msg.HasField("memory") else ModelMemory(),
    )


@_guard("status")
def status_to_pb(status: DaemonStatus) -> pb.StatusResponse:
    msg = _to_pb(status, pb.StatusResponse(), skip=("models", "tiers", "machine", "memory"))
    msg.models.extend(_model_to_pb(m) for m in status.models)
    msg.memory.CopyFrom(_to_pb(status.memory, pb.DaemonMemory()))
    if status.tiers is not None:
        msg.tiers.CopyFrom(_to_pb(status.tiers, pb.Tiers()))
    if status.machine is not None:
        msg.machine.CopyFrom(machine_to_pb(status.machine))
    return msg


@_guard("status")
def status_from_pb(msg: pb.StatusResponse) -> DaemonStatus:
    models = tuple(_model_from_pb(m) for m in msg.models)
    return _from_pb(
        msg,
        DaemonStatus,
        models=models,
        limits=dict(msg.limits),
        settings=dict(msg.settings),
        tiers=_from_pb(msg.tiers, TierStatus) if msg.HasField("tiers") else None,
        machine=machine_from_pb(msg.machine) if msg.HasField("machine") else None,
        memory=_from_pb(msg.memory, DaemonMemory) if msg.HasField("memory") else DaemonMemory(),
    )
