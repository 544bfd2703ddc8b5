"""The llama.cpp runtime (engine-worker side): the decode jobs over a context's sequences.

:class:`LlamaRuntime` is the :class:`~modeld.backends.base.ModelRuntime` the worker loads: the
context, its sequences, batches and snapshots are :mod:`modeld.backends.llama_context`'s (the
snapshot format :mod:`modeld.backends.llama_state`'s), the choice of a token from a logits row
:mod:`modeld.backends.llama_step`'s; this module decodes. Design records:
``blueprints/0009-llama-backend.md``, ``blueprints/0016-warm-state.md``. The points that matter
for correctness:

* **Constraints and the extra samplers** (``blueprints/0018``): a constrained decode masks the
  logits in the context's own buffer (llguidance's token mask over the compiled GBNF,
  :mod:`modeld.backends.llama_constraints`), then ``logit_bias`` and presence/frequency
  penalties are applied there (``modeld.decoding.sampling``), then the usual choice reads the
  buffer: the bare ``argmax`` when greedy (unchanged without a constraint), else the sampler
  chain. A dead end of the constraint ends the job cleanly (``constraint_failed``).
* **Speculation** (``DecodeConfig.speculation == "ngram"``, ``blueprints/0021``): the chosen
  token and a draft from the context (:class:`~modeld.decoding.speculation.Drafter`) are
  evaluated in one batch with logits at every drafted position; each position's token is chosen
  as above, the draft holds while the choices equal it, and the rejected drafted tokens' cells
  are removed (``llama_memory_seq_rm``). Tokens a constraint forces (the only one its mask
  allows) are appended to that batch without a choice of their own. A batch takes llama.cpp's
  multi-token kernels, whose rounding differs from the single-token step's by ~3e-4 of a logit:
  greedy output equals plain decoding wherever the top two logits are further apart than that
  (every test and benchmark turn; blueprint 0021 measures it). Memory that cannot be cut at any
  token decodes plainly (blueprint 0016, "Speculation"): a recurrent state cannot take a rejected
  draft back, and a sliding-window model's verify batch rounds up to 100 times further from a
  single step than an attention model's.
* **Choices** (``DecodeConfig.n``, ``blueprints/0019``): one batch per step with a token per
  live choice, each choice on its own forked sequence with its own sampler, constraint and end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from modeld.backends._llama_lib import bindings as _llama
from modeld.backends.llama_context import LlamaContext, chunk_sizes, micro_batch
from modeld.contract import DecodeConfig
from modeld.decoding.constraints import ConstraintFailed, runtime_constraint
from modeld.decoding.sampling import ChoiceToken, choice_seed
from modeld.decoding.speculation import DRAFT_MAX, DecodeStats, DraftLength, drafter_for
from modeld.errors import EngineError, InvalidArgumentError

__all__ = ["LlamaRuntime", "chunk_sizes", "micro_batch"]

log = logging.getLogger("modeld.llama")


class LlamaRuntime(LlamaContext):
    """One llama.cpp model and context with ``n_seq`` sequences, and the decodes over them."""

    def generate(
        self,
        seq: int,
        config: DecodeConfig,
        max_tokens: int,
        forks: Sequence[int] = (),
        stopped: Callable[[int], bool] | None = None,
    ) -> Iterator[int]:
        if forks:
            return self._choices(seq, tuple(forks), config, max_tokens, stopped or (lambda _i: False))
        return self._generate(seq, config, max_tokens)

    def _generate(self, seq: int, config: DecodeConfig, max_tokens: int) -> Iterator[int]:
        compiled = runtime_constraint(config)
        held = self._fresh_logits(seq)
        stats = self._stats[seq] = DecodeStats()
        # Speculation needs cells that can be cut (rejected drafts are removed again).
        speculate = config.speculation == "ngram" and self._layout.can_truncate
        step = self._step(config, held)
        base = len(held)
        window = self._layout.window
        produced = 0
        drafter = drafter_for(self._drafters, seq, held) if speculate else None
        lengths = DraftLength(min(DRAFT_MAX, self._chunk - 1))
        try:
            if compiled is not None:
                step.tc = self._constraints_for().start(compiled)
            rows: list[int] = [-1]  # the logits rows to choose from, in order
            draft: list[int] = []  # draft[i]: the token drafted after rows[i]
            while True:
                # Choose from every row the last batch left before handing any token over: the
                # worker runs its jobs a step at a time, and another job's batch, evaluated while
                # this one yields, would overwrite the rows not read yet (every accepted draft
                # token would then be evaluated again: three concurrent copies paid a verify batch
                # per token). Tokens are yielded after; a consumer that stops mid-way leaves what
                # it took (``finally`` cuts the rest).
                chosen: list[int] = []  # as yielded (with log-probabilities when asked for)
                token = -1
                accepted = 0
                ended = False
                for i, row in enumerate(rows):
                    token = step.choose(row)
                    chosen.append(step.out(token))
                    if drafter is not None:
                        drafter.append(token)
                    total = produced + len(chosen)
                    if step.eog(token) or total >= max_tokens or base + total > window:
                        ended = True
                        break
                    if i < len(draft) and token == draft[i]:
                        accepted += 1  # resident already: its row follows
                        continue
                    break
                stats.accepted += accepted
                for out in chosen:
                    produced += 1
                    yield out
                if ended:
                    return
                if draft:
                    lengths.record(len(draft), accepted)
                    self._cut(seq, base + produced - 1)  # the rejected drafted tokens' cells
                # ``token`` is chosen, not yet evaluated. Tokens a constraint forces after it
                # are the only choice plain decoding has: yield them and evaluate all at once.
                pending = [token]
                if speculate and step.tc is not None:
                    room = min(max_tokens - produced, window + 1 - base - produced, self._chunk - 1)
                    for forced in step.forced(room):
                        pending.append(forced)
                        produced += 1
                        stats.forced += 1
                        if drafter is not None:
                            drafter.append(forced)
                        yield step.out(forced, forced=True)
                        if step.eog(forced) or produced >= max_tokens or base + produced > window:
                            return
                draft = []
                if drafter is not None:
                    room = min(
                        max_tokens - produced - 1,  # the draft's tokens and the one after them
                        window - base - produced,  # every drafted token needs a cell
                        self._chunk - len(pending),  # one batch
                    )
                    draft = drafter.draft(room)
                    del draft[lengths.budget(drafter.matched) :]
                    if draft and step.tc is not None:
                        del draft[step.tc.valid_prefix(draft) :]
                if draft:
                    stats.verifies += 1
                    stats.drafted += len(draft)
                    self._decode(seq, pending + draft, outputs=len(draft) + 1)
                    rows = list(range(len(pending) - 1, len(pending) + len(draft)))
                else:
                    self._decode(seq, pending)
                    rows = [-1]
        except ConstraintFailed as exc:
            # A dead end of the constraint: end the job cleanly (the daemon reports
            # constraint_failed; the sequence holds what was evaluated).
            log.info("a constrained decode of sequence %d cannot go on: %s", seq, exc)
        finally:
            step.close()
            if produced and len(held) > base + produced - 1:
                # Drafted tokens verified ahead of what was consumed: hold what plain decoding
                # would (every yielded token but the last), so the warm state says the truth.
                self._cut(seq, base + produced - 1)
            if step.adjusted and self._fresh == seq:
                # The buffer holds masked/adjusted logits of the last step: not fresh for the
                # next decode of this sequence (it re-evaluates its last tokens).
                self._fresh = -1

    def _choices(
        self,
        seq: int,
        forks: tuple[int, ...],
        config: DecodeConfig,
        max_tokens: int,
        stopped: Callable[[int], bool],
    ) -> Iterator[int]:
        """Choices decoded together (``DecodeConfig.n``): choice 0 on ``seq``, choice ``i`` on
        ``forks[i - 1]``, each fork holding a copy of ``seq``'s tokens (the cache copied them:
        shared cells in a unified pool). Every step evaluates one batch with one token per live
        choice; each choice has its own sampler chain (seed + i: ``choice_seed``), constraint,
        penalties and end (an end-of-generation token, ``max_tokens``, the window, a dead end of
        its constraint, or ``stopped(i)``: the daemon canceled that choice). Yields
        :class:`~modeld.decoding.sampling.ChoiceToken`. No speculation. A fork's cells are freed
        when its choice ends; ``seq`` is left as a one-choice decode leaves it (every yielded
        token but the last)."""
        seqs = (seq, *forks)
        if len(set(seqs)) != len(seqs):
            raise InvalidArgumentError("a decode's choices need distinct sequences", field="forks")
        for fork in forks:
            if self._seq(fork) != self._seq(seq):
                raise EngineError(f"sequence {fork} does not hold a copy of sequence {seq}'s tokens")
        compiled = runtime_constraint(config)
        held = self._fresh_logits(seq)
        self._stats[seq] = DecodeStats()
        base = len(held)
        window = self._layout.window
        n = len(seqs)
        steps = [self._step(replace(config, seed=choice_seed(config.seed, i)), held) for i in range(n)]
        produced = [0] * n
        live = list(range(n))
        rows = [-1] * n  # each live choice's logits row in the last batch
        first = n > 1  # the first step: every choice reads the prompt's last row
        try:
            if compiled is not None:
                for step in steps:
                    step.tc = self._constraints_for().start(compiled)
            while live:
                view = saved = None
                if first:
                    # Masks, biases and penalties edit the row in place: each choice reads the original.
                    view = np.ctypeslib.as_array(
                        _llama.llama_get_logits_ith(self._ctx, -1), shape=(self._n_vocab,)
                    )
                    saved = view.copy()
                chosen: list[tuple[int, int, int]] = []  # (choice, token, as yielded)
                for i in live:
                    if view is not None and saved is not None and chosen:
                        view[:] = saved
                    step = steps[i]
                    try:
                        token = step.choose(rows[i])
                    except ConstraintFailed as exc:
                        log.info("a constrained choice %d of sequence %d cannot go on: %s", i, seq, exc)
                        chosen.append((i, -1, -1))
                        continue
                    produced[i] += 1
                    out = step.out(token)
                    chosen.append((i, token, out))
                first = False
                # Every live choice has chosen (no other job's batch can overwrite the logits
                # between them); now hand the tokens over.
                batch: list[tuple[int, int]] = []
                for i, token, out in chosen:
                    if token >= 0:
                        logprob = getattr(out, "logprob", None)
                        yield ChoiceToken(token, i, logprob)
                    ended = (
                        token < 0
                        or steps[i].eog(token)
                        or produced[i] >= max_tokens
                        or base + produced[i] > window
                    )
                    if not ended:
                        batch.append((i, token))
                    else:
                        self._end_choice(seqs, i, base + produced[i] - 1)
                        live.remove(i)
                for i, _token in list(batch):  # canceled while its token was on its way
                    if stopped(i):
                        batch.remove((i, _token))
                        self._end_choice(seqs, i, base + produced[i] - 1)
                        live.remove(i)
                if not batch:
                    break
                self._decode_choices([(seqs[i], token) for i, token in batch])
                for j, (i, _token) in enumerate(batch):
                    rows[i] = j
        finally:
            for step in steps:
                step.close()
            for fork in forks:
                self._cut(fork, 0)
            if len(held) > base + max(0, produced[0] - 1) and produced[0]:
                self._cut(seq, base + produced[0] - 1)
            self._fresh = -1  # the buffer holds several choices' rows (or masked ones)

    def _end_choice(self, seqs: tuple[int, ...], i: int, keep: int) -> None:
        """Choice ``i`` ended: a fork's cells are freed now; choice 0 keeps every yielded token
        but the last (as a one-choice decode leaves its sequence)."""
        if i == 0:
            self._cut(seqs[0], max(0, keep))
        else:
            self._cut(seqs[i], 0)
