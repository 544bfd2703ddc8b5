"""``python -m bench.tool_loop``: a tool loop's per-round time to first token, warm vs cold.

Runs :func:`runtime_client.run_tools` against a real ``modeld serve --backend llama`` on the
realistic generated model (``--quick``: tiny), with a forced call every round, a long system
prompt and a growing history, and times each round's ``ensure_prefix + prefill_suffix + first
chunk`` (client-observed). Then each round's context is prefilled cold: in a fresh daemon with
an empty data directory (so no warm context, RAM or disk tier can serve it), after an
unrelated prefix has loaded the model, the same prefix and suffix and the first chunk.

Timing is printed, never asserted. The machine is shared: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import runtime_client as rc
from bench.daemon import serve_llama
from runtime_client import BuiltContext, ContextBuilder, run_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 40}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    }
]
N_CTX = 8192


def _cold(model: str, context: BuiltContext, runs: int) -> list[float]:
    """Seconds to the first chunk of ``context`` prefilled from nothing, once per fresh daemon
    (the server-side prefill of each is printed too)."""
    out = []
    for _ in range(runs):
        with serve_llama() as client:
            session = client.open_session(
                rc.OpenSessionRequest(
                    type="llama", path=model, config=rc.Config(num_ctx=N_CTX, prompt_format="chat")
                )
            )
            session.ensure_prefix(rc.PrefixInput(text="unrelated\n"))  # loads the model
            t0 = time.perf_counter()
            p = session.ensure_prefix(context.prefix_input())
            s = session.prefill_suffix(context.suffix_input())
            with session.decode(rc.DecodeConfig(max_tokens=1)) as stream:
                next(iter(stream))
            out.append(time.perf_counter() - t0)
            print(
                f"    cold: {p.prefilled_tokens} + {s.suffix_tokens} tokens, server-side prefill "
                f"{p.prefill_ms:.0f} + {s.prefill_ms:.0f} ms, to the first chunk {out[-1]:.3f} s",
                flush=True,
            )
            session.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cold-runs", type=int, default=2)
    args = parser.parse_args()
    from modeld.testmodels import REALISTIC, TINY, ensure_model

    model = str(ensure_model(TINY if args.quick else REALISTIC))
    system_prompt = "You are a coding agent working in a large repository.\n" + "".join(
        f"Rule {i}: keep functions small, name things plainly, and test every change.\n" for i in range(60)
    )
    result_text = "def main():\n    config = load_config('app.toml')\n    return run(config)\n" * 4
    with serve_llama() as client:
        session = client.open_session(
            rc.OpenSessionRequest(
                type="llama", path=model, config=rc.Config(num_ctx=N_CTX, prompt_format="chat")
            )
        )
        builder = ContextBuilder(identity=session.identity, tools_json=json.dumps(TOOLS))
        builder.system(system_prompt).user_turn("Why does main() crash on startup?")
        forced = rc.DecodeConfig(max_tokens=64, tool_choice="required")
        result = run_tools(
            session,
            builder,
            lambda call: result_text,
            forced,
            after_first=forced,
            max_tool_iterations=args.rounds,
        )
        session.close()
    print("round  prompt  reused  prefilled  prefill ms  warm TTFT s  cold TTFT s (each in a fresh daemon)")
    warm, cold = [], []
    for i, rnd in enumerate(result.rounds):
        assert rnd.context is not None
        colds = _cold(model, rnd.context, args.cold_runs)
        prompt = rnd.usage.prompt_tokens if rnd.usage else 0
        if i:
            warm.append(rnd.first_chunk_seconds)
            cold.extend(colds)
        print(
            f"{i + 1:5d}  {prompt:6d}  {rnd.prefix.reused_tokens:6d}  {rnd.prefix.prefilled_tokens:9d}"
            f"  {(rnd.usage.prefill_ms if rnd.usage else 0.0):10.0f}  {rnd.first_chunk_seconds:11.3f}  {statistics.median(colds):.3f} ({', '.join(f'{c:.3f}' for c in colds)})"
        )
    if warm:
        print(
            f"rounds 2+: warm median {statistics.median(warm):.3f} s (range {min(warm):.3f}-{max(warm):.3f}); "
            f"cold median {statistics.median(cold):.3f} s (range {min(cold):.3f}-{max(cold):.3f}); "
            f"cold / warm {statistics.median(cold) / statistics.median(warm):.1f}x"
        )


if __name__ == "__main__":
    main()
