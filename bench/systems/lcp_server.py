"""llama-cpp-python's OpenAI server (``python -m llama_cpp.server``) with its prompt cache.

The peer most Python users reach first. ``--cache true`` keeps whole-context states keyed by
prompt tokens: in RAM (``--cache_type ram``), or on disk (``--cache_type disk``, under the
server's working directory) for the workload group that restarts the server, so its cache can
survive the restart, as a well-informed user would configure it.

It reports no cached-token counts (no ``usage`` in its stream), so the server runs ``--verbose``
and the tokens it prefilled are read from its own log line for each request
(``Llama.generate: N prefix-match hit, remaining M prompt tokens to eval``; no such line means
the whole prompt was evaluated). It serves one request at a time, so in a concurrent wave its
requests are matched to its log lines in the order their first tokens arrived.
"""

from __future__ import annotations

import re
import sys
import time

from bench.systems.base import TurnResult, free_port, threaded_wave
from bench.systems.openai_http import HttpServerSystem, stream_completion
from bench.workloads import Turn, Workload
from modeld.backends.cpu import cpu_has_amx

__all__ = ["LcpServerSystem", "parse_prefills"]

_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
_CACHED = "Llama.generate: full prompt already cached"
_END = re.compile(r"^\s*llama_perf_context_print:\s+total time", re.MULTILINE)


def parse_prefills(log: str) -> list[int | None]:
    """One entry per finished request in ``log``: tokens prefilled, or None for the whole
    prompt (no prefix-match line before the request's closing timings)."""
    out: list[int | None] = []
    start = 0
    for end in _END.finditer(log):
        chunk = log[start : end.start()]
        start = end.end()
        hits = _HIT.findall(chunk)
        if _CACHED in chunk:
            out.append(0)
        elif hits:
            out.append(int(hits[-1][1]))
        else:
            out.append(None)
    return out


_NO_EXTRA_BUFFERS = """
import runpy, llama_cpp.llama_cpp as low
default = low.llama_model_default_params
def params():
    p = default()
    p.use_extra_bufts = False
    return p
low.llama_model_default_params = params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""
"""``python -m llama_cpp.server`` with llama.cpp's extra buffer types off (its ``Llama`` reads
the model parameters' defaults from this function). On a CPU with AMX, llama.cpp repacks
weights for its AMX matmul, which crashes here (a general protection fault in libggml-cpu at
the first completion; blueprint 0009): modeld loads without them, the bench's llama-server runs
``--no-repack``, and the server has no setting for it."""


class LcpServerSystem(HttpServerSystem):
    name = "lcp-server"
    ready_path = "/v1/models"

    def __init__(self, model: str, load: Workload, threads: int, *, disk: bool) -> None:
        self.port = free_port()
        flags = [
            "--n_ctx", str(load.n_ctx),
            "--n_batch", "512",
            "--n_threads", str(threads),
            "--n_threads_batch", str(threads),
            "--cache", "true",
            "--interrupt_requests", "false",
            "--cache_type", "disk" if disk else "ram",
        ]  # fmt: skip
        amx = cpu_has_amx()
        args = [
            sys.executable,
            *(["-c", _NO_EXTRA_BUFFERS] if amx else ["-m", "llama_cpp.server"]),
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--verbose",
            "true",
            *flags,
        ]
        super().__init__(args)
        self.settings = {
            "command": "python -m llama_cpp.server --model MODEL --host 127.0.0.1 --verbose true "
            + " ".join(flags)
            + (" (llama.cpp's extra buffer types off: AMX crashes here)" if amx else ""),
            "why": "its disk cache survives a restart" if disk else "its RAM prompt cache",
        }

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _log_size(self) -> int:
        self.log.flush()
        return self.log_path.stat().st_size

    def _log_since(self, offset: int) -> str:
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def turn(self, workload: str, index: int, key: str, turn: Turn, max_tokens: int) -> TurnResult:
        offset = self._log_size()
        started = time.perf_counter()
        s = stream_completion(self.http, self.body(key, turn, max_tokens), started)
        prefills = self._wait_for_prefills(offset, 1)
        prefilled = turn.prompt_tokens if prefills[0] is None else prefills[0]
        return self._result(workload, index, turn, s, prefilled, turn.prompt_tokens - prefilled)

    def _wait_for_prefills(self, offset: int, n: int) -> list[int | None]:
        """The server prints a request's timings just before its final chunk; allow a moment."""
        deadline = time.monotonic() + 5
        while True:
            found = parse_prefills(self._log_since(offset))
            if len(found) >= n or time.monotonic() > deadline:
                return found + [None] * (n - len(found))
            time.sleep(0.05)

    def wave(self, workload: str, items: list[tuple[int, str, Turn]], max_tokens: int) -> list[TurnResult]:
        offset = self._log_size()

        def run(index: int, key: str, turn: Turn) -> TurnResult:
            started = time.perf_counter()
            s = stream_completion(self.http, self.body(key, turn, max_tokens), started)
            return self._result(workload, index, turn, s, None, None)

        results = threaded_wave(run, items)
        prefills = self._wait_for_prefills(offset, len(results))
        by_first = sorted(range(len(results)), key=lambda k: results[k].ttft_s)
        turns = {i: t for i, _, t in items}
        for order, k in enumerate(by_first):
            r = results[k]
            p = prefills[order]
            r.prefilled = turns[r.turn].prompt_tokens if p is None else p
            r.cached = turns[r.turn].prompt_tokens - r.prefilled
        return results
