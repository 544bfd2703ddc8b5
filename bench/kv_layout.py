"""``python -m bench.kv_layout [speed|memory|numerics|precision]``: the KV layouts of the llama
backend, measured through modeld's own runtime (``LlamaRuntime``, as the engine worker uses it).

Blueprint 0016 quotes every table this prints; the layouts are written ``split/n`` (``n`` streams
of ``window`` cells each, llama.cpp ``kv_unified=False``) and ``unified/n:pool`` (one pool of
``pool`` cells that ``n`` sequences share, ``kv_unified=True``).

* ``speed`` (the default): what other resident sequences cost one sequence. On a unified pool a
  sequence's attention spans every used cell of the pool (masked), so its prefill and decode get
  slower as other sequences fill the pool; with split streams it spans only its own stream. The
  time of a 64-token suffix prefill and of 16 decoded tokens on a 2k-token sequence while 0, 1
  and 3 other sequences hold 2k tokens each, per layout (ratios against the same layout with
  nothing else resident; one process, one run).
* ``memory``: what each layout holds in memory. Every layout is loaded in a fresh process (so
  one layout's pages never count for another); printed: llama.cpp's own KV and compute buffer
  sizes (its log lines), and the process's anonymous RSS (KV, compute buffers, Python; the
  weights are a file mapping, ``RssFile``, shown apart) after loading, after a long prefill of one
  sequence and after a 16-token decode. Byte counts: one run is the figure.
* ``numerics``: is warm output bit-identical to a fresh evaluation? Per layout and scenario (a
  sequence alone; after other sequences took cells; two sequences growing in turn; a copied
  prefix; a restored snapshot; two sequences in one ``llama_decode`` batch), the last token's
  logits and 32 greedy tokens are compared with the same tokens evaluated in a fresh
  one-sequence context: argmax equal, largest absolute logit difference, greedy tokens equal
  before the first difference.
* ``precision``: a quantized KV cache (``kv_cache_type`` q8_0, q4_0; llama.cpp needs flash
  attention for a quantized V) against f16 with the same flash-attention setting: greedy tokens
  equal before the first difference over several prompts.

Options: ``--model tiny|realistic`` (default realistic), ``--window N``, ``--prompt N`` (memory).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from modeld.backends.base import LoadOptions, ModelRuntime
from modeld.backends.llama import LlamaBackend
from modeld.contract import Config, DecodeConfig, OpenSessionRequest
from modeld.testmodels import REALISTIC, TINY, ModelSpec, ensure_model

CONTEXT = 2048
REPEATS = 3
GREEDY = 32
_SPECS = {"tiny": TINY, "realistic": REALISTIC}


@dataclass(frozen=True)
class Layout:
    """One way to hold ``n_seq`` sequences: split streams of ``window`` cells, or one unified pool
    of ``pool`` cells (each sequence up to ``window``)."""

    n_seq: int
    window: int
    unified: bool = False
    pool: int = 0
    flash_attn: bool = False
    kv: str = "f16"

    @property
    def name(self) -> str:
        shape = f"unified/{self.n_seq}:{self.pool}" if self.unified else f"split/{self.n_seq}"
        extra = (" fa" if self.flash_attn else "") + ("" if self.kv == "f16" else f" {self.kv}")
        return shape + extra

    def options(self) -> LoadOptions:
        pool = self.pool if self.unified else self.n_seq * self.window
        return LoadOptions(n_seq=self.n_seq, window=self.window, pool_tokens=pool, unified=self.unified)


def _load(spec: ModelSpec, layout: Layout, batch: int = 512) -> ModelRuntime:
    backend = LlamaBackend()
    config = Config(
        num_ctx=layout.window, num_batch=batch, flash_attn=layout.flash_attn, kv_cache_type=layout.kv
    )
    request = OpenSessionRequest(type="llama", path=str(ensure_model(spec)), config=config)
    return backend.load(request, backend.describe(request), layout.options())


def _tokens(rng: random.Random, spec: ModelSpec, n: int) -> list[int]:
    return [rng.randrange(300, spec.vocab_size - 64) for _ in range(n)]


def _sync(runtime: ModelRuntime, seq: int, keep: int, tokens: Sequence[int]) -> None:
    for _ in runtime.sync(seq, keep, tokens):
        pass


# --- speed ------------------------------------------------------------------------------------


def _speed_one(spec: ModelSpec, unified: bool, others: int) -> tuple[float, float]:
    window = CONTEXT + 256
    runtime = _load(spec, Layout(4, window, unified, 4 * window))
    rng = random.Random(7)
    try:
        for seq in range(1, 1 + others):
            _sync(runtime, seq, 0, _tokens(rng, spec, CONTEXT))
        _sync(runtime, 0, 0, _tokens(rng, spec, CONTEXT))
        prefill: list[float] = []
        decode: list[float] = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            _sync(runtime, 0, CONTEXT, _tokens(rng, spec, 64))
            prefill.append(time.perf_counter() - started)
            started = time.perf_counter()
            for n, _ in enumerate(runtime.generate(0, DecodeConfig(max_tokens=16), 16)):
                if n == 15:
                    break
            decode.append((time.perf_counter() - started) / 16)
        return statistics.median(prefill), statistics.median(decode)
    finally:
        runtime.close()


def speed(spec: ModelSpec) -> None:
    for unified in (False, True):
        name = "unified" if unified else "split"
        alone = _speed_one(spec, unified, 0)
        for others in (0, 1, 3):
            prefill, decode = alone if others == 0 else _speed_one(spec, unified, others)
            print(
                f"{name:8s} {others} other sequences of {CONTEXT} tokens: 64-token prefill {prefill * 1000:6.0f} ms "
                f"({prefill / alone[0]:.2f}x), decode {decode * 1000:5.1f} ms/token ({decode / alone[1]:.2f}x)"
            )


# --- memory -----------------------------------------------------------------------------------


def _rss() -> dict[str, int]:
    """The process's resident set from ``/proc/self/status``, in MiB."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) >> 10
    return out


