"""``python -m bench.kv_bytes``: what a cached token costs in KV bytes, and whether a shared prefix
is stored once (issue 8's memory row).

On the realistic model, for both KV layouts of the llama backend, three sub-agents: sequence 0
prefills a 2k-token shared head plus a 1k private tail; sequences 1 and 2 get the head by copy
(the cache's placement path: ``copy``) and prefill their own 1k tails. Measured:

* **bytes per cached token**: the engine's own serialized state of each sequence
  (``snapshot``: llama.cpp's ``llama_state_seq_get_data``, exactly what the RAM and disk tiers
  store) divided by its tokens, against the theoretical ``2 x layers x kv_heads x head_dim x 2``
  (f16 K and V) computed here from the generator's spec, not from modeld's own formula;
* **a shared prefix counted once**: the unified pool is sized to hold the head once plus the
  three tails (5k cells) while the agents cache 9k tokens between them; the copies must fit
  (llama.cpp refuses a batch it has no cells for), and the resident bytes per cached token are
  the pool's cells over the tokens cached. The split layout stores the head per sequence by
  design (blueprint 0016): its pool is three full windows, and this prints what that costs.

Prints one line per layout; blueprint 0016 quotes it. Timing-free, so one run is the figure.
"""

from __future__ import annotations

import random

from modeld.backends.base import LoadOptions, ModelRuntime
from modeld.backends.llama import LlamaBackend
from modeld.contract import Config, OpenSessionRequest
from modeld.testmodels import REALISTIC, ensure_model

HEAD, TAIL, AGENTS = 2048, 1024, 3


def _run(runtime: ModelRuntime, tokens: list[list[int]]) -> None:
    for _ in runtime.sync(0, 0, tokens[0]):
        pass
    for seq in range(1, AGENTS):
        runtime.copy(0, seq, HEAD)
        for _ in runtime.sync(seq, HEAD, tokens[seq][HEAD:]):
            pass


def main() -> int:
    spec = REALISTIC
    theoretical = 2 * spec.layers * spec.kv_heads * (spec.hidden // spec.heads) * 2
    path = str(ensure_model(spec))
    rng = random.Random(11)
    head = [rng.randrange(300, 30000) for _ in range(HEAD)]
    tokens = [head + [rng.randrange(300, 30000) for _ in range(TAIL)] for _ in range(AGENTS)]
    window = HEAD + TAIL + 64
    print(
        f"theoretical: {theoretical} bytes per token (f16 K and V, {spec.layers} layers, {spec.kv_heads} KV heads)"
    )
    for unified in (False, True):
        backend = LlamaBackend()
        request = OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=window, num_batch=512))
        pool = HEAD + AGENTS * TAIL + 128 if unified else AGENTS * window
        options = LoadOptions(n_seq=AGENTS, window=window, pool_tokens=pool, unified=unified)
        runtime = backend.load(request, backend.describe(request), options)
        try:
            _run(runtime, tokens)  # a unified pool that stored the head three times would refuse the tails
            held = [len(runtime.resident(seq)) for seq in range(AGENTS)]
            pool = runtime.layout.pool_tokens  # llama.cpp may round the context up
            per_token = [len(runtime.snapshot(seq)) / held[seq] for seq in range(AGENTS)]
        finally:
            runtime.close()
        assert held == [HEAD + TAIL] * AGENTS, held
        name = "unified" if unified else "split"
        resident = pool * max(per_token)  # every cell of the pool is allocated (and cleared) at load
        print(
            f"{name:8s} engine state {min(per_token):.0f}-{max(per_token):.0f} bytes per token "
            f"({max(per_token) / theoretical:.3f}x theoretical); {sum(held)} cached tokens in a {pool}-cell pool: "
            f"resident bytes per cached token {resident / sum(held) / theoretical:.2f}x theoretical"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
