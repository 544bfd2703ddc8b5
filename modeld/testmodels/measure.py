"""Measure COPYING: its copy rate on a rewritten held-out file, and its speed against REALISTIC.

``python -m modeld.testmodels.measure [--lines N] [--reps N] [--threads N]`` generates (or finds)
COPYING and REALISTIC, prints COPYING's copy rate in llama.cpp (llama-cpp-python's C API) and
the prefill and decode speed of REALISTIC, COPYING and COPYING without its filler layers (the
control that shows they are computed), alternating the models in every repetition (medians,
ranges, per-repetition ratios). ``tests/models/test_copying_model.py`` asserts the copy rate with the
same functions.

The copy rate is how a prompt-lookup drafter would be judged: a chat turn shows a file (the
first lines of the standard library's ``textwrap.py``, text the tokenizer never saw: its corpus
is synthetic) and the assistant's answer is that file with a few lines changed, teacher-forced.
At every position of the answer whose token and next token both lie in a stretch copied from
the original (aligned token by token with :class:`difflib.SequenceMatcher`), the model's greedy
token either equals the original's continuation or not; the rate is the fraction that does.
:func:`free_running_rate` does the same without teacher forcing: greedy generation from a few
points inside copied stretches (16 copied tokens before the point), counting the tokens until
the first miss.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import difflib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from modeld.backends.cpu import cpu_has_amx
from modeld.testmodels._template import CHATML_TOOLS_TEMPLATE

__all__ = [
    "LlamaDriver",
    "RewriteCase",
    "free_running_cuts",
    "free_running_rate",
    "held_out_lines",
    "rewrite_case",
    "rewritten",
    "teacher_forced_rate",
]

Tokenize = Callable[[str], list[int]]  # text (control tokens parsed) -> ids, no BOS added
_EDIT_EVERY = 24  # one changed line in this many
_ALIGNED = 16  # copied tokens before a free-running cut (the 32-gram level may still see an edit)


def held_out_lines(n_lines: int) -> list[str]:
    """The first ``n_lines`` lines of the standard library's ``textwrap.py``."""
    import textwrap

    return Path(textwrap.__file__).read_text(encoding="utf-8").splitlines(keepends=True)[:n_lines]


def rewritten(lines: Sequence[str]) -> list[str]:
    """``lines`` with one line in :data:`_EDIT_EVERY` changed, in turn: a comment line inserted
    before it, an identifier renamed in it, the line deleted."""
    out: list[str] = []
    edits = 0
    for i, line in enumerate(lines):
        if i % _EDIT_EVERY != _EDIT_EVERY // 2:
            out.append(line)
            continue
        kind = edits % 3
        edits += 1
        if kind == 0:
            out += ["# (edited here)\n", line]
        elif kind == 1:
            out.append(
                line.replace("text", "content") if "text" in line else line.rstrip("\n") + "  # edited\n"
            )
        # kind == 2: the line is dropped
    return out


@dataclass(frozen=True)
class RewriteCase:
    """One teacher-forced rewrite: ``ids`` is BOS, the chat prompt showing the original, the
    assistant's opening fence and the rewritten file; ``copied[p]`` says whether ``ids[p]`` and
    ``ids[p + 1]`` both lie in a stretch of the answer copied from the original."""

    ids: list[int]
    answer_start: int
    copied: list[bool]

    @property
    def positions(self) -> list[int]:
        return [p for p, c in enumerate(self.copied) if c]


def rewrite_case(tokenize: Tokenize, bos_id: int, n_lines: int) -> RewriteCase:
    """The rewrite of the first ``n_lines`` held-out lines, as a ChatML turn."""
    original = "".join(held_out_lines(n_lines))
    answer = "".join(rewritten(held_out_lines(n_lines)))
    prompt = (
        jinja2.Environment()
        .from_string(CHATML_TOOLS_TEMPLATE)
        .render(
            messages=[
                {"role": "user", "content": f"Apply the edits to this file:\n```python\n{original}```"}
            ],
            add_generation_prompt=True,
        )
    )
    head = [bos_id, *tokenize(prompt + "```python\n")]
    original_ids, answer_ids = tokenize(original), tokenize(answer)
    copied = [False] * (len(head) + len(answer_ids))
    matcher = difflib.SequenceMatcher(a=original_ids, b=answer_ids, autojunk=False)
    for block in matcher.get_matching_blocks():
        for q in range(block.b, block.b + block.size - 1):
            copied[len(head) + q] = True
    return RewriteCase(ids=head + answer_ids, answer_start=len(head), copied=copied)


