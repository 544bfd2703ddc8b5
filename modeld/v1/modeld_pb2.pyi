from google.rpc import error_details_pb2 as _error_details_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BackendType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_TYPE_UNSPECIFIED: _ClassVar[BackendType]
    BACKEND_TYPE_LLAMA: _ClassVar[BackendType]
    BACKEND_TYPE_OPENVINO: _ClassVar[BackendType]
    BACKEND_TYPE_MEMORY: _ClassVar[BackendType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_CANCELED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
    FINISH_REASON_MALFORMED_TOOL_CALL: _ClassVar[FinishReason]
    FINISH_REASON_SIGNAL: _ClassVar[FinishReason]
    FINISH_REASON_CONSTRAINT_FAILED: _ClassVar[FinishReason]
    FINISH_REASON_REPEATED_LINE: _ClassVar[FinishReason]
BACKEND_TYPE_UNSPECIFIED: BackendType
BACKEND_TYPE_LLAMA: BackendType
BACKEND_TYPE_OPENVINO: BackendType
BACKEND_TYPE_MEMORY: BackendType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_CANCELED: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
FINISH_REASON_MALFORMED_TOOL_CALL: FinishReason
FINISH_REASON_SIGNAL: FinishReason
FINISH_REASON_CONSTRAINT_FAILED: FinishReason
FINISH_REASON_REPEATED_LINE: FinishReason

class Config(_message.Message):
    __slots__ = ("num_ctx", "num_batch", "num_threads", "num_gpu_layers", "tensor_split", "flash_attn", "kv_cache_type", "prompt_format", "prompt_template_digest", "disable_bos")
    NUM_CTX_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SPLIT_FIELD_NUMBER: _ClassVar[int]
    FLASH_ATTN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TYPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEMPLATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DISABLE_BOS_FIELD_NUMBER: _ClassVar[int]
    num_ctx: int
    num_batch: int
    num_threads: int
    num_gpu_layers: int
    tensor_split: _containers.RepeatedScalarFieldContainer[float]
    flash_attn: bool
    kv_cache_type: str
    prompt_format: str
    prompt_template_digest: str
    disable_bos: bool
    def __init__(self, num_ctx: _Optional[int] = ..., num_batch: _Optional[int] = ..., num_threads: _Optional[int] = ..., num_gpu_layers: _Optional[int] = ..., tensor_split: _Optional[_Iterable[float]] = ..., flash_attn: _Optional[bool] = ..., kv_cache_type: _Optional[str] = ..., prompt_format: _Optional[str] = ..., prompt_template_digest: _Optional[str] = ..., disable_bos: _Optional[bool] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("owner_instance_id",)
    OWNER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    owner_instance_id: str
    def __init__(self, owner_instance_id: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("model_name", "type", "digest", "path", "config", "fence", "pin", "keep_alive_seconds", "no_wait", "chat_template")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    type: BackendType
    digest: str
    path: str
    config: Config
    fence: Fence
    pin: bool
    keep_alive_seconds: float
    no_wait: bool
    chat_template: str
    def __init__(self, model_name: _Optional[str] = ..., type: _Optional[_Union[BackendType, str]] = ..., digest: _Optional[str] = ..., path: _Optional[str] = ..., config: _Optional[_Union[Config, _Mapping]] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., pin: _Optional[bool] = ..., keep_alive_seconds: _Optional[float] = ..., no_wait: _Optional[bool] = ..., chat_template: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: OpenSessionRequest
    def __init__(self, model: _Optional[_Union[OpenSessionRequest, _Mapping]] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("truncation", "reuse", "sampling", "extra", "prompt_formats", "constraints", "speculation")
    TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FORMATS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    truncation: bool
    reuse: str
    sampling: _containers.RepeatedScalarFieldContainer[str]
    extra: _containers.RepeatedScalarFieldContainer[str]
    prompt_formats: _containers.RepeatedScalarFieldContainer[str]
    constraints: _containers.RepeatedScalarFieldContainer[str]
    speculation: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, truncation: _Optional[bool] = ..., reuse: _Optional[str] = ..., sampling: _Optional[_Iterable[str]] = ..., extra: _Optional[_Iterable[str]] = ..., prompt_formats: _Optional[_Iterable[str]] = ..., constraints: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Iterable[str]] = ...) -> None: ...

class SpecialToken(_message.Message):
    __slots__ = ("id", "text", "kind")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    kind: str
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("backend", "backend_version", "path", "model_digest", "model_max_context", "effective_context", "kv_bytes_per_token", "free_bytes", "weights_bytes", "vocab_size", "tokenizer_digest", "template_digest", "chat_template", "add_bos", "device", "model_name", "capabilities", "bos_token", "eos_token", "special_tokens", "tool_format", "architecture", "footprint", "template_source", "reasoning_format")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    REASONING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    backend: str
    backend_version: str
    path: str
    model_digest: str
    model_max_context: int
    effective_context: int
    kv_bytes_per_token: int
    free_bytes: int
    weights_bytes: int
    vocab_size: int
    tokenizer_digest: str
    template_digest: str
    chat_template: str
    add_bos: bool
    device: str
    model_name: str
    capabilities: Capabilities
    bos_token: str
    eos_token: str
    special_tokens: _containers.RepeatedCompositeFieldContainer[SpecialToken]
    tool_format: str
    architecture: str
    footprint: Footprint
    template_source: str
    reasoning_format: str
    def __init__(self, backend: _Optional[str] = ..., backend_version: _Optional[str] = ..., path: _Optional[str] = ..., model_digest: _Optional[str] = ..., model_max_context: _Optional[int] = ..., effective_context: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., free_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer_digest: _Optional[str] = ..., template_digest: _Optional[str] = ..., chat_template: _Optional[str] = ..., add_bos: _Optional[bool] = ..., device: _Optional[str] = ..., model_name: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., special_tokens: _Optional[_Iterable[_Union[SpecialToken, _Mapping]]] = ..., tool_format: _Optional[str] = ..., architecture: _Optional[str] = ..., footprint: _Optional[_Union[Footprint, _Mapping]] = ..., template_source: _Optional[str] = ..., reasoning_format: _Optional[str] = ...) -> None: ...

class Footprint(_message.Message):
    __slots__ = ("weights_bytes", "kv_bytes_per_token", "compute_floor_bytes", "compute_fixed_bytes", "compute_bytes_per_token", "trained_window", "trained_kv_bytes", "layout", "window", "kv_bytes", "compute_bytes", "overhead_bytes", "total_bytes", "budget_bytes", "max_window", "memory", "sliding_window", "state_bytes", "cuts", "checkpoint_bytes", "swa_kv_bytes_per_token", "swa_ring", "swa_full_kv_bytes", "swa_ring_kv_bytes", "warm", "micro_batch")
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FLOOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIXED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRAINED_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TRAINED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWA_KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SWA_RING_FIELD_NUMBER: _ClassVar[int]
    SWA_FULL_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWA_RING_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    weights_bytes: int
    kv_bytes_per_token: int
    compute_floor_bytes: int
    compute_fixed_bytes: int
    compute_bytes_per_token: int
    trained_window: int
    trained_kv_bytes: int
    layout: str
    window: int
    kv_bytes: int
    compute_bytes: int
    overhead_bytes: int
    total_bytes: int
    budget_bytes: int
    max_window: int
    memory: str
    sliding_window: int
    state_bytes: int
    cuts: str
    checkpoint_bytes: int
    swa_kv_bytes_per_token: int
    swa_ring: bool
    swa_full_kv_bytes: int
    swa_ring_kv_bytes: int
    warm: str
    micro_batch: int
    def __init__(self, weights_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., compute_floor_bytes: _Optional[int] = ..., compute_fixed_bytes: _Optional[int] = ..., compute_bytes_per_token: _Optional[int] = ..., trained_window: _Optional[int] = ..., trained_kv_bytes: _Optional[int] = ..., layout: _Optional[str] = ..., window: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., compute_bytes: _Optional[int] = ..., overhead_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., max_window: _Optional[int] = ..., memory: _Optional[str] = ..., sliding_window: _Optional[int] = ..., state_bytes: _Optional[int] = ..., cuts: _Optional[str] = ..., checkpoint_bytes: _Optional[int] = ..., swa_kv_bytes_per_token: _Optional[int] = ..., swa_ring: _Optional[bool] = ..., swa_full_kv_bytes: _Optional[int] = ..., swa_ring_kv_bytes: _Optional[int] = ..., warm: _Optional[str] = ..., micro_batch: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("info", "machine")
    INFO_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    machine: Machine
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ..., machine: _Optional[_Union[Machine, _Mapping]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "info", "owner_epoch", "owner_instance_id", "identity")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OWNER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    info: ModelInfo
    owner_epoch: int
    owner_instance_id: str
    identity: ContextManifest
    def __init__(self, session_id: _Optional[str] = ..., info: _Optional[_Union[ModelInfo, _Mapping]] = ..., owner_epoch: _Optional[int] = ..., owner_instance_id: _Optional[str] = ..., identity: _Optional[_Union[ContextManifest, _Mapping]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("kind", "byte_start", "byte_end", "hash", "stable", "cache_class", "token_start", "token_end", "role")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTE_START_FIELD_NUMBER: _ClassVar[int]
    BYTE_END_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    STABLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_CLASS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    byte_start: int
    byte_end: int
    hash: str
    stable: bool
    cache_class: str
    token_start: int
    token_end: int
    role: str
    def __init__(self, kind: _Optional[str] = ..., byte_start: _Optional[int] = ..., byte_end: _Optional[int] = ..., hash: _Optional[str] = ..., stable: _Optional[bool] = ..., cache_class: _Optional[str] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class ContextManifest(_message.Message):
    __slots__ = ("profile_id", "backend", "backend_version", "model_digest", "tokenizer_digest", "prompt_format", "prompt_template_digest", "runtime_digest", "add_bos", "stable_bytes", "total_bytes", "stable_byte_hash", "stable_token_hash", "volatile_token_hash", "segments")
    PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEMPLATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    STABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STABLE_BYTE_HASH_FIELD_NUMBER: _ClassVar[int]
    STABLE_TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    VOLATILE_TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    profile_id: str
    backend: str
    backend_version: str
    model_digest: str
    tokenizer_digest: str
    prompt_format: str
    prompt_template_digest: str
    runtime_digest: str
    add_bos: bool
    stable_bytes: int
    total_bytes: int
    stable_byte_hash: str
    stable_token_hash: str
    volatile_token_hash: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, profile_id: _Optional[str] = ..., backend: _Optional[str] = ..., backend_version: _Optional[str] = ..., model_digest: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ..., prompt_format: _Optional[str] = ..., prompt_template_digest: _Optional[str] = ..., runtime_digest: _Optional[str] = ..., add_bos: _Optional[bool] = ..., stable_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., stable_byte_hash: _Optional[str] = ..., stable_token_hash: _Optional[str] = ..., volatile_token_hash: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class PrefixInput(_message.Message):
    __slots__ = ("text", "manifest", "tools_json", "no_wait", "template_args_json")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    text: str
    manifest: ContextManifest
    tools_json: str
    no_wait: bool
    template_args_json: str
    def __init__(self, text: _Optional[str] = ..., manifest: _Optional[_Union[ContextManifest, _Mapping]] = ..., tools_json: _Optional[str] = ..., no_wait: _Optional[bool] = ..., template_args_json: _Optional[str] = ...) -> None: ...

class ReuseDecision(_message.Message):
    __slots__ = ("outcome", "reason", "message", "field", "diverged_at_token", "diverged_segment", "diverged_at_byte", "tier", "context")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_AT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_AT_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    reason: str
    message: str
    field: str
    diverged_at_token: int
    diverged_segment: str
    diverged_at_byte: int
    tier: str
    context: str
    def __init__(self, outcome: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., diverged_at_token: _Optional[int] = ..., diverged_segment: _Optional[str] = ..., diverged_at_byte: _Optional[int] = ..., tier: _Optional[str] = ..., context: _Optional[str] = ...) -> None: ...

class PrefixStatus(_message.Message):
    __slots__ = ("reused_tokens", "prefilled_tokens", "dropped_tokens", "prefix_tokens", "resident_tokens", "available_tokens", "stable_byte_hash", "stable_token_hash", "manifest_digest", "reuse", "prefill_ms", "restore_ms", "diverged_segment_index", "diverged_part", "context_id")
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STABLE_BYTE_HASH_FIELD_NUMBER: _ClassVar[int]
    STABLE_TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_PART_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
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
    prefill_ms: float
    restore_ms: float
    diverged_segment_index: int
    diverged_part: str
    context_id: str
    def __init__(self, reused_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., dropped_tokens: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., available_tokens: _Optional[int] = ..., stable_byte_hash: _Optional[str] = ..., stable_token_hash: _Optional[str] = ..., manifest_digest: _Optional[str] = ..., reuse: _Optional[_Union[ReuseDecision, _Mapping]] = ..., prefill_ms: _Optional[float] = ..., restore_ms: _Optional[float] = ..., diverged_segment_index: _Optional[int] = ..., diverged_part: _Optional[str] = ..., context_id: _Optional[str] = ...) -> None: ...

class SuffixInput(_message.Message):
    __slots__ = ("text", "manifest", "no_wait")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    text: str
    manifest: ContextManifest
    no_wait: bool
    def __init__(self, text: _Optional[str] = ..., manifest: _Optional[_Union[ContextManifest, _Mapping]] = ..., no_wait: _Optional[bool] = ...) -> None: ...

class SuffixStatus(_message.Message):
    __slots__ = ("suffix_tokens", "prefix_tokens", "resident_tokens", "available_tokens", "manifest_digest", "restored_tokens", "prefill_ms", "restore_ms", "reused_tokens")
    SUFFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    suffix_tokens: int
    prefix_tokens: int
    resident_tokens: int
    available_tokens: int
    manifest_digest: str
    restored_tokens: int
    prefill_ms: float
    restore_ms: float
    reused_tokens: int
    def __init__(self, suffix_tokens: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., available_tokens: _Optional[int] = ..., manifest_digest: _Optional[str] = ..., restored_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., restore_ms: _Optional[float] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class DecodeConfig(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repeat_penalty", "extra", "no_wait", "constraint", "tool_choice", "tools_json", "exit_tools_json", "stop_on_signal", "tool_format", "repeated_line_min_chars", "repeated_line_max", "logit_bias", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "speculation")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXIT_TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    STOP_ON_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    REPEATED_LINE_MIN_CHARS_FIELD_NUMBER: _ClassVar[int]
    REPEATED_LINE_MAX_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    repeat_penalty: float
    extra: _containers.ScalarMap[str, str]
    no_wait: bool
    constraint: Constraint
    tool_choice: str
    tools_json: str
    exit_tools_json: str
    stop_on_signal: bool
    tool_format: str
    repeated_line_min_chars: int
    repeated_line_max: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    logprobs: bool
    top_logprobs: int
    speculation: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., repeat_penalty: _Optional[float] = ..., extra: _Optional[_Mapping[str, str]] = ..., no_wait: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., tool_choice: _Optional[str] = ..., tools_json: _Optional[str] = ..., exit_tools_json: _Optional[str] = ..., stop_on_signal: _Optional[bool] = ..., tool_format: _Optional[str] = ..., repeated_line_min_chars: _Optional[int] = ..., repeated_line_max: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., speculation: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens", "prefill_ms", "restore_ms", "decode_ms", "drafted_tokens", "accepted_tokens", "draft_batches", "forced_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_ms: float
    restore_ms: float
    decode_ms: float
    drafted_tokens: int
    accepted_tokens: int
    draft_batches: int
    forced_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., restore_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_batches: _Optional[int] = ..., forced_tokens: _Optional[int] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("stage", "done", "total", "elapsed_ms")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    done: int
    total: int
    elapsed_ms: float
    def __init__(self, stage: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., elapsed_ms: _Optional[float] = ...) -> None: ...

class WarmContext(_message.Message):
    __slots__ = ("id", "tier", "tokens", "prefix_tokens", "bytes", "shared_bytes", "last_used_at", "pinned", "session_id", "checkpoint_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: str
    tier: str
    tokens: int
    prefix_tokens: int
    bytes: int
    shared_bytes: int
    last_used_at: float
    pinned: bool
    session_id: str
    checkpoint_bytes: int
    def __init__(self, id: _Optional[str] = ..., tier: _Optional[str] = ..., tokens: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., last_used_at: _Optional[float] = ..., pinned: _Optional[bool] = ..., session_id: _Optional[str] = ..., checkpoint_bytes: _Optional[int] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("reason", "message", "info")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    info: _error_details_pb2.ErrorInfo
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ..., info: _Optional[_Union[_error_details_pb2.ErrorInfo, _Mapping]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "logprob", "text")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    text: str
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top", "text")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    text: str
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., text: _Optional[str] = ...) -> None: ...

class StreamChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "error", "tool_call_deltas", "tool_calls", "signal", "logprobs", "tool_text", "stop_sequence")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_TEXT_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    error: ErrorDetail
    tool_call_deltas: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    signal: ToolCall
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_text: str
    stop_sequence: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., tool_call_deltas: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., signal: _Optional[_Union[ToolCall, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_text: _Optional[str] = ..., stop_sequence: _Optional[str] = ...) -> None: ...

class ContextReport(_message.Message):
    __slots__ = ("session_id", "model_name", "backend", "num_ctx", "resident_tokens", "prefix_tokens", "suffix_tokens", "generated_tokens", "available_tokens", "kv_tokens", "stable_byte_hash", "stable_token_hash", "volatile_token_hash", "manifest_digest", "manifest", "closed", "last_reuse", "last_prefix", "owner_epoch", "opened_at", "last_used_at", "context_id", "contexts", "queue_position", "queue_wait_seconds", "pinned", "keep_alive_seconds", "changing_segments", "tools_token_start", "tools_token_end", "kv_layout", "warm_exact", "speculation", "drafted_tokens", "accepted_tokens", "draft_batches", "forced_tokens", "ahead")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_CTX_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STABLE_BYTE_HASH_FIELD_NUMBER: _ClassVar[int]
    STABLE_TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    VOLATILE_TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    LAST_REUSE_FIELD_NUMBER: _ClassVar[int]
    LAST_PREFIX_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OPENED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHANGING_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOOLS_TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WARM_EXACT_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
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
    manifest: ContextManifest
    closed: bool
    last_reuse: ReuseDecision
    last_prefix: PrefixStatus
    owner_epoch: int
    opened_at: float
    last_used_at: float
    context_id: str
    contexts: _containers.RepeatedCompositeFieldContainer[WarmContext]
    queue_position: int
    queue_wait_seconds: float
    pinned: bool
    keep_alive_seconds: float
    changing_segments: _containers.RepeatedCompositeFieldContainer[ChangingSegment]
    tools_token_start: int
    tools_token_end: int
    kv_layout: str
    warm_exact: bool
    speculation: str
    drafted_tokens: int
    accepted_tokens: int
    draft_batches: int
    forced_tokens: int
    ahead: PrefixStatus
    def __init__(self, session_id: _Optional[str] = ..., model_name: _Optional[str] = ..., backend: _Optional[str] = ..., num_ctx: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., suffix_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., available_tokens: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., stable_byte_hash: _Optional[str] = ..., stable_token_hash: _Optional[str] = ..., volatile_token_hash: _Optional[str] = ..., manifest_digest: _Optional[str] = ..., manifest: _Optional[_Union[ContextManifest, _Mapping]] = ..., closed: _Optional[bool] = ..., last_reuse: _Optional[_Union[ReuseDecision, _Mapping]] = ..., last_prefix: _Optional[_Union[PrefixStatus, _Mapping]] = ..., owner_epoch: _Optional[int] = ..., opened_at: _Optional[float] = ..., last_used_at: _Optional[float] = ..., context_id: _Optional[str] = ..., contexts: _Optional[_Iterable[_Union[WarmContext, _Mapping]]] = ..., queue_position: _Optional[int] = ..., queue_wait_seconds: _Optional[float] = ..., pinned: _Optional[bool] = ..., keep_alive_seconds: _Optional[float] = ..., changing_segments: _Optional[_Iterable[_Union[ChangingSegment, _Mapping]]] = ..., tools_token_start: _Optional[int] = ..., tools_token_end: _Optional[int] = ..., kv_layout: _Optional[str] = ..., warm_exact: _Optional[bool] = ..., speculation: _Optional[str] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_batches: _Optional[int] = ..., forced_tokens: _Optional[int] = ..., ahead: _Optional[_Union[PrefixStatus, _Mapping]] = ...) -> None: ...

class ChangingSegment(_message.Message):
    __slots__ = ("kind", "position", "index", "turns")
    KIND_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    position: int
    index: int
    turns: int
    def __init__(self, kind: _Optional[str] = ..., position: _Optional[int] = ..., index: _Optional[int] = ..., turns: _Optional[int] = ...) -> None: ...

class Attach(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ExplainContextRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Closed(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelDecode(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeStarted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("request_id", "attach", "ensure_prefix", "prefill_suffix", "decode", "explain_context", "close", "cancel_decode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    ENSURE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SUFFIX_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_DECODE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    attach: Attach
    ensure_prefix: PrefixInput
    prefill_suffix: SuffixInput
    decode: DecodeConfig
    explain_context: ExplainContextRequest
    close: CloseRequest
    cancel_decode: CancelDecode
    def __init__(self, request_id: _Optional[int] = ..., attach: _Optional[_Union[Attach, _Mapping]] = ..., ensure_prefix: _Optional[_Union[PrefixInput, _Mapping]] = ..., prefill_suffix: _Optional[_Union[SuffixInput, _Mapping]] = ..., decode: _Optional[_Union[DecodeConfig, _Mapping]] = ..., explain_context: _Optional[_Union[ExplainContextRequest, _Mapping]] = ..., close: _Optional[_Union[CloseRequest, _Mapping]] = ..., cancel_decode: _Optional[_Union[CancelDecode, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("request_id", "attached", "prefix_status", "suffix_status", "decode_started", "chunk", "context", "closed", "error", "progress")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_STATUS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_STATUS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STARTED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    attached: Attached
    prefix_status: PrefixStatus
    suffix_status: SuffixStatus
    decode_started: DecodeStarted
    chunk: StreamChunk
    context: ContextReport
    closed: Closed
    error: _status_pb2.Status
    progress: PrefillProgress
    def __init__(self, request_id: _Optional[int] = ..., attached: _Optional[_Union[Attached, _Mapping]] = ..., prefix_status: _Optional[_Union[PrefixStatus, _Mapping]] = ..., suffix_status: _Optional[_Union[SuffixStatus, _Mapping]] = ..., decode_started: _Optional[_Union[DecodeStarted, _Mapping]] = ..., chunk: _Optional[_Union[StreamChunk, _Mapping]] = ..., context: _Optional[_Union[ContextReport, _Mapping]] = ..., closed: _Optional[_Union[Closed, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., progress: _Optional[_Union[PrefillProgress, _Mapping]] = ...) -> None: ...

class ExplainContextResponse(_message.Message):
    __slots__ = ("report",)
    REPORT_FIELD_NUMBER: _ClassVar[int]
    report: ContextReport
    def __init__(self, report: _Optional[_Union[ContextReport, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("session_id", "model_name", "backend", "path", "owner_epoch", "opened_at", "last_used_at", "num_ctx", "resident_tokens", "prefix_tokens", "available_tokens", "last_outcome", "closed", "attached", "kv_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OPENED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    NUM_CTX_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_name: str
    backend: str
    path: str
    owner_epoch: int
    opened_at: float
    last_used_at: float
    num_ctx: int
    resident_tokens: int
    prefix_tokens: int
    available_tokens: int
    last_outcome: str
    closed: bool
    attached: bool
    kv_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., model_name: _Optional[str] = ..., backend: _Optional[str] = ..., path: _Optional[str] = ..., owner_epoch: _Optional[int] = ..., opened_at: _Optional[float] = ..., last_used_at: _Optional[float] = ..., num_ctx: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., available_tokens: _Optional[int] = ..., last_outcome: _Optional[str] = ..., closed: _Optional[bool] = ..., attached: _Optional[bool] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("debug",)
    DEBUG_FIELD_NUMBER: _ClassVar[int]
    debug: bool
    def __init__(self, debug: _Optional[bool] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("pid", "state", "isolation", "started_at", "restarts", "last_error", "last_restart_reason", "last_restart_at", "rss_bytes", "log_lines")
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTART_REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTART_AT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOG_LINES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    state: str
    isolation: str
    started_at: float
    restarts: int
    last_error: str
    last_restart_reason: str
    last_restart_at: float
    rss_bytes: int
    log_lines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pid: _Optional[int] = ..., state: _Optional[str] = ..., isolation: _Optional[str] = ..., started_at: _Optional[float] = ..., restarts: _Optional[int] = ..., last_error: _Optional[str] = ..., last_restart_reason: _Optional[str] = ..., last_restart_at: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., log_lines: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelMemory(_message.Message):
    __slots__ = ("isolation", "weights_bytes", "kv_allocated_bytes", "kv_used_bytes", "compute_bytes", "runtime_bytes", "rss_bytes", "checkpoint_bytes")
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    isolation: str
    weights_bytes: int
    kv_allocated_bytes: int
    kv_used_bytes: int
    compute_bytes: int
    runtime_bytes: int
    rss_bytes: int
    checkpoint_bytes: int
    def __init__(self, isolation: _Optional[str] = ..., weights_bytes: _Optional[int] = ..., kv_allocated_bytes: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., compute_bytes: _Optional[int] = ..., runtime_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., checkpoint_bytes: _Optional[int] = ...) -> None: ...

class DaemonMemory(_message.Message):
    __slots__ = ("rss_bytes", "ram_tier_bytes", "own_bytes", "parts_bytes", "measured_bytes", "tolerance_bytes", "untouched_max_bytes")
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNTOUCHED_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    rss_bytes: int
    ram_tier_bytes: int
    own_bytes: int
    parts_bytes: int
    measured_bytes: int
    tolerance_bytes: int
    untouched_max_bytes: int
    def __init__(self, rss_bytes: _Optional[int] = ..., ram_tier_bytes: _Optional[int] = ..., own_bytes: _Optional[int] = ..., parts_bytes: _Optional[int] = ..., measured_bytes: _Optional[int] = ..., tolerance_bytes: _Optional[int] = ..., untouched_max_bytes: _Optional[int] = ...) -> None: ...

class Accelerator(_message.Message):
    __slots__ = ("kind", "name", "memory_bytes", "driver")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    memory_bytes: int
    driver: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., driver: _Optional[str] = ...) -> None: ...

class Machine(_message.Message):
    __slots__ = ("cpu_count", "ram_total_bytes", "ram_available_bytes", "disk_free_bytes", "accelerators", "problems")
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    RAM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATORS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    cpu_count: int
    ram_total_bytes: int
    ram_available_bytes: int
    disk_free_bytes: int
    accelerators: _containers.RepeatedCompositeFieldContainer[Accelerator]
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cpu_count: _Optional[int] = ..., ram_total_bytes: _Optional[int] = ..., ram_available_bytes: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ..., accelerators: _Optional[_Iterable[_Union[Accelerator, _Mapping]]] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...

class Tiers(_message.Message):
    __slots__ = ("ram_entries", "ram_bytes", "ram_budget", "disk_entries", "disk_bytes", "disk_budget", "disk_off_reason", "written", "write_failures", "spilled_to_disk", "dropped", "rejected", "memory_budget", "recent_rejections", "shared_location", "shared_entries", "shared_bytes", "shared_budget", "shared_written", "shared_write_failures", "shared_restored", "shared_rejected", "shared_lookups", "shared_read_failures", "shared_pending")
    RAM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DISK_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DISK_OFF_REASON_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_TO_DISK_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RECENT_REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOCATION_FIELD_NUMBER: _ClassVar[int]
    SHARED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHARED_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SHARED_WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SHARED_RESTORED_FIELD_NUMBER: _ClassVar[int]
    SHARED_REJECTED_FIELD_NUMBER: _ClassVar[int]
    SHARED_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    SHARED_READ_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PENDING_FIELD_NUMBER: _ClassVar[int]
    ram_entries: int
    ram_bytes: int
    ram_budget: int
    disk_entries: int
    disk_bytes: int
    disk_budget: int
    disk_off_reason: str
    written: int
    write_failures: int
    spilled_to_disk: int
    dropped: int
    rejected: int
    memory_budget: int
    recent_rejections: _containers.RepeatedScalarFieldContainer[str]
    shared_location: str
    shared_entries: int
    shared_bytes: int
    shared_budget: int
    shared_written: int
    shared_write_failures: int
    shared_restored: int
    shared_rejected: int
    shared_lookups: int
    shared_read_failures: int
    shared_pending: int
    def __init__(self, ram_entries: _Optional[int] = ..., ram_bytes: _Optional[int] = ..., ram_budget: _Optional[int] = ..., disk_entries: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_budget: _Optional[int] = ..., disk_off_reason: _Optional[str] = ..., written: _Optional[int] = ..., write_failures: _Optional[int] = ..., spilled_to_disk: _Optional[int] = ..., dropped: _Optional[int] = ..., rejected: _Optional[int] = ..., memory_budget: _Optional[int] = ..., recent_rejections: _Optional[_Iterable[str]] = ..., shared_location: _Optional[str] = ..., shared_entries: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., shared_budget: _Optional[int] = ..., shared_written: _Optional[int] = ..., shared_write_failures: _Optional[int] = ..., shared_restored: _Optional[int] = ..., shared_rejected: _Optional[int] = ..., shared_lookups: _Optional[int] = ..., shared_read_failures: _Optional[int] = ..., shared_pending: _Optional[int] = ...) -> None: ...

class LoadedModel(_message.Message):
    __slots__ = ("backend", "path", "model_name", "model_digest", "n_ctx", "resident_tokens", "sessions", "loaded_at", "last_used_at", "sequences", "pool_tokens", "kv_bytes_per_token", "slots", "busy_slots", "queued", "contexts", "counters", "worker", "busy_tokens", "memory")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    BUSY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    backend: str
    path: str
    model_name: str
    model_digest: str
    n_ctx: int
    resident_tokens: int
    sessions: int
    loaded_at: float
    last_used_at: float
    sequences: int
    pool_tokens: int
    kv_bytes_per_token: int
    slots: int
    busy_slots: int
    queued: int
    contexts: _containers.RepeatedCompositeFieldContainer[WarmContext]
    counters: _containers.ScalarMap[str, int]
    worker: Worker
    busy_tokens: int
    memory: ModelMemory
    def __init__(self, backend: _Optional[str] = ..., path: _Optional[str] = ..., model_name: _Optional[str] = ..., model_digest: _Optional[str] = ..., n_ctx: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., sessions: _Optional[int] = ..., loaded_at: _Optional[float] = ..., last_used_at: _Optional[float] = ..., sequences: _Optional[int] = ..., pool_tokens: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., slots: _Optional[int] = ..., busy_slots: _Optional[int] = ..., queued: _Optional[int] = ..., contexts: _Optional[_Iterable[_Union[WarmContext, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., worker: _Optional[_Union[Worker, _Mapping]] = ..., busy_tokens: _Optional[int] = ..., memory: _Optional[_Union[ModelMemory, _Mapping]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("instance_id", "epoch", "pid", "endpoint", "version", "started_at", "uptime_seconds", "backends", "default_backend", "models", "sessions", "limits", "owner_lost", "tiers", "machine", "settings", "memory")
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    OWNER_LOST_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    epoch: int
    pid: int
    endpoint: str
    version: str
    started_at: float
    uptime_seconds: float
    backends: _containers.RepeatedScalarFieldContainer[str]
    default_backend: str
    models: _containers.RepeatedCompositeFieldContainer[LoadedModel]
    sessions: int
    limits: _containers.ScalarMap[str, float]
    owner_lost: str
    tiers: Tiers
    machine: Machine
    settings: _containers.ScalarMap[str, str]
    memory: DaemonMemory
    def __init__(self, instance_id: _Optional[str] = ..., epoch: _Optional[int] = ..., pid: _Optional[int] = ..., endpoint: _Optional[str] = ..., version: _Optional[str] = ..., started_at: _Optional[float] = ..., uptime_seconds: _Optional[float] = ..., backends: _Optional[_Iterable[str]] = ..., default_backend: _Optional[str] = ..., models: _Optional[_Iterable[_Union[LoadedModel, _Mapping]]] = ..., sessions: _Optional[int] = ..., limits: _Optional[_Mapping[str, float]] = ..., owner_lost: _Optional[str] = ..., tiers: _Optional[_Union[Tiers, _Mapping]] = ..., machine: _Optional[_Union[Machine, _Mapping]] = ..., settings: _Optional[_Mapping[str, str]] = ..., memory: _Optional[_Union[DaemonMemory, _Mapping]] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("model", "text", "return_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: OpenSessionRequest
    text: str
    return_token_ids: bool
    def __init__(self, model: _Optional[_Union[OpenSessionRequest, _Mapping]] = ..., text: _Optional[str] = ..., return_token_ids: _Optional[bool] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("count", "token_ids")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    count: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, count: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsResponse(_message.Message):
    __slots__ = ("text", "content_type")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    text: str
    content_type: str
    def __init__(self, text: _Optional[str] = ..., content_type: _Optional[str] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("job", "conversation", "since", "limit", "running", "id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    conversation: str
    since: float
    limit: int
    running: bool
    id: str
    def __init__(self, job: _Optional[str] = ..., conversation: _Optional[str] = ..., since: _Optional[float] = ..., limit: _Optional[int] = ..., running: _Optional[bool] = ..., id: _Optional[str] = ...) -> None: ...

class RequestRecord(_message.Message):
    __slots__ = ("id", "api", "model", "job", "agent", "conversation", "session", "state", "stage", "started_at", "ended_at", "finish", "error", "error_message", "status", "bytes_in", "bytes_out", "outcome", "reason", "tier", "diverged_at_token", "diverged_at_byte", "diverged_segment", "diverged_message", "prefix_tokens", "reused_kv", "reused_ram", "reused_disk", "reused_shared", "restored_tokens", "prefilled_tokens", "prompt_tokens", "cached_tokens", "generated_tokens", "decodes", "drafted_tokens", "accepted_tokens", "draft_batches", "forced_tokens", "ttft_ms", "prefill_ms", "restore_ms", "decode_ms", "progress_done", "progress_total", "excerpt")
    ID_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_AT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_AT_BYTE_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_KV_FIELD_NUMBER: _ClassVar[int]
    REUSED_RAM_FIELD_NUMBER: _ClassVar[int]
    REUSED_DISK_FIELD_NUMBER: _ClassVar[int]
    REUSED_SHARED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_DONE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXCERPT_FIELD_NUMBER: _ClassVar[int]
    id: str
    api: str
    model: str
    job: str
    agent: str
    conversation: str
    session: str
    state: str
    stage: str
    started_at: float
    ended_at: float
    finish: str
    error: str
    error_message: str
    status: int
    bytes_in: int
    bytes_out: int
    outcome: str
    reason: str
    tier: str
    diverged_at_token: int
    diverged_at_byte: int
    diverged_segment: str
    diverged_message: int
    prefix_tokens: int
    reused_kv: int
    reused_ram: int
    reused_disk: int
    reused_shared: int
    restored_tokens: int
    prefilled_tokens: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    decodes: int
    drafted_tokens: int
    accepted_tokens: int
    draft_batches: int
    forced_tokens: int
    ttft_ms: float
    prefill_ms: float
    restore_ms: float
    decode_ms: float
    progress_done: int
    progress_total: int
    excerpt: str
    def __init__(self, id: _Optional[str] = ..., api: _Optional[str] = ..., model: _Optional[str] = ..., job: _Optional[str] = ..., agent: _Optional[str] = ..., conversation: _Optional[str] = ..., session: _Optional[str] = ..., state: _Optional[str] = ..., stage: _Optional[str] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., finish: _Optional[str] = ..., error: _Optional[str] = ..., error_message: _Optional[str] = ..., status: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., tier: _Optional[str] = ..., diverged_at_token: _Optional[int] = ..., diverged_at_byte: _Optional[int] = ..., diverged_segment: _Optional[str] = ..., diverged_message: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., reused_kv: _Optional[int] = ..., reused_ram: _Optional[int] = ..., reused_disk: _Optional[int] = ..., reused_shared: _Optional[int] = ..., restored_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., decodes: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., draft_batches: _Optional[int] = ..., forced_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., restore_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., progress_done: _Optional[int] = ..., progress_total: _Optional[int] = ..., excerpt: _Optional[str] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[RequestRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[RequestRecord, _Mapping]]] = ...) -> None: ...
