"""Generated models of the architectures whose memory cannot be cut at any token (blueprint 0008).

What: :class:`ArchSpec` describes a tiny random-weight model of one of the classes the issue
names, and :func:`write_arch` writes it as a GGUF file llama.cpp loads:

* sliding-window attention: ``gemma3`` (5 local layers to 1 global, a window of 32 tokens) and
  ``gpt-oss`` (alternating local and global layers, attention sinks, a mixture of experts);
* short-convolution hybrid: ``lfm2`` (conv layers, and attention layers where
  ``head_count_kv`` is not 0);
* gated-DeltaNet hybrid: ``qwen35`` (linear attention, full attention every 4th layer);
* Mamba-2 hybrid: ``granitehybrid`` (Mamba-2 layers where ``head_count_kv`` is 0);
* pure recurrent: ``mamba2``.

Tensor names, shapes and metadata keys follow the vendored llama.cpp's loaders
(``src/models/<arch>.cpp``: ``load_arch_hparams`` and ``load_arch_tensors``; names in
``src/llama-arch.cpp``), written here from those facts. Every model takes TINY's vocabulary and
chat template (the same tokens, so tests can compare them with TINY's); matrices are f16, norms
and what ggml's recurrent ops read directly are f32. Weights are uniform random values from the
same keyed PCG64 streams as the other test models (:mod:`modeld.testmodels._gguf`), scaled so a
layer's output has about the RMS of its input; the recurrent parts decay (negative ``A``,
time-step biases well below 0), so the state stays finite over long prompts.

What not: the text is garbage, and no model here loads in OpenVINO.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

import gguf
import numpy as np
import numpy.typing as npt

from modeld.testmodels._gguf import SPEC_DIGEST_KEY, _ones, _Tensor, _uniform
from modeld.testmodels._spec import GENERATOR_VERSION
from modeld.testmodels._template import CHATML_TOOLS_TEMPLATE
from modeld.testmodels._tokenizer import TOKEN_TYPE_NORMAL, Vocabulary, build_vocabulary

__all__ = [
    "ARCH_SPECS",
    "GEMMA3",
    "GPT_OSS",
    "GRANITE_HYBRID",
    "LFM2",
    "MAMBA2",
    "QWEN35",
    "ArchSpec",
    "write_arch",
]

ARCHS: Final = ("gemma3", "gpt-oss", "lfm2", "qwen35", "granitehybrid", "mamba2")
_RMS_EPS: Final = 1e-6
_SPECIAL_ROW_SCALE: Final = 0.02
_LOGIT_STD: Final = 6.0


@dataclass(frozen=True)
class ArchSpec:
    """A tiny model of one of :data:`ARCHS` (see the module docstring).

    ``attention`` lists the layers with attention (the others are recurrent or convolutional;
    ignored by the pure-attention and pure-recurrent architectures). ``kv_heads`` and
    ``head_dim`` size the attention layers; ``sliding_window`` the local layers' window (0: none);
    ``ssm_*`` the recurrent layers: state size per head, convolution width, groups (DeltaNet's key
    heads), heads (Mamba-2's heads, DeltaNet's value heads); ``conv_cache`` LFM2's short
    convolution; ``experts`` / ``experts_used`` gpt-oss's mixture."""

    name: str
    arch: str
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    ff: int = 256
    attention: tuple[int, ...] = ()
    sliding_window: int = 0
    ssm_state: int = 0
    ssm_conv: int = 0
    ssm_groups: int = 0
    ssm_heads: int = 0
    conv_cache: int = 0
    experts: int = 0
    experts_used: int = 0
    vocab_size: int = 4096
    context_length: int = 32768
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.arch not in ARCHS:
            problems.append(f"arch {self.arch!r} is not one of {ARCHS}")
        if any(not 0 <= i < self.layers for i in self.attention):
            problems.append("attention names layers that do not exist")
        if self.heads and self.heads % max(1, self.kv_heads):
            problems.append("heads must be a multiple of kv_heads")
        if self.arch in ("granitehybrid", "mamba2") and (
            not self.ssm_heads or (2 * self.hidden) % self.ssm_heads
        ):
            problems.append("Mamba-2 needs ssm_heads dividing its inner width 2 * hidden")
        if problems:
            raise ValueError(f"invalid ArchSpec {self.name!r}: " + "; ".join(problems))

    def digest(self) -> str:
        """The cache identity of the file: a digest of ``(spec, GENERATOR_VERSION)``."""
        payload = json.dumps(
            {"generator_version": GENERATOR_VERSION, "arch_spec": asdict(self)},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    @property
    def file_name(self) -> str:
        return f"{self.name}-{self.digest()}.gguf"

    @property
    def ssm_inner(self) -> int:
        """Mamba-2's inner width (``2 * hidden``: the only expansion llama.cpp supports)."""
        return 2 * self.hidden

    def is_attention(self, layer: int) -> bool:
        if self.arch in ("gemma3", "gpt-oss"):
            return True
        if self.arch == "mamba2":
            return False
        return layer in self.attention


# Sliding window 32, 5 local layers to 1 global (Gemma 3's pattern of 6), query/key norms.
GEMMA3: Final = ArchSpec(name="swa-gemma3", arch="gemma3", layers=6, sliding_window=32)
# gpt-oss: local and global layers alternating, a learned sink per head, 4 experts (2 used).
GPT_OSS: Final = ArchSpec(
    name="swa-gptoss", arch="gpt-oss", layers=4, sliding_window=32, ff=128, experts=4, experts_used=2
)
# LFM2: short convolutions (cache of 3), attention in layers 2 and 5.
LFM2: Final = ArchSpec(name="hybrid-lfm2", arch="lfm2", layers=6, attention=(2, 5), conv_cache=3)
# Qwen3.5: gated DeltaNet with full attention every 4th layer (layer 3); 2 key heads and 4 value
# heads of 32.
QWEN35: Final = ArchSpec(
    name="hybrid-qwen35", arch="qwen35", layers=4, attention=(3,), ssm_state=32, ssm_conv=4,
    ssm_groups=2, ssm_heads=4,
)  # fmt: skip
# Granite 4.0-H: Mamba-2 layers with attention in layer 2 (8 heads of 32, state 16, 1 group).
GRANITE_HYBRID: Final = ArchSpec(
    name="hybrid-granite", arch="granitehybrid", layers=4, attention=(2,), ssm_state=16, ssm_conv=4,
    ssm_groups=1, ssm_heads=8,
)  # fmt: skip
# Mamba-2, no attention at all.
MAMBA2: Final = ArchSpec(
    name="recurrent-mamba2", arch="mamba2", layers=2, heads=0, kv_heads=0, head_dim=0, ff=0,
    ssm_state=16, ssm_conv=4, ssm_groups=1, ssm_heads=8,
)  # fmt: skip

ARCH_SPECS: Final = (GEMMA3, GPT_OSS, LFM2, QWEN35, GRANITE_HYBRID, MAMBA2)


# --- tensors ---------------------------------------------------------------------------------------


def _mat(name: str, out: int, inp: int, gain: float = 1.0) -> _Tensor:
    return _Tensor(name, (out, inp), gain / math.sqrt(inp))


def _f32(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> _Tensor:
    return _Tensor(name, shape, std, mean=mean, f32=True)


def _ffn(s: ArchSpec, b: str) -> list[_Tensor]:
    h, ff = s.hidden, s.ff
    return [
        _ones(f"{b}.ffn_norm.weight", h),
        _mat(f"{b}.ffn_gate.weight", ff, h),
        _mat(f"{b}.ffn_up.weight", ff, h),
        _mat(f"{b}.ffn_down.weight", h, ff),
    ]


def _qkv(s: ArchSpec, b: str, q_width: int) -> list[_Tensor]:
    h, kv = s.hidden, s.kv_heads * s.head_dim
    return [
        _Tensor(f"{b}.attn_q.weight", (q_width, h), math.sqrt(4.0 / h)),
        _Tensor(f"{b}.attn_k.weight", (kv, h), math.sqrt(4.0 / h)),
        _mat(f"{b}.attn_v.weight", kv, h),
        _mat(f"{b}.attn_output.weight", h, s.heads * s.head_dim),
    ]


def _mamba2_mixer(s: ArchSpec, b: str) -> list[_Tensor]:
    """A Mamba-2 mixer (``llama_model_mamba2`` / ``llama_model_granite_hybrid``)."""
    h, di, ds, ng, nh, dc = s.hidden, s.ssm_inner, s.ssm_state, s.ssm_groups, s.ssm_heads, s.ssm_conv
    conv_dim = di + 2 * ng * ds
    return [
        _mat(f"{b}.ssm_in.weight", di + conv_dim + nh, h),
        _f32(f"{b}.ssm_conv1d.weight", (conv_dim, dc), 1.0 / math.sqrt(dc)),
        _f32(f"{b}.ssm_conv1d.bias", (conv_dim,), 0.25),
        _f32(f"{b}.ssm_dt.bias", (nh,), 1.0, mean=-5.0),
        _Tensor(f"{b}.ssm_a", (nh, 1), 0.0, fill="ssm_a", f32=True),
        _Tensor(f"{b}.ssm_d", (nh, 1), 0.0, fill="ones", f32=True),
        _Tensor(f"{b}.ssm_norm.weight", (ng, di // ng), 0.0, fill="ones", f32=True),
        _mat(f"{b}.ssm_out.weight", h, di),
    ]


def _deltanet(s: ArchSpec, b: str) -> list[_Tensor]:
    """A gated DeltaNet layer (``llama_model_qwen35``'s linear attention)."""
    h, dk, nk, nv, dc = s.hidden, s.ssm_state, s.ssm_groups, s.ssm_heads, s.ssm_conv
    key_dim, value_dim = dk * nk, dk * nv
    return [
        _mat(f"{b}.attn_qkv.weight", 2 * key_dim + value_dim, h),
        _mat(f"{b}.attn_gate.weight", value_dim, h),
        _f32(f"{b}.ssm_conv1d.weight", (2 * key_dim + value_dim, dc), 1.0 / math.sqrt(dc)),
        _f32(f"{b}.ssm_dt.bias", (nv,), 1.0, mean=-4.0),
        _Tensor(f"{b}.ssm_a", (nv,), 0.0, fill="ssm_a", f32=True),
        _mat(f"{b}.ssm_beta.weight", nv, h),
        _mat(f"{b}.ssm_alpha.weight", nv, h),
        _Tensor(f"{b}.ssm_norm.weight", (dk,), 0.0, fill="ones", f32=True),
        _mat(f"{b}.ssm_out.weight", h, value_dim),
    ]


def _layer(s: ArchSpec, i: int) -> list[_Tensor]:
    b, h, hd = f"blk.{i}", s.hidden, s.head_dim
    if s.arch == "gemma3":
        return [
            _ones(f"{b}.attn_norm.weight", h),
            *_qkv(s, b, s.heads * hd),
            _ones(f"{b}.post_attention_norm.weight", h),
            _ones(f"{b}.attn_k_norm.weight", hd),
            _ones(f"{b}.attn_q_norm.weight", hd),
            *_ffn(s, b),
            _ones(f"{b}.post_ffw_norm.weight", h),
        ]
    if s.arch == "gpt-oss":
        e, ff = s.experts, s.ff
        return [
            _ones(f"{b}.attn_norm.weight", h),
            _ones(f"{b}.post_attention_norm.weight", h),
            *_qkv(s, b, s.heads * hd),
            _f32(f"{b}.attn_sinks.weight", (s.heads,), 1.0),
            _f32(f"{b}.attn_output.bias", (h,), 0.02),
            _mat(f"{b}.ffn_gate_inp.weight", e, h),
            _f32(f"{b}.ffn_gate_inp.bias", (e,), 0.1),
            _Tensor(f"{b}.ffn_gate_exps.weight", (e, ff, h), 1.0 / math.sqrt(h)),
            _Tensor(f"{b}.ffn_up_exps.weight", (e, ff, h), 1.0 / math.sqrt(h)),
            _Tensor(f"{b}.ffn_down_exps.weight", (e, h, ff), 1.0 / math.sqrt(ff)),
            _f32(f"{b}.ffn_gate_exps.bias", (e, ff), 0.02),
            _f32(f"{b}.ffn_up_exps.bias", (e, ff), 0.02),
            _f32(f"{b}.ffn_down_exps.bias", (e, h), 0.02),
        ]
    if s.arch == "lfm2":
        mixer = (
            [
                _ones(f"{b}.attn_q_norm.weight", hd),
                _ones(f"{b}.attn_k_norm.weight", hd),
                *_qkv(s, b, s.heads * hd),
            ]
            if s.is_attention(i)
            else [
                _f32(f"{b}.shortconv.conv.weight", (h, s.conv_cache), 1.0 / math.sqrt(s.conv_cache)),
                _mat(f"{b}.shortconv.in_proj.weight", 3 * h, h),
                _mat(f"{b}.shortconv.out_proj.weight", h, h),
            ]
        )
        return [*_ffn(s, b), _ones(f"{b}.attn_norm.weight", h), *mixer]
    if s.arch == "qwen35":
        mixer = (
            [
                # The query projection holds the query and its output gate (2 x heads x head_dim).
                *_qkv(s, b, 2 * s.heads * hd),
                _ones(f"{b}.attn_q_norm.weight", hd),
                _ones(f"{b}.attn_k_norm.weight", hd),
            ]
            if s.is_attention(i)
            else _deltanet(s, b)
        )
        return [
            _ones(f"{b}.attn_norm.weight", h),
            _ones(f"{b}.post_attention_norm.weight", h),
            *mixer,
            *[t for t in _ffn(s, b) if not t.name.endswith("ffn_norm.weight")],
        ]
    if s.arch == "granitehybrid":
        mixer = _qkv(s, b, s.heads * hd) if s.is_attention(i) else _mamba2_mixer(s, b)
        return [_ones(f"{b}.attn_norm.weight", h), *mixer, *_ffn(s, b)]
    return [_ones(f"{b}.attn_norm.weight", h), *_mamba2_mixer(s, b)]  # mamba2


def tensor_plan(s: ArchSpec) -> list[_Tensor]:
    h = s.hidden
    plan = [_Tensor("token_embd.weight", (s.vocab_size, h), 1.0)]
    for i in range(s.layers):
        plan += _layer(s, i)
    # LFM2's final norm is stored under the embedding norm's name (llama.cpp's LFM2 loader).
    plan.append(_ones("token_embd_norm.weight" if s.arch == "lfm2" else "output_norm.weight", h))
    plan.append(_Tensor("output.weight", (s.vocab_size, h), _LOGIT_STD / math.sqrt(h)))
    return plan


def _values(s: ArchSpec, vocab: Vocabulary, t: _Tensor) -> npt.NDArray[np.float32]:
    if t.fill == "ones":
        return np.ones(t.shape, dtype=np.float32)
    if t.fill == "ssm_a":
        # A = -exp(A_log), A_log = log(1..n) over the heads: each head decays at its own rate.
        n = t.shape[0]
        return (-np.arange(1, n + 1, dtype=np.float32)).reshape(t.shape)
    values = _uniform(s.seed, t.name, t.shape, t.std)
    if t.mean:
        values += np.float32(t.mean)
    if t.name == "output.weight":
        special = np.array([ty != TOKEN_TYPE_NORMAL for ty in vocab.token_types])
        values[special] *= np.float32(_SPECIAL_ROW_SCALE)
    return values


# --- the file --------------------------------------------------------------------------------------


def write_arch(spec: ArchSpec, path: Path) -> None:
    """Write ``spec``'s model to ``path`` (overwriting it). Deterministic."""
    vocab = build_vocabulary(spec.vocab_size, spec.seed)
    plan = tensor_plan(spec)
    writer = gguf.GGUFWriter(path, arch=spec.arch)
    f16 = gguf.GGMLQuantizationType.F16
    try:
        _metadata(writer, spec, vocab)
        for t in plan:
            if t.f32:
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), 4 * math.prod(t.shape))
            else:
                shape = gguf.quant_shape_to_byte_shape(t.shape, f16)
                writer.add_tensor_info(t.name, shape, np.dtype(np.uint8), math.prod(shape), raw_dtype=f16)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan:
            values = _values(spec, vocab, t)
            writer.write_tensor_data(values if t.f32 else gguf.quants.quantize(values, f16))
    finally:
        writer.close()


def _metadata(w: gguf.GGUFWriter, s: ArchSpec, vocab: Vocabulary) -> None:
    w.add_name(f"modeld-test-{s.name}")
    w.add_description(
        f"Random weights for tests ({s.arch}); modeld.testmodels generator {GENERATOR_VERSION}, "
        f"seed {s.seed}. Not a language model."
    )
    w.add_string(SPEC_DIGEST_KEY, s.digest())
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(s.vocab_size)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_layer_norm_rms_eps(_RMS_EPS)
    if s.arch != "mamba2":
        w.add_feed_forward_length(s.ff)
        w.add_head_count(s.heads)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.arch in ("lfm2", "granitehybrid"):
        # A layer without KV heads is recurrent (both loaders read it so).
        w.add_head_count_kv([s.kv_heads if s.is_attention(i) else 0 for i in range(s.layers)])
    elif s.arch != "mamba2":
        w.add_head_count_kv(s.kv_heads)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
        w.add_rope_freq_base_swa(10000.0)
    if s.arch == "gpt-oss":
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_feed_forward_length(s.ff)
    if s.arch == "lfm2":
        w.add_shortconv_l_cache(s.conv_cache)
    if s.arch in ("qwen35", "granitehybrid", "mamba2"):
        inner = s.ssm_state * s.ssm_heads if s.arch == "qwen35" else s.ssm_inner
        w.add_ssm_conv_kernel(s.ssm_conv)
        w.add_ssm_inner_size(inner)
        w.add_ssm_state_size(s.ssm_state)
        w.add_ssm_time_step_rank(s.ssm_heads)
        w.add_ssm_group_count(s.ssm_groups)
    if s.arch == "qwen35":
        w.add_full_attention_interval(s.attention[0] + 1 if s.attention else s.layers)
        # Interleaved multi-section RoPE over a quarter of the head, as Qwen3.5's partial rotary.
        w.add_rope_dimension_count(s.head_dim // 2)
        w.add_rope_dimension_sections([3, 3, 2, 0])
    elif s.arch != "mamba2":
        w.add_rope_dimension_count(s.head_dim)
    if s.arch != "mamba2":
        w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.token_types))
    w.add_token_merges(list(vocab.merges))
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML_TOOLS_TEMPLATE)
