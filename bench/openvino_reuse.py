"""``python -m bench.openvino_reuse [ROUNDS]``: what OpenVINO's own block cache reuses when
several workspaces alternate (blueprint 0016, "OpenVINO").

OpenVINO GenAI owns its KV cache and reports no reused-token count, so modeld's accounting for it
is logical (the longest common prefix with what modeld last sent for that sequence). This measures
whether the pipeline really kept each workspace's blocks: three workspaces (about 1500 tokens each
on the realistic model) in round robin, each turn a new 48-token suffix and a 1-token decode, on
one modeld session per workspace. It reports per turn the time to the first token and modeld's
logical reuse, against two references measured in the same run: a cold first turn, and the warm
turn of a single workspace served alone. If the pipeline kept every workspace's blocks, a
round-robin warm turn costs about what the single-workspace warm turn costs.
"""

from __future__ import annotations

import statistics
import sys
import time

from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.settings import Residency
from modeld.testmodels import REALISTIC, ensure_model

LINE = "def handler_{i}(request): return respond(request.body, status={i})\n"


def _workspace(k: int) -> str:
    return f"You are working in repository {k}.\n" + "".join(LINE.format(i=100 * k + i) for i in range(110))


def _suffix(r: int, k: int) -> str:
    """The same length in tokens for every turn (only digits change)."""
    return f"turn {r} of workspace {k}\n" * 8


def _turn(session: object, prefix: str, suffix: str) -> tuple[float, int, int]:
    started = time.perf_counter()
    status = session.ensure_prefix(PrefixInput(text=prefix))  # type: ignore[attr-defined]
    session.prefill_suffix(SuffixInput(text=suffix))  # type: ignore[attr-defined]
    with session.decode(DecodeConfig(max_tokens=1)) as stream:  # type: ignore[attr-defined]
        for _ in stream:
            break
    return time.perf_counter() - started, status.reused_tokens, status.prefix_tokens


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 3
    path = str(ensure_model(REALISTIC))
    request = OpenSessionRequest(type="openvino", path=path, config=Config(num_ctx=4096))
    with Engine(backends=("openvino",), residency=Residency(sequences=3)) as engine:
        single = engine.open_session(request)
        alone = [_turn(single, _workspace(9), _suffix(r, 9))[0] for r in range(3)]
        single.close()
        sessions = [engine.open_session(request) for _ in range(3)]
        cold: list[float] = []
        warm: list[float] = []
        for r in range(rounds):
            for k, session in enumerate(sessions):
                ttft, reused, total = _turn(session, _workspace(k), _suffix(r, k))
                (cold if r == 0 else warm).append(ttft)
                print(f"round {r} workspace {k}: TTFT {ttft * 1000:7.0f} ms, logical reuse {reused}/{total}")
    print(
        f"single workspace: cold {alone[0] * 1000:.0f} ms, warm {statistics.median(alone[1:]) * 1000:.0f} ms"
    )
    print(
        f"round robin: cold median {statistics.median(cold) * 1000:.0f} ms, warm median "
        f"{statistics.median(warm) * 1000:.0f} ms (range {min(warm) * 1000:.0f}-{max(warm) * 1000:.0f}); "
        f"warm round robin / warm alone = {statistics.median(warm) / statistics.median(alone[1:]):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