class _BufferLog(logging.Handler):
    """llama.cpp's own figures from its log lines (``KV buffer size``, ``compute buffer size``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.kv_mib = 0.0
        self.compute_mib = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "buffer size" in text and "=" in text:
            mib = float(text.rsplit("=", 1)[1].split()[0])
            if "KV buffer" in text:
                self.kv_mib += mib
            elif "compute buffer" in text:
                self.compute_mib += mib


def _memory_one(spec: ModelSpec, layout: Layout, prompt: int) -> dict[str, Any]:
    """Runs in its own process (``_memory-one``): load, prefill ``prompt`` tokens, decode 16."""
    buffers = _BufferLog()
    logger = logging.getLogger("modeld.llama")
    logger.addHandler(buffers)
    logger.setLevel(logging.DEBUG)
    rss: dict[str, dict[str, int]] = {"start": _rss()}
    started = time.perf_counter()
    runtime = _load(spec, layout)
    load_s = time.perf_counter() - started
    rss["loaded"] = _rss()
    n = min(prompt, runtime.layout.window - 32)
    started = time.perf_counter()
    _sync(runtime, 0, 0, _tokens(random.Random(1), spec, n))
    prefill_s = time.perf_counter() - started
    rss["prefilled"] = _rss()
    for i, _ in enumerate(runtime.generate(0, DecodeConfig(max_tokens=16), 16)):
        if i == 15:
            break
    rss["decoded"] = _rss()
    runtime.close()
    return {
        "layout": asdict(layout),
        "name": layout.name,
        "cells": runtime.layout.pool_tokens,
        "prompt": n,
        "kv_mib": buffers.kv_mib,
        "compute_mib": buffers.compute_mib,
        "load_s": round(load_s, 2),
        "prefill_s": round(prefill_s, 1),
        "rss": rss,
    }


def memory_layouts(window: int) -> list[Layout]:
    """What ``memory`` loads: today's default (split/4), fewer resident sequences, unified pools
    below and at n x window, the cost of ``n_seq_max`` in a pool, flash attention, KV precision."""
    w = window
    return [
        Layout(4, w),
        Layout(2, w),
        Layout(1, w),
        Layout(1, w, unified=True, pool=w),
        Layout(4, w, unified=True, pool=w),
        Layout(4, w, unified=True, pool=2 * w),
        Layout(64, w, unified=True, pool=w),
        Layout(1, w, flash_attn=True),
        Layout(4, w, unified=True, pool=w, flash_attn=True),
        Layout(1, w, flash_attn=True, kv="q8_0"),
        Layout(1, w, flash_attn=True, kv="q4_0"),
    ]


def memory(model: str, window: int, prompt: int) -> list[dict[str, Any]]:
    rows = []
    for layout in memory_layouts(window):
        argv = [
            sys.executable,
            "-m",
            "bench.kv_layout",
            "_memory-one",
            model,
            json.dumps(asdict(layout)),
            str(prompt),
        ]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{layout.name}: failed ({done.returncode}): {done.stderr.strip()[-400:]}", flush=True)
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        r = row["rss"]
        print(
            f"{row['name']:22s} {row['cells']:6d} cells: KV {row['kv_mib']:7.1f} MiB, compute {row['compute_mib']:6.1f} MiB; "
            f"anon RSS loaded {r['loaded']['RssAnon']:5d}, after {row['prompt']}-token prefill "
            f"{r['prefilled']['RssAnon']:5d}, after decode {r['decoded']['RssAnon']:5d} MiB "
            f"(start {r['start']['RssAnon']}; weights mapped {r['decoded']['RssFile']} MiB); "
            f"load {row['load_s']} s, prefill {row['prefill_s']} s",
            flush=True,
        )
    return rows


# --- numerics ---------------------------------------------------------------------------------


def _logits(runtime: ModelRuntime, index: int = -1) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The logits llama.cpp holds for output ``index`` of the last decode (a copy)."""
    import llama_cpp

    ctx = runtime._ctx  # type: ignore[attr-defined]  # a measurement of the runtime's own context
    n_vocab = int(
        llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama_cpp.llama_get_model(ctx)))
    )
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(n_vocab,)).copy()


