"""Which layers of a GGUF model keep per-token KV and which keep a recurrent state, from its header.

What: :func:`layer_memory` reads the header keys llama.cpp's loaders read to mark a layer
recurrent (``{arch}.attention.recurrent_layers``; ``{arch}.full_attention_interval``, every
other layer being linear attention; a ``head_count_kv`` of 0 in a layer of a model with
state-space, RWKV or short-convolution keys; no attention heads at all) and the size of the state
such a layer keeps per sequence, as llama.cpp's ``llama_hparams::n_embd_r`` and ``n_embd_s``
count it (RWKV's token shift and WKV state; a short convolution's cache; Mamba, Mamba-2 and
gated DeltaNet's convolution and SSM states; f32).

Why from the header's structure rather than from a list of architecture names: a list goes
stale (modeld's missed qwen35 and called it pure recurrent, and would have called lfm2moe
cuttable), while these keys are what the engine itself reads. The engine's own answer
(``llama_model_is_recurrent``, ``llama_model_is_hybrid``, ``llama_model_n_swa``) is taken when
the model loads (:mod:`modeld.backends.llama_context`), and the tests check that both agree on
every generated architecture.

What not: architectures whose recurrent layers are sized by keys not read here (Kimi's KDA,
MiniMax's linear attention) get a state of 0 bytes in describe; the loaded engine is still
right about what can be cut.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from modeld.backends.gguf_header import ARRAY, BOOL, INTEGERS, Header

__all__ = ["SWA_PATTERNS", "LayerMemory", "layer_memory", "sliding_layers"]

_STATE_BYTES = 4
"""llama.cpp keeps recurrent states in f32 (``type_r``, ``type_s``)."""


@dataclass(frozen=True, slots=True)
class LayerMemory:
    """``recurrent[i]``: layer ``i`` keeps a recurrent state (``state_bytes`` per sequence each);
    ``attention[i]``: it keeps per-token KV (both may hold: Falcon-H1's parallel layers)."""

    recurrent: tuple[bool, ...]
    attention: tuple[bool, ...]
    state_bytes: int

    @property
    def sequence_state_bytes(self) -> int:
        """A sequence's whole recurrent state: every recurrent layer's."""
        return self.state_bytes * sum(self.recurrent)


def _flags(h: Header, key: str, layers: int) -> tuple[bool, ...] | None:
    v = h.get(key)
    if v is None or v.type != ARRAY or v.count != layers:
        return None
    if v.item == BOOL:
        return tuple(bool(b) for b in struct.unpack_from(f"{v.count}B", h.buf, v.start))
    if v.item in INTEGERS:
        values = h.integers(key) or []
        return tuple(bool(x) for x in values)
    return None


def layer_memory(h: Header, arch: str, layers: int, kv_heads: tuple[int, ...]) -> LayerMemory:
    """The memory each layer keeps (see the module docstring); ``kv_heads`` as the header gives
    them per layer (a scalar repeated)."""

    def hp(key: str) -> str:
        return f"{arch}.{key}"

    rwkv = hp("wkv.head_size") in h.kvs
    shortconv = hp("shortconv.l_cache") in h.kvs
    ssm = any(k.startswith(hp("ssm.")) for k in h.kvs)
    stateful = rwkv or shortconv or ssm
    per_layer_kv = (
        hp("attention.head_count_kv") in h.kvs and h.kvs[hp("attention.head_count_kv")].type == ARRAY
    )
    no_heads = max(h.integers(hp("attention.head_count")) or [0]) <= 0
    recurrent = _flags(h, hp("attention.recurrent_layers"), layers)
    if recurrent is None and hp("full_attention_interval") in h.kvs:
        interval = max(1, h.integer(hp("full_attention_interval")))
        recurrent = tuple((i + 1) % interval != 0 for i in range(layers))
    if recurrent is None and stateful:
        if no_heads:
            recurrent = (True,) * layers
        elif per_layer_kv:
            recurrent = tuple(kv == 0 for kv in kv_heads)
        else:
            recurrent = (True,) * layers  # attention and a state in every layer (Falcon-H1)
    if recurrent is None:
        recurrent = (False,) * layers
    if no_heads:
        attention = (False,) * layers
    elif hp("full_attention_interval") in h.kvs or hp("attention.recurrent_layers") in h.kvs:
        attention = tuple(not r for r in recurrent)
    else:
        attention = tuple(kv > 0 for kv in kv_heads)
    embd = h.integer(hp("embedding_length"))
    if rwkv:
        r = h.integer(hp("token_shift_count"), 2) * embd
        s = embd * h.integer(hp("wkv.head_size"))
    else:
        conv = max(0, h.integer(hp("ssm.conv_kernel")) - 1)
        inner, state = h.integer(hp("ssm.inner_size")), h.integer(hp("ssm.state_size"))
        if shortconv:
            r = embd * max(0, h.integer(hp("shortconv.l_cache")) - 1)
        else:
            r = conv * (inner + 2 * h.integer(hp("ssm.group_count")) * state)
        s = state * inner
    return LayerMemory(recurrent=recurrent, attention=attention, state_bytes=(r + s) * _STATE_BYTES)


SWA_PATTERNS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "gemma3n": (5, False),
    "gemma-embedding": (6, False),
    "gpt-oss": (2, False),
    "cohere2": (4, False),
    "exaone4": (4, False),
    "llama4": (4, False),
    "olmo2": (4, False),
}
"""Which layers of a sliding-window model are local when its header has no
``attention.sliding_window_pattern``: ``(n, dense_first)`` as the vendored llama.cpp's loaders
pass to ``load_swa_pattern`` (``src/models/<arch>.cpp``; gemma3: 5 local layers to 1 global,
gpt-oss: every other layer). The key, when present, decides, as it does for the engine. An
architecture not listed counts every layer as global (no ring is assumed smaller than it is)."""


def sliding_layers(h: Header, arch: str, layers: int, window: int) -> tuple[bool, ...]:
    """Per layer: does it attend over a sliding window of ``window`` tokens (llama.cpp's
    ``hparams.is_swa``)? From ``{arch}.attention.sliding_window_pattern`` (a per-layer array,
    or ``n``: the last layer of every ``n`` is global), else :data:`SWA_PATTERNS`; none without a
    window."""
    if window <= 0 or layers <= 0:
        return ()
    key = f"{arch}.attention.sliding_window_pattern"
    flags = _flags(h, key, layers)
    if flags is not None:
        return flags
    n, dense_first = SWA_PATTERNS.get(arch, (1, False))
    value = h.get(key)
    if value is not None and value.type != ARRAY and value.type in INTEGERS:
        n, dense_first = h.integer(key), False
    if dense_first:
        return tuple(n == 0 or i % n != 0 for i in range(layers))
    return tuple(n == 0 or i % n < n - 1 for i in range(layers))
