"""Write one test model as a GGUF file: metadata, vocabulary, chat template, random weights.

What: :func:`write_gguf` streams a llama- or mamba-architecture GGUF (``gguf.GGUFWriter`` +
NumPy) to a path, one tensor at a time, so the 400 MB realistic model never sits in memory
twice.

Why these choices (measured facts in ``ENGINES.md``, decisions in
``blueprints/0008-test-models.md``):

* metadata keys and tensor names are the subset that both llama.cpp and OpenVINO GenAI accept;
  matrices are f16 or q8_0 (OpenVINO refuses f32 matrices), norms stay f32;
* weights come from PCG64 *raw* 64-bit outputs turned into uniform floats here, because the
  bit stream of ``PCG64(SeedSequence(...))`` is fixed by its algorithm while NumPy's
  distribution methods (``normal``, ``uniform``, ...) may change between NumPy versions;
  every tensor has its own stream keyed by (seed, tensor name), so order does not matter;
* the scales are tuned so that greedy decoding of the random model is context dependent, not
  degenerate, and usually has a comfortable top-1 margin (see :class:`WeightRecipe`);
* control and filler tokens get tiny output rows, so greedy decoding never emits them and a
  decode of N tokens really produces N tokens;
* mamba (RECURRENT) follows llama.cpp's ``llama_model_mamba::load_arch_tensors`` and the
  metadata of its ``conversion/mamba.py``; the tensors ggml's SSM ops read directly
  (``ssm_conv1d``, ``ssm_a``, biases, ``ssm_d``) are f32, the projections f16/q8_0.

What not: no torch, no downloads, no training of weights; the text it generates is garbage.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import gguf
import numpy as np
import numpy.typing as npt

from modeld.testmodels._copying import copying_values, filler_gain
from modeld.testmodels._reply import BLOCK_GAIN, reply_output
from modeld.testmodels._spec import GENERATOR_VERSION, ModelSpec
from modeld.testmodels._template import CHATML_THINK_TEMPLATE, CHATML_TOOLS_TEMPLATE
from modeld.testmodels._tokenizer import TOKEN_TYPE_NORMAL, Vocabulary, build_vocabulary
from modeld.testmodels._tools import tools_values

__all__ = ["SPEC_DIGEST_KEY", "WeightRecipe", "recipe_for", "write_gguf"]

SPEC_DIGEST_KEY: Final = "modeld.testmodels.spec_digest"
_RMS_EPS: Final = 1e-6
_FILE_TYPE: Final = {
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
_MATRIX_TYPE: Final = {
    "f16": gguf.GGMLQuantizationType.F16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
_SPECIAL_ROW_SCALE: Final = 0.02
_TIED_EMBEDDING_FACTOR: Final = 0.3


@dataclass(frozen=True)
class WeightRecipe:
    """Scales of the random weights, in units that do not depend on the model's width.

    * ``embedding_rms``: RMS of an input embedding (the residual stream's starting scale);
    * ``attention_logit_std``: standard deviation of the pre-softmax attention scores;
    * ``attention_gain`` / ``ffn_gain``: RMS of each block's contribution to the residual
      stream for a unit-RMS input;
    * ``logit_std``: standard deviation of the output logits for a unit-RMS final state.
      Ignored with tied embeddings, where the output matrix *is* the embedding and the logit
      scale is ``embedding_rms * sqrt(hidden)``.

    Mamba only (llama ignores these):

    * ``ssm_gain``: RMS of ``ssm_out``'s output for a unit-RMS gated input;
    * ``ssm_dt_bias``: centre of the time-step bias (before softplus); the bias is uniform in
      ``ssm_dt_bias +- 2``, so at the default the step sizes are softplus(-8..-4) =
      0.0003..0.018: slow decay, a state that remembers tens of tokens;
    * ``ssm_bc_std``: standard deviation of the scan's input-dependent B and C for a unit-RMS
      input; it weighs the recurrent state against the local ``D * x`` skip term.

    Tuned on RECURRENT (8 prompts of 300 tokens, one token replaced k positions back, RMS
    change of the last logits relative to their std): with ``ssm_bc_std=1, ssm_dt_bias=-4``
    the model only saw the last 4 tokens (0.34 at k=2..4, 0.02 at k=8, argmax never changed
    beyond k=16); the defaults give 0.9-1.2 at k=2..8, 0.57 at 16, 0.12 at 64, 0.05 at 128
    (argmax changed for 4 of 8 prompts at k=64), with greedy margins like TINY's.
    """

    embedding_rms: float = 1.0
    attention_logit_std: float = 4.0
    attention_gain: float = 1.0
    ffn_gain: float = 1.0
    logit_std: float = 6.0
    ssm_gain: float = 1.0
    ssm_dt_bias: float = -6.0
    ssm_bc_std: float = 4.0


def recipe_for(spec: ModelSpec) -> WeightRecipe:
    """The recipe used for ``spec``.

    With tied embeddings the final state still contains the current token's own embedding, so
    the current token's logit gets a boost that grows with ``embedding_rms * sqrt(hidden)``
    relative to what the blocks add. Too large, and greedy decoding repeats the input token
    ("shiti shiti shiti"). Measured on REALISTIC (24 greedy tokens after 4 prompts): 0.23 gave
    6-11 immediate repeats per prompt, 0.09 0-5, 0.07 0-1 (logit std 2.1), 0.05 flattened the
    logits (std 1.5). The rule below gives 0.069 for REALISTIC and scales with depth and width.
    """
    recipe = WeightRecipe()
    if spec.weights == "copying":
        # Only the filler layers are random; their outputs barely touch the residual stream.
        return replace(recipe, attention_gain=filler_gain(), ffn_gain=filler_gain())
    if spec.weights in ("reply", "think"):
        # Faint blocks: they read the context, the current token's embedding leads (_reply.py).
        recipe = replace(recipe, attention_gain=BLOCK_GAIN, ffn_gain=BLOCK_GAIN)
    if not spec.tied_embeddings:
        return recipe
    if spec.arch == "mamba":
        blocks_rms = math.sqrt(spec.layers) * recipe.ssm_gain
    else:
        blocks_rms = math.sqrt(spec.layers * (recipe.attention_gain**2 + recipe.ffn_gain**2))
    return replace(
        recipe,
        embedding_rms=_TIED_EMBEDDING_FACTOR * blocks_rms / math.sqrt(spec.hidden),
    )


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # NumPy order: (out, in) for matrices
    std: float  # of the uniform random values (fill "random")
    fill: str = "random"  # or "ones" (norm weights, Mamba's D) or "ssm_a" (see _values)
    mean: float = 0.0  # added to the random values
    f32: bool = False  # stored as f32 whatever spec.dtype (norms, what ggml's SSM ops read)


def _ones(name: str, n: int) -> _Tensor:
    return _Tensor(name, (n,), 0.0, fill="ones", f32=True)


def _tensor_plan(spec: ModelSpec, recipe: WeightRecipe) -> list[_Tensor]:
    h = spec.hidden
    plan = [_Tensor("token_embd.weight", (spec.vocab_size, h), recipe.embedding_rms)]
    for i in range(spec.layers):
        if spec.arch == "mamba":
            plan += _mamba_block(spec, recipe, f"blk.{i}")
        else:
            plan += _llama_block(spec, recipe, f"blk.{i}")
    plan.append(_ones("output_norm.weight", h))
    if not spec.tied_embeddings:
        plan.append(_Tensor("output.weight", (spec.vocab_size, h), recipe.logit_std / math.sqrt(h)))
    return plan


def _llama_block(spec: ModelSpec, recipe: WeightRecipe, b: str) -> list[_Tensor]:
    h, ff, hd = spec.hidden, spec.ff, spec.head_dim
    kv = spec.kv_heads * hd
    qk_std = math.sqrt(recipe.attention_logit_std / h)
    return [
        _ones(f"{b}.attn_norm.weight", h),
        _Tensor(f"{b}.attn_q.weight", (h, h), qk_std),
        _Tensor(f"{b}.attn_k.weight", (kv, h), qk_std),
        _Tensor(f"{b}.attn_v.weight", (kv, h), 1.0 / math.sqrt(h)),
        _Tensor(f"{b}.attn_output.weight", (h, h), recipe.attention_gain / math.sqrt(h)),
        _ones(f"{b}.ffn_norm.weight", h),
        _Tensor(f"{b}.ffn_gate.weight", (ff, h), 1.0 / math.sqrt(h)),
        _Tensor(f"{b}.ffn_up.weight", (ff, h), 1.0 / math.sqrt(h)),
        _Tensor(f"{b}.ffn_down.weight", (h, ff), recipe.ffn_gain / math.sqrt(ff)),
    ]


def _mamba_block(spec: ModelSpec, recipe: WeightRecipe, b: str) -> list[_Tensor]:
    """One Mamba(1) mixer: in_proj -> causal conv + SiLU -> selective scan (+ D skip), gated by
    SiLU(z) -> out_proj. Shapes follow ``llama_model_mamba::load_arch_tensors``."""
    h, di, ds, dc, rank = spec.hidden, spec.ssm_inner, spec.ssm_state, spec.ssm_conv, spec.ssm_dt_rank
    bias_half_width = 2.0
    return [
        _ones(f"{b}.attn_norm.weight", h),
        _Tensor(f"{b}.ssm_in.weight", (2 * di, h), 1.0 / math.sqrt(h)),
        _Tensor(f"{b}.ssm_conv1d.weight", (di, dc), 1.0 / math.sqrt(dc), f32=True),
        _Tensor(f"{b}.ssm_conv1d.bias", (di,), 0.25, f32=True),
        _Tensor(f"{b}.ssm_x.weight", (rank + 2 * ds, di), recipe.ssm_bc_std / math.sqrt(di)),
        _Tensor(f"{b}.ssm_dt.weight", (di, rank), 1.0 / math.sqrt(rank)),
        _Tensor(
            f"{b}.ssm_dt.bias",
            (di,),
            bias_half_width / math.sqrt(3.0),
            mean=recipe.ssm_dt_bias,
            f32=True,
        ),
        _Tensor(f"{b}.ssm_a", (di, ds), 0.0, fill="ssm_a", f32=True),
        _Tensor(f"{b}.ssm_d", (di,), 0.0, fill="ones", f32=True),
        _Tensor(f"{b}.ssm_out.weight", (h, di), recipe.ssm_gain / math.sqrt(di)),
    ]


def _uniform(seed: int, name: str, shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
    """Uniform values with the given standard deviation, from a stream keyed by (seed, name)."""
    n = math.prod(shape)
    bits = np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))
    raw = bits.random_raw((n + 1) // 2)
    # Two 24-bit uniforms per 64-bit draw; explicit shifts keep this independent of byte order.
    halves = np.empty(2 * raw.size, dtype=np.uint32)
    halves[0::2] = (raw >> np.uint64(8)) & np.uint64(0xFFFFFF)
    halves[1::2] = raw >> np.uint64(40)
    unit = (halves[:n].astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)  # (0, 1)
    half_width = np.float32(std * math.sqrt(3.0))
    return ((unit * np.float32(2.0) - np.float32(1.0)) * half_width).reshape(shape)


def _values(spec: ModelSpec, vocab: Vocabulary, t: _Tensor) -> npt.NDArray[np.float32]:
    if spec.weights == "copying":
        constructed = copying_values(spec, vocab, t.name, t.shape)
        if constructed is not None:
            return constructed
    if spec.weights == "tools":
        return tools_values(spec, vocab, t.name, t.shape)
    if t.fill == "ones":
        return np.ones(t.shape, dtype=np.float32)
    if t.fill == "ssm_a":
        # A = -exp(A_log) with the reference Mamba's A_log = log(1..d_state): every channel
        # decays its state components at rates 1, 2, ..., d_state (times the step size).
        rows, d_state = t.shape
        return np.tile(-np.arange(1, d_state + 1, dtype=np.float32), (rows, 1))
    values = _uniform(spec.seed, t.name, t.shape, t.std)
    if t.mean:
        values += np.float32(t.mean)
    if t.name == ("token_embd.weight" if spec.tied_embeddings else "output.weight"):
        special = np.array([ty != TOKEN_TYPE_NORMAL for ty in vocab.token_types])
        values[special] *= np.float32(_SPECIAL_ROW_SCALE)
    if spec.weights in ("reply", "think") and t.name == "output.weight":
        embedding = _uniform(
            spec.seed, "token_embd.weight", (spec.vocab_size, spec.hidden), recipe_for(spec).embedding_rms
        )
        values = reply_output(values, embedding, vocab, spec.weights)
    return values


def _add_tensor_info(writer: gguf.GGUFWriter, spec: ModelSpec, t: _Tensor) -> None:
    if t.f32:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), 4 * math.prod(t.shape))
        return
    qtype = _MATRIX_TYPE[spec.dtype]
    byte_shape = gguf.quant_shape_to_byte_shape(t.shape, qtype)
    writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)


def _encode(spec: ModelSpec, t: _Tensor, values: npt.NDArray[np.float32]) -> npt.NDArray[np.generic]:
    if t.f32:
        return values
    encoded: npt.NDArray[np.generic] = gguf.quants.quantize(values, _MATRIX_TYPE[spec.dtype])
    return encoded


def write_gguf(spec: ModelSpec, path: Path, recipe: WeightRecipe | None = None) -> None:
    """Write the model described by ``spec`` to ``path`` (overwriting it). Deterministic.

    Tensor infos are declared first and the data is then streamed one tensor at a time, so
    peak memory is one tensor (plus the vocabulary), not the whole model.
    """
    recipe = recipe_for(spec) if recipe is None else recipe
    vocab = build_vocabulary(spec.vocab_size, spec.seed)
    plan = _tensor_plan(spec, recipe)
    writer = gguf.GGUFWriter(path, arch=spec.arch)
    try:
        _add_metadata(writer, spec, vocab)
        for t in plan:
            _add_tensor_info(writer, spec, t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan:
            writer.write_tensor_data(_encode(spec, t, _values(spec, vocab, t)))
    finally:
        writer.close()


def _add_metadata(writer: gguf.GGUFWriter, spec: ModelSpec, vocab: Vocabulary) -> None:
    writer.add_name(f"modeld-test-{spec.name}")
    if spec.weights == "copying":
        writer.add_description(
            f"Constructed n-gram induction circuit that copies earlier context, for tests; "
            f"modeld.testmodels generator {GENERATOR_VERSION}, seed {spec.seed}. Not a language model."
        )
    elif spec.weights == "tools":
        writer.add_description(
            f"Constructed weights that call a tool reading a named file and then answer, for tests "
            f"of agents' tool loops; modeld.testmodels generator {GENERATOR_VERSION}. Not a language model."
        )
    else:
        writer.add_description(
            f"Random weights for tests; modeld.testmodels generator {GENERATOR_VERSION}, "
            f"seed {spec.seed}. Not a language model."
        )
    # Provenance: the cache identity of this file, readable without knowing its name.
    writer.add_string(SPEC_DIGEST_KEY, spec.digest())
    writer.add_file_type(_FILE_TYPE[spec.dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(spec.layers)
    if spec.arch == "mamba":
        # As llama.cpp's conversion/mamba.py writes them (ff and head count 0: no FFN, no heads).
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(spec.ssm_conv)
        writer.add_ssm_inner_size(spec.ssm_inner)
        writer.add_ssm_state_size(spec.ssm_state)
        writer.add_ssm_time_step_rank(spec.ssm_dt_rank)
        writer.add_layer_norm_rms_eps(_RMS_EPS)
        writer.add_ssm_dt_b_c_rms(False)
    else:
        writer.add_feed_forward_length(spec.ff)
        writer.add_head_count(spec.heads)
        writer.add_head_count_kv(spec.kv_heads)
        writer.add_layer_norm_rms_eps(_RMS_EPS)
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_rope_freq_base(spec.rope_freq_base)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.pad_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML_THINK_TEMPLATE if spec.weights == "think" else CHATML_TOOLS_TEMPLATE)