def _greedy(runtime: ModelRuntime, seq: int, n: int = GREEDY) -> list[int]:
    out = []
    for token in runtime.generate(seq, DecodeConfig(max_tokens=n), n):
        out.append(int(token))
    return out


class Fresh:
    """The reference: tokens evaluated from empty in a one-sequence context of the same model,
    flash-attention setting and KV type (same batch plan as the runtime's)."""

    def __init__(self, spec: ModelSpec, window: int, flash_attn: bool, kv: str) -> None:
        self.runtime = _load(spec, Layout(1, window, flash_attn=flash_attn, kv=kv))

    def __call__(self, tokens: Sequence[int]) -> tuple[np.ndarray[Any, np.dtype[np.float32]], list[int]]:
        self.runtime.drop(0)
        _sync(self.runtime, 0, 0, tokens)
        logits = _logits(self.runtime)
        return logits, _greedy(self.runtime, 0)

    def close(self) -> None:
        self.runtime.close()


@dataclass
class Compared:
    scenario: str
    argmax_equal: bool
    max_abs_diff: float
    greedy_equal: int  # greedy tokens equal before the first difference (GREEDY: all)


def _compare(
    scenario: str,
    fresh: Fresh,
    tokens: Sequence[int],
    logits: np.ndarray[Any, np.dtype[np.float32]],
    greedy: list[int],
) -> Compared:
    ref_logits, ref_greedy = fresh(tokens)
    equal = next(
        (i for i, (a, b) in enumerate(zip(greedy, ref_greedy, strict=False)) if a != b), len(ref_greedy)
    )
    return Compared(
        scenario,
        bool(int(np.argmax(logits)) == int(np.argmax(ref_logits))),
        float(np.max(np.abs(logits.astype(np.float64) - ref_logits))),
        equal,
    )


def _two_in_one_batch(runtime: ModelRuntime, tails: dict[int, list[int]]) -> dict[int, Any]:
    """Evaluate each sequence's tail in ONE ``llama_decode`` (modeld never does this; measured
    because llama-server does); returns each sequence's last logits."""
    import llama_cpp

    batch = runtime._batch  # type: ignore[attr-defined]
    seqs = runtime._seqs  # type: ignore[attr-defined]
    i = 0
    last = {}
    for seq, tail in tails.items():
        for j, token in enumerate(tail):
            batch.token[i] = token
            batch.pos[i] = len(seqs[seq]) + j
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if j == len(tail) - 1 else 0
            if j == len(tail) - 1:
                last[seq] = i
            i += 1
    batch.n_tokens = i
    if llama_cpp.llama_decode(runtime._ctx, batch) != 0:  # type: ignore[attr-defined]
        raise RuntimeError("llama_decode failed")
    out = {}
    for seq, tail in tails.items():
        seqs[seq].extend(tail)
        out[seq] = _logits(runtime, last[seq])
    runtime._fresh = -1  # type: ignore[attr-defined]
    return out


