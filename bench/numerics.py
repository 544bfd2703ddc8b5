"""``python -m bench.numerics [TURNS]``: does warm output equal a fresh evaluation, per KV layout?

A seeded walk of four sessions over three sequences of one model (random workspace edits; copies,
evictions and restores happen as they would for a coding tool), run once with the split KV
layout and once with the unified pool. Every turn's greedy tokens are compared with the same
text evaluated in an emptied sequence of a separate runtime. Prints, per layout, how many turns
were equal, by reuse reason. This is the measurement behind blueprint 0016's choice of the split
layout; it counts, it never fails on a difference.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

from modeld.backends.base import LoadOptions
from modeld.backends.llama import LlamaBackend
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.settings import Residency
from modeld.testmodels import REALISTIC, ensure_model

WORKSPACES = [
    "You are a careful engineer.\nrepo: src/app.py main() load_config()\nsrc/db.py connect() migrate()\n" * 4,
    "You are a careful engineer.\nrepo: lib/parser.c parse() lex()\nlib/ast.h node_t\n" * 4,
    "You are a terse reviewer.\nrepo: web/index.ts render() route()\nweb/api.ts fetchUser()\n" * 4,
]
SUFFIXES = ["fix the failing test\n", "why does migrate() hang?\n", "add a docstring\n", "rename lex\n"]
EDITS = ["history: user asked about tests\n", "history: tool returned 3 lines\n", "pinned: def f(): pass\n"]
TOKENS = 8


def _request(path: str) -> OpenSessionRequest:
    return OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=2048, num_batch=32))


class Fresh(dict[tuple[str, str], list[int]]):
    """Greedy tokens of a text evaluated in an emptied sequence (computed on first use)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        backend = LlamaBackend()
        request = _request(path)
        self.runtime = backend.load(
            request, backend.describe(request), LoadOptions(n_seq=1, window=2048, pool_tokens=2048)
        )
        self.eog = self.runtime.vocab().eog

    def __missing__(self, key: tuple[str, str]) -> list[int]:
        runtime = self.runtime
        tokens = runtime.tokenize(key[0], add_bos=True) + runtime.tokenize(key[1], add_bos=False)
        runtime.drop(0)
        for _ in runtime.sync(0, 0, tokens):
            pass
        out = []
        for token in runtime.generate(0, DecodeConfig(max_tokens=TOKENS), TOKENS):
            if token in self.eog:
                break
            out.append(token)
        self[key] = out
        return out


def main(argv: list[str]) -> int:
    turns = int(argv[0]) if argv else 24
    path = str(ensure_model(REALISTIC))
    fresh = Fresh(path)
    layouts = {
        "split": Residency(sequences=3, snapshot_min_tokens=8, persist_min_tokens=8),
        "unified": Residency(
            sequences=3, kv_unified=True, pool_tokens=4096, snapshot_min_tokens=8, persist_min_tokens=8
        ),
    }
    for name, residency in layouts.items():
        rng = random.Random(11)
        by_reason: dict[str, list[int]] = {}
        with Engine(backends=("llama",), residency=residency, data_dir=Path(tempfile.mkdtemp())) as engine:
            sessions = [engine.open_session(_request(path)) for _ in range(4)]
            history = ["" for _ in sessions]
            workspace = [rng.randrange(len(WORKSPACES)) for _ in sessions]
            for _ in range(turns):
                i = rng.randrange(len(sessions))
                if rng.random() < 0.4:
                    history[i] += rng.choice(EDITS)
                prefix, suffix = WORKSPACES[workspace[i]] + history[i], rng.choice(SUFFIXES)
                status = sessions[i].ensure_prefix(PrefixInput(text=prefix))
                sessions[i].prefill_suffix(SuffixInput(text=suffix))
                with sessions[i].decode(DecodeConfig(max_tokens=TOKENS)) as stream:
                    warm = [t for chunk in stream for t in chunk.token_ids]
                counts = by_reason.setdefault(status.reuse.reason, [0, 0])
                counts[0 if warm == fresh[(prefix, suffix)] else 1] += 1
        equal = sum(c[0] for c in by_reason.values())
        print(
            f"{name}: {equal} of {turns} turns equal a fresh evaluation; by reason [equal, different]: {by_reason}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