def teacher_forced_rate(case: RewriteCase, greedy: Sequence[int]) -> float:
    """The fraction of copied positions ``p`` where ``greedy[p]`` (the argmax after
    ``ids[: p + 1]``) equals ``ids[p + 1]``."""
    positions = case.positions
    return sum(greedy[p] == case.ids[p + 1] for p in positions) / len(positions)


def free_running_cuts(case: RewriteCase, n_new: int, count: int) -> list[int]:
    """Up to ``count`` prompt lengths, evenly spread over the answer, inside a copied stretch:
    the last :data:`_ALIGNED` tokens of the prompt and the next ``n_new`` tokens are copied from
    the original without an edit in between (right after an edit even an ideal n-gram copier
    may pick the wrong earlier occurrence; the teacher-forced rate counts those positions)."""
    ok = [
        cut
        for cut in range(case.answer_start + _ALIGNED, len(case.ids) - n_new)
        if all(case.copied[cut - _ALIGNED : cut + n_new - 1])
    ]
    if not ok:
        return []
    step = max(1, len(ok) // count)
    return ok[::step][:count]


def free_running_rate(
    case: RewriteCase, generate: Callable[[list[int], int], list[int]], n_new: int, count: int
) -> tuple[float, list[int]]:
    """Greedy generation of ``n_new`` tokens from each cut: the fraction of generated tokens
    before the first one that differs from the original's continuation, and the run lengths."""
    runs = []
    cuts = free_running_cuts(case, n_new, count)
    for cut in cuts:
        out = generate(case.ids[:cut], n_new)
        expected = case.ids[cut : cut + n_new]
        run = next((i for i, (a, b) in enumerate(zip(out, expected, strict=False)) if a != b), len(out))
        runs.append(run)
    return sum(runs) / (n_new * len(cuts)), runs


# --- llama.cpp through llama-cpp-python's C API ----------------------------------------------


def _quiet(level: int, text: bytes, user_data: object) -> None:
    pass


# llama.cpp keeps the pointer: the callback must live as long as the process. Installed by
# main() only: in a test process it would replace the llama backend's own log callback.
_QUIET_LOG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_quiet)


class LlamaDriver:
    """One model and one sequence in llama.cpp: logits at every position, greedy decoding."""

    def __init__(self, path: Path, n_ctx: int, threads: int, n_batch: int = 512) -> None:
        import llama_cpp

        self.lib: Any = llama_cpp
        lib = self.lib
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.use_extra_bufts = not cpu_has_amx()
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.bos_id = int(lib.llama_vocab_bos(self.vocab))
        self.n_batch = n_batch
        self.tokens: list[int] = []  # what the sequence holds

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (self.lib.llama_token * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, True)
        if n < 0:
            raise RuntimeError("tokenization failed")
        return list(buf[:n])

    def detokenize(self, ids: Sequence[int]) -> str:
        arr = (self.lib.llama_token * len(ids))(*ids)
        buf = ctypes.create_string_buffer(64 * len(ids) + 16)
        n = self.lib.llama_detokenize(self.vocab, arr, len(ids), buf, len(buf), False, True)
        return buf.raw[:n].decode(errors="replace")

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.tokens = []

    def _decode(self, ids: Sequence[int], all_logits: bool) -> list[int]:
        """Append ``ids`` in batches; the argmax after each (or only after the last)."""
        lib = self.lib
        argmax: list[int] = []
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            batch = lib.llama_batch_init(len(chunk), 0, 1)
            try:
                for i, token in enumerate(chunk):
                    batch.token[i] = token
                    batch.pos[i] = len(self.tokens) + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = all_logits or start + i == len(ids) - 1
                batch.n_tokens = len(chunk)
                if lib.llama_decode(self.ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
            finally:
                lib.llama_batch_free(batch)
            self.tokens += chunk
            for i in range(len(chunk)):
                if all_logits or start + i == len(ids) - 1:
                    logits = np.ctypeslib.as_array(
                        lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)
                    )
                    argmax.append(int(np.argmax(logits)))
        return argmax

    def argmax_all(self, ids: Sequence[int]) -> list[int]:
        """From an empty sequence: the greedy token after every prefix of ``ids``."""
        self.reset()
        return self._decode(ids, all_logits=True)

    def prefill(self, ids: Sequence[int]) -> int:
        """From an empty sequence: evaluate ``ids``; the greedy token after them."""
        self.reset()
        return self._decode(ids, all_logits=False)[-1]

    def greedy(self, ids: Sequence[int], n_new: int) -> list[int]:
        """``n_new`` greedy tokens after ``ids``, reusing the longest prefix of ``ids`` that the
        sequence already holds (the logits may then differ from a fresh evaluation's in the
        last bits, as chunking does)."""
        keep = 0
        limit = min(len(self.tokens), len(ids) - 1)
        while keep < limit and self.tokens[keep] == ids[keep]:
            keep += 1
        if not self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), 0, keep, -1):
            raise RuntimeError("llama_memory_seq_rm failed")
        del self.tokens[keep:]
        out = [self._decode(ids[keep:], all_logits=False)[-1]]
        while len(out) < n_new:
            out.append(self._decode([out[-1]], all_logits=False)[-1])
        return out