def numerics_one(spec: ModelSpec, layout: Layout) -> list[Compared]:
    rng = random.Random(5)
    p = _tokens(rng, spec, 1500)
    q = _tokens(rng, spec, 1200)
    other = _tokens(rng, spec, 700)
    fresh = Fresh(spec, layout.window, layout.flash_attn, layout.kv)
    runtime = _load(spec, layout)
    out: list[Compared] = []
    try:
        # A: alone, then warm (cut at 1000, a new tail).
        _sync(runtime, 0, 0, p)
        out.append(_compare("alone", fresh, p, _logits(runtime), _greedy(runtime, 0)))
        warm = p[:1000] + q[:300]
        _sync(runtime, 0, 1000, q[:300])
        out.append(_compare("warm cut+extend", fresh, warm, _logits(runtime), _greedy(runtime, 0)))
        runtime.drop(0)
        if layout.n_seq >= 3:
            # B: other sequences took cells first.
            _sync(runtime, 1, 0, other)
            _sync(runtime, 2, 0, other[:300])
            _sync(runtime, 0, 0, p)
            out.append(_compare("after others", fresh, p, _logits(runtime), _greedy(runtime, 0)))
            for seq in range(3):
                runtime.drop(seq)
            # C: two sequences growing in turn.
            _sync(runtime, 0, 0, p[:500])
            _sync(runtime, 1, 0, q[:500])
            _sync(runtime, 0, 500, p[500:1000])
            _sync(runtime, 1, 500, q[500:])
            _sync(runtime, 0, 1000, p[1000:])
            out.append(_compare("grown in turn (a)", fresh, p, _logits(runtime), _greedy(runtime, 0)))
            _sync(runtime, 1, len(q), [])
            runtime.drop(0)
            _sync(runtime, 1, len(q) - 2, q[-2:])  # fresh logits of q's last token, in place
            out.append(_compare("grown in turn (b)", fresh, q, _logits(runtime), _greedy(runtime, 1)))
            for seq in range(3):
                runtime.drop(seq)
            # D: a copied prefix, extended.
            _sync(runtime, 2, 0, other)
            _sync(runtime, 0, 0, p)
            runtime.copy(0, 1, 1200)
            _sync(runtime, 1, 1200, q[:200])
            out.append(
                _compare("copied prefix", fresh, p[:1200] + q[:200], _logits(runtime), _greedy(runtime, 1))
            )
            for seq in range(3):
                runtime.drop(seq)
            # E: a snapshot restored into another sequence while others hold cells.
            _sync(runtime, 0, 0, p)
            blob = runtime.snapshot(0)
            runtime.drop(0)
            _sync(runtime, 0, 0, other)
            assert runtime.restore(2, bytearray(blob), p)
            _sync(runtime, 2, len(p), q[:100])
            out.append(_compare("restored", fresh, p + q[:100], _logits(runtime), _greedy(runtime, 2)))
            for seq in range(3):
                runtime.drop(seq)
            # F: two sequences in one batch.
            _sync(runtime, 0, 0, p[:1000])
            _sync(runtime, 1, 0, q[:900])
            got = _two_in_one_batch(runtime, {0: p[1000:1200], 1: q[900:1100]})
            out.append(_compare("one batch (a)", fresh, p[:1200], got[0], _greedy(runtime, 0)))
            out.append(_compare("one batch (b)", fresh, q[:1100], got[1], _greedy(runtime, 1)))
        else:
            # n=1: a snapshot restored into the emptied sequence.
            _sync(runtime, 0, 0, p)
            blob = runtime.snapshot(0)
            runtime.drop(0)
            _sync(runtime, 0, 0, other)
            assert runtime.restore(0, bytearray(blob), p)
            _sync(runtime, 0, len(p), q[:100])
            out.append(_compare("restored", fresh, p + q[:100], _logits(runtime), _greedy(runtime, 0)))
    finally:
        runtime.close()
        fresh.close()
    return out


def numerics_layouts(window: int) -> list[Layout]:
    w = window
    return [
        Layout(3, w),
        Layout(1, w),
        Layout(3, w, unified=True, pool=w),
        Layout(3, w, unified=True, pool=3 * w),
        Layout(3, w, flash_attn=True),
        Layout(3, w, unified=True, pool=w, flash_attn=True),
    ]


