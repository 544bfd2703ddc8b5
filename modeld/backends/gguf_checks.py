"""What llama.cpp would abort on, refused in describe with ``model_load_failed`` naming the field.

What: :func:`check` looks at a parsed GGUF header (:class:`~modeld.backends.gguf_header.Header`)
and raises :class:`~modeld.backends.gguf_header.GGUFFormatError` for the dimensions and
vocabularies that crash the pinned llama.cpp build, and for the inconsistencies that would make
describe's figures wrong.

Why: llama.cpp checks some things with ``GGML_ASSERT`` (which aborts the process) and throws
C++ exceptions out of ``noexcept`` functions in others (``std::terminate``). Each case below was
measured by loading a crafted copy of a generated model in a child process (SIGABRT each time):
``block_count`` 0 or over 512, duplicate tokens, a SentencePiece vocabulary without a byte
token (on the first text that needs it), ``expert_count`` over 1024, ``expert_used_count`` 0
with experts or more than the experts, a layer with heads but no KV heads, an unknown
``rope.scaling.type``. A crafted file must never reach the engine; the supervised worker
process is the second line of defence, not the first.

What not: no complete validation of every architecture (llama.cpp refuses most other mistakes
cleanly, with an error, and so does OpenVINO); the limits of the format itself are in
:mod:`modeld.backends.gguf_header`. Record: ``blueprints/0013-probing-and-inventory.md``.
"""

from __future__ import annotations

from modeld.backends.gguf_header import ARRAY, F32, I32, STRING, GGUFFormatError, Header
from modeld.backends.gguf_layers import layer_memory

__all__ = ["MAX_EXPERTS", "MAX_LAYERS", "ROPE_SCALING_TYPES", "check"]

MAX_LAYERS = 512
"""llama.cpp's ``LLAMA_MAX_LAYERS``: more (or 0) aborts the process in ``load_hparams``."""
MAX_EXPERTS = 1024
"""``LLAMA_MAX_EXPERTS`` of the pinned llama.cpp (measured: 1025 aborts)."""
ROPE_SCALING_TYPES = frozenset({"none", "linear", "yarn", "longrope"})
"""What llama.cpp knows; any other ``rope.scaling.type`` aborts the process."""


def check(h: Header, arch: str, layers: int, tokens: list[bytes]) -> None:
    """Refuse the dimensions and vocabularies that crash llama.cpp (measured on the pinned
    build: each of these aborted the process with GGML_ASSERT or an uncaught exception) and the
    inconsistencies that would make describe's figures wrong."""
    key = f"{arch}.block_count"
    if not 1 <= layers <= MAX_LAYERS:
        raise GGUFFormatError(f"has {key} = {layers}; a model has 1 to {MAX_LAYERS} layers", field=key)
    key = f"{arch}.context_length"
    if key in h.kvs and h.integer(key) <= 0:
        raise GGUFFormatError(
            f"has {key} = 0; a model is trained on a context of at least one token", field=key
        )
    heads = h.integers(f"{arch}.attention.head_count")
    kv = h.integers(f"{arch}.attention.head_count_kv")
    for name, values in (("head_count", heads), ("head_count_kv", kv)):
        key = f"{arch}.attention.{name}"
        if values is not None and h.kvs[key].type == ARRAY and len(values) != layers:
            raise GGUFFormatError(
                f"has {len(values)} per-layer values for {key}, for {layers} layers", field=key
            )
    per_layer_heads = (heads * layers if len(heads) == 1 else heads) if heads is not None else [0] * layers
    per_layer_kv = per_layer_heads if kv is None else (kv * layers if len(kv) == 1 else kv)
    # Layers that keep a recurrent state instead of attention have no KV heads (gguf_layers).
    memory = layer_memory(h, arch, layers, tuple(per_layer_kv))
    if heads is not None and not any(memory.recurrent):
        key = f"{arch}.attention.head_count"
        if max(heads) <= 0:
            raise GGUFFormatError(f"has {key} = 0; an attention model has at least one head", field=key)
    for i, (n_head, n_kv) in enumerate(zip(per_layer_heads, per_layer_kv, strict=True)):
        if n_head > 0 and not memory.recurrent[i] and (n_kv <= 0 or n_head % n_kv):
            key = f"{arch}.attention.head_count_kv"
            raise GGUFFormatError(
                f"has {n_head} attention heads and {n_kv} KV heads in layer {i}; "
                "the KV heads must divide the heads",
                field=key,
            )
    experts = h.integer(f"{arch}.expert_count")
    used = h.integer(f"{arch}.expert_used_count")
    if experts > MAX_EXPERTS:
        raise GGUFFormatError(
            f"has {arch}.expert_count = {experts}; at most {MAX_EXPERTS}", field=f"{arch}.expert_count"
        )
    if (experts > 0 and not 1 <= used <= experts) or (experts == 0 and used > 0):
        raise GGUFFormatError(
            f"has {arch}.expert_used_count = {used} for {experts} experts", field=f"{arch}.expert_used_count"
        )
    key = f"{arch}.rope.scaling.type"
    if key in h.kvs:
        v = h.kvs[key]
        scaling = h.py(key) if v.type == STRING else None
        if scaling not in ROPE_SCALING_TYPES:
            raise GGUFFormatError(
                f"has a {key} llama.cpp does not know (one of {sorted(ROPE_SCALING_TYPES)})", field=key
            )
    _check_vocabulary(h, arch, tokens)


def _check_vocabulary(h: Header, arch: str, tokens: list[bytes]) -> None:
    key = "tokenizer.ggml.tokens"
    if key not in h.kvs:
        return
    v = h.kvs[key]
    if v.type != ARRAY or v.item != STRING or not tokens:
        raise GGUFFormatError(f"has {key} that is not a non-empty array of strings", field=key)
    for name, item in (("tokenizer.ggml.token_type", I32), ("tokenizer.ggml.scores", F32)):
        w = h.kvs.get(name)
        if w is not None and (w.type != ARRAY or w.item != item or w.count != len(tokens)):
            raise GGUFFormatError(
                f"has {name} that is not one {'i32' if item == I32 else 'f32'} per token", field=name
            )
    w = h.kvs.get("tokenizer.ggml.merges")
    if w is not None and (w.type != ARRAY or w.item != STRING):
        raise GGUFFormatError(
            "has tokenizer.ggml.merges that is not an array of strings", field="tokenizer.ggml.merges"
        )
    key = f"{arch}.vocab_size"
    declared = h.integer(key)
    if key in h.kvs and declared != len(tokens):
        raise GGUFFormatError(f"has {key} = {declared} but {len(tokens)} tokens", field=key)
    # llama.cpp maps an empty token i to "[EMPTY_i]", then asserts every token is distinct.
    distinct = {t or b"[EMPTY_%d]" % i for i, t in enumerate(tokens)}
    if len(distinct) != len(tokens):
        raise GGUFFormatError(
            f"has {len(tokens) - len(distinct)} duplicate tokens in tokenizer.ggml.tokens",
            field="tokenizer.ggml.tokens",
        )
    if h.py("tokenizer.ggml.model") == "llama":
        # SentencePiece falls back to byte tokens <0xNN> (or the byte itself) for any text it
        # has no token for; llama.cpp throws out of a noexcept function when one is missing.
        missing = [b for b in range(256) if b"<0x%02X>" % b not in distinct and bytes([b]) not in distinct]
        if missing:
            raise GGUFFormatError(
                f"has a SentencePiece vocabulary without the byte token <0x{missing[0]:02X}> "
                f"({len(missing)} of 256 missing); llama.cpp needs all of them",
                field="tokenizer.ggml.tokens",
            )