# --- the measurement ------------------------------------------------------------------------


def _speed(driver: LlamaDriver, prompt: list[int], n_decode: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    token = driver.prefill(prompt)
    t1 = time.perf_counter()
    for _ in range(n_decode):
        token = driver._decode([token], all_logits=False)[-1]
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_decode / (t2 - t1)


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} (range {min(values):.1f}-{max(values):.1f})"


def main(argv: Sequence[str] | None = None) -> int:
    from modeld.testmodels import COPYING, REALISTIC, ModelSpec, ensure_model
    from modeld.testmodels._copying import CIRCUIT_LAYERS

    parser = argparse.ArgumentParser(prog="python -m modeld.testmodels.measure", description=__doc__)
    parser.add_argument("--lines", type=int, default=120, help="held-out lines in the rewrite (default 120)")
    parser.add_argument("--reps", type=int, default=5, help="speed repetitions per model (default 5)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens for the speed runs")
    parser.add_argument("--decode", type=int, default=64, help="decoded tokens for the speed runs")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    import llama_cpp

    llama_cpp.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))

    t0 = time.perf_counter()
    copying_path = ensure_model(COPYING, args.cache_dir)
    print(
        f"COPYING: {copying_path} ({copying_path.stat().st_size / 1e6:.0f} MB, {time.perf_counter() - t0:.1f} s)"
    )
    driver = LlamaDriver(copying_path, n_ctx=8192, threads=args.threads)
    case = rewrite_case(driver.tokenize, driver.bos_id, args.lines)
    t0 = time.perf_counter()
    rate = teacher_forced_rate(case, driver.argmax_all(case.ids))
    print(
        f"copy rate (teacher-forced, llama.cpp): {rate:.4f} over {len(case.positions)} copied positions "
        f"({len(case.ids)} tokens, {time.perf_counter() - t0:.1f} s)"
    )
    free, runs = free_running_rate(case, driver.greedy, n_new=48, count=6)
    print(f"copy rate (free-running greedy, 6 x 48 tokens): {free:.4f}, runs {runs}")

    # The control: COPYING without its filler layers. If llama.cpp skipped the fillers (whose
    # outputs barely touch the residual stream), COPYING would run at the control's speed.
    circuit_only = dataclasses.replace(COPYING, name="copying-circuit-only", layers=CIRCUIT_LAYERS)
    specs: list[tuple[str, ModelSpec]] = [
        ("REALISTIC", REALISTIC),
        ("COPYING", COPYING),
        (f"COPYING, {CIRCUIT_LAYERS} layers", circuit_only),
    ]
    drivers = {
        name: LlamaDriver(ensure_model(spec, args.cache_dir), 4096, args.threads) for name, spec in specs[::2]
    }
    drivers["COPYING"] = driver
    prompt = driver.tokenize("".join(held_out_lines(400)))[: args.prefill]
    prompt = [driver.bos_id, *prompt[: args.prefill - 1]]
    speeds: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _ in specs}
    for _ in range(args.reps):
        for name, _ in specs:
            prefill, decode = _speed(drivers[name], prompt, args.decode)
            speeds[name][0].append(prefill)
            speeds[name][1].append(decode)
    print(f"speed, {args.reps} repetitions alternating, {args.threads} threads, medians:")
    for name, (prefill_runs, decode_runs) in speeds.items():
        print(
            f"  {name:20s} prefill {len(prompt)} tok: {_summary(prefill_runs)} tok/s; decode: {_summary(decode_runs)} tok/s"
        )
    ratio_prefill = [c / r for c, r in zip(speeds["COPYING"][0], speeds["REALISTIC"][0], strict=True)]
    ratio_decode = [c / r for c, r in zip(speeds["COPYING"][1], speeds["REALISTIC"][1], strict=True)]
    print(
        f"  COPYING / REALISTIC, per repetition: prefill {_ratios(ratio_prefill)}; decode {_ratios(ratio_decode)}"
    )
    for d in drivers.values():
        d.close()
    return 0


def _ratios(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (range {min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    sys.exit(main())