def numerics(spec: ModelSpec, window: int) -> None:
    for layout in numerics_layouts(window):
        rows = numerics_one(spec, layout)
        exact = sum(r.argmax_equal and r.max_abs_diff == 0 for r in rows)
        print(
            f"{layout.name}: {exact} of {len(rows)} scenarios bit-identical to a fresh evaluation", flush=True
        )
        for r in rows:
            print(
                f"    {r.scenario:20s} argmax {'equal' if r.argmax_equal else 'DIFFERENT'}, max |logit diff| "
                f"{r.max_abs_diff:.3g}, greedy equal for {r.greedy_equal} of {GREEDY}",
                flush=True,
            )


# --- precision --------------------------------------------------------------------------------


def precision(spec: ModelSpec, window: int, prompts: int = 6) -> None:
    """Greedy agreement of a quantized KV cache with f16 (flash attention on for both: llama.cpp
    needs it for a quantized V), and of f16 with flash attention against without; and, since a
    random-weight model's greedy tokens flip on near-ties, the first token's logits: argmax
    agreement and the largest difference relative to the logits' range."""
    rng = random.Random(9)
    texts = [_tokens(rng, spec, rng.randrange(200, min(1500, window - GREEDY - 8))) for _ in range(prompts)]
    runs: dict[str, list[list[int]]] = {}
    logits: dict[str, list[np.ndarray[Any, np.dtype[np.float32]]]] = {}
    for name, fa, kv in (
        ("f16", False, "f16"),
        ("f16 fa", True, "f16"),
        ("q8_0", True, "q8_0"),
        ("q4_0", True, "q4_0"),
    ):
        runtime = _load(spec, Layout(1, window, flash_attn=fa, kv=kv))
        try:
            runs[name], logits[name] = [], []
            for tokens in texts:
                runtime.drop(0)
                _sync(runtime, 0, 0, tokens)
                logits[name].append(_logits(runtime))
                runs[name].append(_greedy(runtime, 0))
        finally:
            runtime.close()

    def agree(a: list[list[int]], b: list[list[int]]) -> list[int]:
        return [
            next((i for i, (x, y) in enumerate(zip(u, v, strict=False)) if x != y), min(len(u), len(v)))
            for u, v in zip(a, b, strict=True)
        ]

    for name, base in (
        ("f16 fa", "f16"),
        ("q8_0", "f16 fa"),
        ("q4_0", "f16 fa"),
        ("q8_0", "f16"),
        ("q4_0", "f16"),
    ):
        equal = agree(runs[name], runs[base])
        argmax = sum(
            int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(logits[name], logits[base], strict=True)
        )
        relative = [
            float(np.max(np.abs(a.astype(np.float64) - b)) / max(1e-9, float(np.ptp(b))))
            for a, b in zip(logits[name], logits[base], strict=True)
        ]
        print(
            f"{name:7s} vs {base:7s}: greedy tokens equal before the first difference, per prompt: {equal} "
            f"(of {GREEDY}; median {statistics.median(equal)}); first token's argmax equal on {argmax} of "
            f"{len(texts)}, largest logit difference / logit range median {statistics.median(relative):.4f} "
            f"(max {max(relative):.4f})",
            flush=True,
        )


def main(argv: list[str]) -> int:
    if argv and argv[0] == "_memory-one":
        row = _memory_one(_SPECS[argv[1]], Layout(**json.loads(argv[2])), int(argv[3]))
        print(json.dumps(row))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.kv_layout", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "what", nargs="?", default="speed", choices=("speed", "memory", "numerics", "precision")
    )
    parser.add_argument("--model", default="realistic", choices=sorted(_SPECS))
    parser.add_argument(
        "--window",
        type=int,
        default=0,
        help="cells per sequence (default: memory 8704, numerics 3072, else 2048)",
    )
    parser.add_argument("--prompt", type=int, default=8000, help="tokens prefilled by `memory`")
    args = parser.parse_args(argv)
    spec = _SPECS[args.model]
    if args.what == "speed":
        speed(spec)
    elif args.what == "memory":
        memory(args.model, args.window or 8704, args.prompt)
    elif args.what == "numerics":
        numerics(spec, args.window or 3072)
    else:
        precision(spec, args.window or CONTEXT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
