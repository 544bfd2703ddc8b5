"""REPLY and THINK: generated models that answer a chat turn briefly and end it, as agents need.

Why: a coding agent (Claude Code, Codex CLI) treats an answer that stops at its output limit as
an error, and a model with random weights never ends its turn (it would pick the end-of-turn
token about once in 4096 steps). REPLY is TINY's shape with two changes, so that every chat
turn is answered with :data:`REPLY_TEXT` and the end-of-turn token, whatever came before:

* the attention and feed-forward blocks are random but faint (:data:`BLOCK_GAIN` of TINY's
  gain): they cost what TINY's cost and still read the whole context (so the KV matters), but
  the residual stream stays close to the current token's embedding;
* the output matrix is TINY's random one plus a chain: the row of each token of
  ``"\\n" + REPLY_TEXT`` 's successor gets the (unit) embedding of the token before it, scaled so
  its logit wins by far (:data:`CHAIN_LENGTH`). A chat template's generation prompt ends with
  ``"\\n"`` (``<|im_start|>assistant\\n``), so greedy decoding (and sampling at any usual
  temperature) emits the reply's tokens one after another, then ``<|im_end|>``.

The chain is the canonical tokenization of the reply (the same BPE), so when an agent sends the
answer back in its history it tokenizes to the tokens that were generated and stays warm.
Each chain token occurs once (a bigram chain with a repeated token would loop).

THINK is REPLY with a reasoning format (``CHATML_THINK_TEMPLATE``, as Qwen3's): its generation
prompt opens ``<think>``, and the chain writes :data:`THOUGHT`, ``</think>``, then the reply. The
template renders earlier assistant turns without their thinking, which is what the warm-reuse
measurement of reasoning models needs.

What not: no tool calls (an agent reads the reply as the final answer), no copying; where the
chain does not apply (a forced tool call's grammar, a raw prompt) the output is TINY-like noise.
"""

from __future__ import annotations

import functools
import itertools
from typing import Final

import numpy as np
import numpy.typing as npt

from modeld.testmodels._tokenizer import QWEN2_PRETOKENIZER_REGEX, Vocabulary

__all__ = ["BLOCK_GAIN", "CHAIN_LENGTH", "REPLY_TEXT", "THOUGHT", "reply_chain", "reply_output"]

REPLY_TEXT: Final = "Understood."
"""What REPLY answers every chat turn with."""
THOUGHT: Final = "Reading the request"
"""What THINK thinks before it answers (inside ``<think>``)."""
_OUTPUT: Final = {
    "reply": ("assistant\n", REPLY_TEXT),
    "think": ("assistant\n<think>\n", THOUGHT + "</think>" + REPLY_TEXT),
}
"""Per kind: how the generation prompt ends, and what the model writes after it."""
BLOCK_GAIN: Final = 0.05
"""The attention and feed-forward blocks' gain, relative to TINY's recipe."""
CHAIN_LENGTH: Final = 8.0
"""Length of the chain row added to the output matrix. The final state is a normalized embedding
of norm sqrt(hidden) (11.3 for TINY), so a chain logit is about 8 x 11.3 = 90, against random
logits of standard deviation 6 (TINY's ``logit_std``): a margin no sampling temperature in use
overcomes."""


@functools.lru_cache(maxsize=8)
def reply_chain(vocab: Vocabulary, kind: str = "reply") -> tuple[int, ...]:
    """Token ids of the generation prompt's last token, the output's canonical tokenization, and
    ``<|im_end|>`` (``kind``: reply or think)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    index = {t: i for i, t in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bpe = Tokenizer(models.BPE(vocab=index, merges=merges))  # type: ignore[arg-type]
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    prompt_end, text = _OUTPUT[kind]
    chain = (bpe.encode(prompt_end).ids[-1], *bpe.encode(text).ids, vocab.eos_id)
    if len(set(chain)) != len(chain):
        raise AssertionError(f"the output {text!r} repeats a token: {chain}")
    return chain


def reply_output(
    output: npt.NDArray[np.float32],
    embedding: npt.NDArray[np.float32],
    vocab: Vocabulary,
    kind: str = "reply",
) -> npt.NDArray[np.float32]:
    """The output matrix ``output`` (vocab x hidden, random) with the chain of ``kind`` added."""
    out = output.copy()
    chain = reply_chain(vocab, kind)
    for before, after in itertools.pairwise(chain):
        e = embedding[before]
        out[after] += np.float32(CHAIN_LENGTH) * (e / np.float32(np.linalg.norm(e) + 1e-6))
    return out
