"""``python -m bench.tool_loop``: a tool loop's per-round time to first token, warm vs cold.

Runs :func:`runtime_client.run_tools` on the in-process engine (llama backend, realistic model;
``--quick``: tiny) with a forced first call, a long system prompt and a growing history, and
times each round's ``ensure_prefix + prefill_suffix + first chunk``. Then, for each round's
context, a cold re-prefill: the KV is cleared (an unrelated prefix first) and the same context
is prefilled from scratch. Needs the decode-loop integration of ``modeld.decoding``
(``blueprints/0018``): without it the engine refuses the forced call and this says so.

Timing is printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput
from modeld.engine import Engine
from modeld.errors import UnsupportedError
from runtime_client import ContextBuilder
from runtime_client.tools import run_tools

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    from modeld.testmodels import REALISTIC, TINY, ensure_model

    path = str(ensure_model(TINY if args.quick else REALISTIC))
    engine = Engine(backends=("llama",))
    request = OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=8192, prompt_format="chat"))
    system = "You are a coding agent working in a large repository.\n" + "".join(
        f"Rule {i}: keep functions small, name things plainly, and test every change.\n" for i in range(60)
    )
    result_text = "def main():\n    config = load_config('app.toml')\n    return run(config)\n" * 4
    try:
        with engine.open_session(request) as session:
            builder = ContextBuilder(identity=session.identity, tools_json=json.dumps(TOOLS))
            builder.system(system).user_turn("Why does main() crash on startup?")
            forced = DecodeConfig(max_tokens=64, tool_choice="required")
            try:
                result = run_tools(
                    session,
                    builder,
                    lambda call: result_text,
                    forced,
                    after_first=forced,
                    max_tool_iterations=args.rounds,
                )
            except UnsupportedError as exc:
                print(f"the engine does not enforce tool_choice yet: {exc}")
                return
            print("round  prompt  reused  prefilled  warm TTFT s  cold TTFT s (median of 2)")
            for i, rnd in enumerate(result.rounds):
                assert rnd.context is not None
                colds = []
                for _ in range(2):
                    session.ensure_prefix(PrefixInput(text="unrelated\n"))  # the KV now holds something else
                    t0 = time.perf_counter()
                    session.ensure_prefix(rnd.context.prefix_input())
                    session.prefill_suffix(rnd.context.suffix_input())
                    with session.decode(DecodeConfig(max_tokens=1)) as stream:
                        next(iter(stream))
                    colds.append(time.perf_counter() - t0)
                prompt = rnd.usage.prompt_tokens if rnd.usage else 0
                print(
                    f"{i + 1:5d}  {prompt:6d}  {rnd.prefix.reused_tokens:6d}  {rnd.prefix.prefilled_tokens:9d}"
                    f"  {rnd.first_chunk_seconds:11.3f}  {statistics.median(colds):11.3f}"
                )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
