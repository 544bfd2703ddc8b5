"""``python -m bench.constraints``: what constrained decoding costs, through the real daemon.

Runs ``modeld serve --backend llama`` on the realistic generated model (``--quick``: the tiny
one) and ``runtime_client`` over its unix socket, and measures:

* **compile**: the daemon's schema -> GBNF -> parsed grammar step in process (cold: a new
  digest each time; cached); then, end to end, the first constrained decode of the model (it
  also builds llguidance's view of the vocabulary, once per model), and the time to first
  token of a decode with a schema never seen before against the same decode with a schema
  already compiled (the difference is the whole compile: daemon, worker parse, llguidance
  grammar and matcher);
* **decode speed**: tok/s of a decode under a typical tool-call JSON schema against a free
  decode of the same number of tokens on the same context, server-side (``Usage.decode_ms``:
  first to last token). Runs alternate to spread the machine's noise; medians and ranges, and
  the best run of each (on a shared machine the least disturbed run is the steadiest figure);
* **the mask's own cost per token**, in this process on the same model: llguidance's mask
  applied to a logits array and the chosen token accepted, along the constrained answer.

Timing is printed, never asserted. The machine is shared: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import runtime_client as rc
from bench.daemon import serve_llama

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
PROMPT = "def main():\n    # decide which tool to call next, as JSON\n    result = "


def _stats(values: list[float], digits: int = 3) -> str:
    return (
        f"median {statistics.median(values):.{digits}f} "
        f"(range {min(values):.{digits}f}-{max(values):.{digits}f}, n={len(values)})"
    )


def _timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _decode(session: rc.ClientSession, config: rc.DecodeConfig) -> tuple[float, rc.StreamChunk]:
    """(seconds to the first chunk, the final chunk) of one decode on the fresh prompt."""
    session.ensure_prefix(rc.PrefixInput(text=PROMPT))  # drops the last answer, keeps the prompt
    t0 = time.perf_counter()
    first = 0.0
    final = None
    with session.decode(config) as stream:
        for chunk in stream:
            if not first:
                first = time.perf_counter() - t0
            final = chunk
    assert final is not None
    assert final.usage is not None
    return first, final


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the tiny model, fewer runs")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    from modeld.decoding import constraints as dc
    from modeld.testmodels import REALISTIC, TINY, ensure_model

    spec = TINY if args.quick else REALISTIC
    runs = 2 if args.quick else args.runs
    schema = json.dumps(TOOL_SCHEMA)

    # --- compile, in process ---------------------------------------------------------------------
    cold = []
    for i in range(20):
        variant = json.dumps({**TOOL_SCHEMA, "title": f"v{i}"})  # a new digest each time: no cache hit
        t0 = time.perf_counter()
        dc.compile_constraint(rc.Constraint("json_schema", variant))
        cold.append((time.perf_counter() - t0) * 1e3)
    cached = _timed(lambda: dc.compile_constraint(rc.Constraint("json_schema", schema)), 200)
    print(f"model {spec.name}")
    print("compile in the daemon's process (ms):")
    print(f"  schema -> GBNF -> parsed grammar, cold   {_stats(cold)}")
    print(f"  the same, cached by digest               {_stats(cached)}")

    model = str(ensure_model(spec))
    with serve_llama() as client:
        session = client.open_session(
            rc.OpenSessionRequest(type="llama", path=model, config=rc.Config(num_ctx=4096))
        )
        constrained = rc.DecodeConfig(max_tokens=400, constraint=rc.Constraint("json_schema", schema))
        _decode(session, rc.DecodeConfig(max_tokens=4))  # load the model, prefill the prompt
        first_ever, final = _decode(session, constrained)
        count = final.usage.completion_tokens if final.usage else 0
        print(f"through the daemon (the constrained answer is {count} tokens, finish {final.finish_reason}):")
        print(
            f"  first constrained decode of the model, TTFT s   {first_ever:.3f} (builds the vocabulary view)"
        )
        new, again = [], []
        for i in range(runs * 3):
            fresh = rc.Constraint("json_schema", json.dumps({**TOOL_SCHEMA, "title": f"daemon{i}"}))
            new.append(_decode(session, rc.DecodeConfig(max_tokens=4, constraint=fresh))[0] * 1e3)
            again.append(_decode(session, rc.DecodeConfig(max_tokens=4, constraint=fresh))[0] * 1e3)
        print(f"  TTFT ms, a schema never seen                     {_stats(new, 1)}")
        print(f"  TTFT ms, the same schema again (cached)          {_stats(again, 1)}")
        deltas = [n - a for n, a in zip(new, again, strict=True)]
        print(f"  compile end to end (difference, ms)              {_stats(deltas, 1)}")
        print(
            f"  best TTFT ms: new {min(new):.1f}, cached {min(again):.1f}, difference {min(new) - min(again):.1f}"
        )

        speeds: dict[str, list[float]] = {"free": [], "json_schema": []}
        for _ in range(runs):
            for mode in speeds:
                config = constrained if mode == "json_schema" else rc.DecodeConfig(max_tokens=count)
                _, final = _decode(session, config)
                usage = final.usage
                assert usage is not None
                assert usage.completion_tokens == count, (mode, usage)
                speeds[mode].append((count - 1) / (usage.decode_ms / 1000.0))
        free = speeds["free"]
        print(f"decode ({count} tokens per run, server-side tok/s):")
        for mode, values in speeds.items():
            ratios = [v / f for v, f in zip(values, free, strict=True)]
            print(
                f"  {mode:11s} {_stats(values, 1)}  ratio to free: median {statistics.median(ratios):.2f} "
                f"(per run {min(ratios):.2f}-{max(ratios):.2f}); best run {max(values):.1f} "
                f"(ratio of best runs {max(values) / max(free):.2f})"
            )
        session.close()
    _mask_cost(model, schema)


def _mask_cost(path: str, schema: str) -> None:
    """llguidance's mask + accept per token along a constrained answer, on the model's vocabulary."""
    import llama_cpp as L  # noqa: N812 - a short name for a linear script
    import numpy as np

    from modeld.backends.llama_constraints import LlamaConstraints
    from modeld.decoding.constraints import compile_constraint

    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(path.encode(), params)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    compiled = compile_constraint(rc.Constraint("json_schema", schema))
    constraints = LlamaConstraints(vocab, n_vocab)
    rng = np.random.default_rng(0)
    per_token: list[float] = []
    for _ in range(5):
        tc = constraints.start(compiled)
        for _ in range(400):
            logits = rng.standard_normal(n_vocab).astype(np.float32)
            t0 = time.perf_counter()
            tc.apply(logits)
            token = int(np.argmax(logits))
            tc.accept(token)
            per_token.append((time.perf_counter() - t0) * 1e3)
            if L.llama_vocab_is_eog(vocab, token):
                break
        tc.close()
    L.llama_model_free(model)
    print(f"llguidance mask + accept per token, ms (vocabulary {n_vocab}): {_stats(per_token)}")


if __name__ == "__main__":
    main()
