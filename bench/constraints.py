"""``python -m bench.constraints``: what constrained decoding costs on llama.cpp.

Measures, on the realistic generated model (``--quick``: the tiny one):

* compile time of a typical tool-call JSON schema: our GBNF conversion + parse (cold, then
  cached), llguidance's grammar and matcher construction, and llama.cpp's grammar parser;
* decode speed with and without a constraint, in the decode loop the llama backend runs
  (evaluate one token, read the logits, mask them, argmax, accept, plus the engine-side
  output processing), for the llguidance mask and for llama.cpp's grammar sampler. Each run
  decodes the same number of tokens; runs alternate to spread the machine's noise, and the
  report gives medians and ranges.

Timing is printed, never asserted. The machine is shared: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["read_file", "write_file", "run_tests", "search", "apply_patch"]},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "minLength": 1, "maxLength": 120},
                "start_line": {"type": "integer", "minimum": 1, "maximum": 1000000},
                "end_line": {"type": "integer", "minimum": 1, "maximum": 1000000},
                "recursive": {"type": "boolean"},
                "pattern": {"type": "string", "maxLength": 200},
                "flags": {"type": "array", "items": {"enum": ["-i", "-w", "-l"]}, "maxItems": 3},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def _stats(values: list[float]) -> str:
    return (
        f"median {statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f}, n={len(values)})"
    )


def _timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the tiny model, fewer runs")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()

    import llama_cpp as L  # noqa: N812 - a short name for a linear script
    import llguidance

    from modeld.backends.llama_constraints import LlamaConstraints
    from modeld.contract import Constraint, DecodeConfig
    from modeld.decoding import constraints as dc
    from modeld.decoding.output import OutputProcessor, plan_decode
    from modeld.testmodels import REALISTIC, TINY, ensure_model

    spec = TINY if args.quick else REALISTIC
    path = str(ensure_model(spec))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.no_perf = 2048, 512, 512, True
    ctx = L.llama_init_from_model(model, params)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    mem = L.llama_get_memory(ctx)
    schema_text = json.dumps(TOOL_SCHEMA)
    print(
        f"model {spec.name}: vocab {n_vocab}; llguidance {llguidance.__version__}, llama-cpp-python {L.__version__}"
    )

    # --- compile ------------------------------------------------------------------------------
    cold: list[float] = []
    for i in range(20):
        variant = json.dumps({**TOOL_SCHEMA, "title": f"v{i}"})  # a new digest each time: no cache hit
        t0 = time.perf_counter()
        dc.compile_constraint(Constraint("json_schema", variant))
        cold.append((time.perf_counter() - t0) * 1e3)
    compiled = dc.compile_constraint(Constraint("json_schema", schema_text))
    cached = _timed(lambda: dc.compile_constraint(Constraint("json_schema", schema_text)), 200)
    lark = llguidance.grammar_from("gbnf", compiled.gbnf)
    t0 = time.perf_counter()
    constraints = LlamaConstraints(vocab, n_vocab)
    constraints._lltokenizer()
    tokenizer_ms = (time.perf_counter() - t0) * 1e3
    to_lark = _timed(lambda: llguidance.grammar_from("gbnf", compiled.gbnf), 20)
    matcher = _timed(lambda: llguidance.LLMatcher(constraints._lltokenizer(), lark, log_level=0), 20)
    start = _timed(lambda: constraints.start(compiled), 20)
    grammar_init = _timed(
        lambda: L.llama_sampler_free(L.llama_sampler_init_grammar(vocab, compiled.gbnf.encode(), b"root")), 20
    )
    print("compile (ms):")
    print(f"  schema -> GBNF -> parsed grammar, cold     {_stats(cold)}")
    print(f"  the same, cached by digest                 {_stats(cached)}")
    print(f"  llguidance: GBNF -> lark                   {_stats(to_lark)}")
    print(f"  llguidance: matcher from lark              {_stats(matcher)}")
    print(f"  a decode's constraint start (cached lark)  {_stats(start)}")
    print(f"  llama.cpp grammar sampler init             {_stats(grammar_init)}")
    print(f"  llguidance tokenizer for the model, once   {tokenizer_ms:.1f}")

    # --- decode -------------------------------------------------------------------------------
    prompt_text = "def main():\n    # decide which tool to call next\n    result = "
    buf = (L.llama_token * 256)()
    n = L.llama_tokenize(vocab, prompt_text.encode(), len(prompt_text.encode()), buf, 256, True, True)
    prompt = list(buf[:n])
    piece_buf = ctypes.create_string_buffer(256)

    def evaluate(tokens: list[int]) -> None:
        arr = (L.llama_token * len(tokens))(*tokens)
        assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) == 0

    def run(engine: str | None, count: int) -> tuple[int, float]:
        L.llama_memory_clear(mem, True)
        evaluate(prompt)
        tc = LlamaConstraints(vocab, n_vocab, engine=engine).start(compiled) if engine else None
        config = DecodeConfig(constraint=Constraint("json_schema", schema_text) if engine else None)
        processor = OutputProcessor(config, plan_decode(config))
        made = 0
        t0 = time.perf_counter()
        while made < count:
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            if tc is not None:
                tc.apply(logits)
            token = int(np.argmax(logits))
            if tc is not None:
                tc.accept(token)
            made += 1
            if L.llama_vocab_is_eog(vocab, token):
                break
            size = L.llama_token_to_piece(vocab, token, piece_buf, 256, 0, True)
            processor.feed(piece_buf.raw[:size].decode("utf-8", errors="replace"))
            evaluate([token])
        elapsed = time.perf_counter() - t0
        if tc is not None:
            tc.close()
        return made, made / elapsed

    target, _ = run("llguidance", 1000)  # how long the constrained answer is (then EOS)
    count = min(args.tokens, target)
    speeds: dict[str, list[float]] = {"free": [], "llguidance": [], "grammar": []}
    for _ in range(2 if args.quick else args.runs):
        for mode in speeds:
            made, tps = run(None if mode == "free" else mode, count)
            assert made == count or mode == "free", (mode, made, count)
            speeds[mode].append(tps)
    free = statistics.median(speeds["free"])
    print(f"decode ({count} tokens per run, tok/s):")
    for mode, values in speeds.items():
        ratios = [v / f for v, f in zip(values, speeds["free"], strict=True)]
        print(
            f"  {mode:11s} {_stats(values)}  ratio to free: median {statistics.median(values) / free:.2f} "
            f"(per-run {min(ratios):.2f}-{max(ratios):.2f})"
        )
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
