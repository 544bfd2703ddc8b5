"""``python -m bench.kv_layout``: what other resident sequences cost one sequence, per KV layout.

On a unified pool a sequence's attention spans every used cell of the pool (masked), so its
prefill and decode get slower as other sequences fill the pool; with split streams it spans only
its own stream. This measures, on the realistic model, the time of a 64-token suffix prefill and
of 16 decoded tokens on a 2k-token sequence while 0, 1 and 3 other sequences hold 2k tokens each,
for both layouts, all in one process and one run (ratios against the same layout with nothing
else resident). Blueprint 0016 quotes it.
"""

from __future__ import annotations

import random
import statistics
import time

from modeld.backends.base import LoadOptions
from modeld.backends.llama import LlamaBackend
from modeld.contract import Config, DecodeConfig, OpenSessionRequest
from modeld.testmodels import REALISTIC, ensure_model

CONTEXT = 2048
REPEATS = 3


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 30000) for _ in range(n)]


def _measure(unified: bool, others: int) -> tuple[float, float]:
    path = str(ensure_model(REALISTIC))
    backend = LlamaBackend()
    request = OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=CONTEXT + 256, num_batch=512))
    window = CONTEXT + 256
    options = LoadOptions(n_seq=4, window=window, pool_tokens=4 * window, unified=unified)
    runtime = backend.load(request, backend.describe(request), options)
    rng = random.Random(7)
    try:
        for seq in range(1, 1 + others):
            for _ in runtime.sync(seq, 0, _tokens(rng, CONTEXT)):
                pass
        base = _tokens(rng, CONTEXT)
        for _ in runtime.sync(0, 0, base):
            pass
        prefill: list[float] = []
        decode: list[float] = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            for _ in runtime.sync(0, CONTEXT, _tokens(rng, 64)):
                pass
            prefill.append(time.perf_counter() - started)
            started = time.perf_counter()
            for n, _ in enumerate(runtime.generate(0, DecodeConfig(max_tokens=16), 16)):
                if n == 15:
                    break
            decode.append((time.perf_counter() - started) / 16)
        return statistics.median(prefill), statistics.median(decode)
    finally:
        runtime.close()


def main() -> int:
    for unified in (False, True):
        name = "unified" if unified else "split"
        alone = _measure(unified, 0)
        for others in (0, 1, 3):
            prefill, decode = alone if others == 0 else _measure(unified, others)
            print(
                f"{name:8s} {others} other sequences of {CONTEXT} tokens: 64-token prefill {prefill * 1000:6.0f} ms "
                f"({prefill / alone[0]:.2f}x), decode {decode * 1000:5.1f} ms/token ({decode / alone[1]:.2f}x)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
