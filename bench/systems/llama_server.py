"""llama.cpp's own ``llama-server``, set up as a well-informed user would for each workload.

Built by ``scripts/build_llama_server.sh`` from the llama.cpp vendored in the pinned
llama-cpp-python sdist (the engine's own commit). Settings: one slot per workspace (``-np``),
a unified KV buffer (``--kv-unified``: every slot may use the whole pool, a shared prefix can be
stored once), ``-c`` = slots x the workload's per-sequence context (or the workload's small pool),
the host-RAM prompt cache (``--cache-ram``), chunk reuse by KV shifting (``--cache-reuse 256``;
``cache_reuse=0`` leaves it at llama-server's default, off: the families' baseline, as a shifted
chunk is not what a fresh prefill computes, blueprint 0010),
and ``--slot-save-path`` so a restart can save every slot before the stop and restore it after
the start (``POST /slots/{id}?action=save|restore``), plus what a workload declares
(``Workload.llama_server_flags``: a higher ``--slot-prompt-similarity`` for sub-agents). Flash
attention off, batch 512 and the bench's thread count, as for every other system.

Its own accounting is read from every response: ``timings.prompt_n`` (tokens prefilled) and
``timings.cache_n`` (reused), with ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench.systems.base import Unsupported, free_port
from bench.systems.openai_http import HttpServerSystem, Streamed
from bench.workloads import Turn, Workload
from modeld.backends.cpu import cpu_has_amx

__all__ = ["CACHE_RAM_MIB", "CACHE_REUSE", "LlamaServerSystem"]

CACHE_RAM_MIB = 4096
CACHE_REUSE = 256  # the smallest chunk (tokens) llama-server moves to a new position; 0: off


class LlamaServerSystem(HttpServerSystem):
    name = "llama-server"

    def __init__(
        self, binary: str, model: str, load: Workload, threads: int, *, cache_reuse: int = CACHE_REUSE
    ) -> None:
        if not binary or not Path(binary).is_file():
            raise Unsupported(
                "no llama-server binary given (`make bench` builds one with scripts/build_llama_server.sh; "
                "`make bench-quick` runs without it unless LLAMA_SERVER=path)"
            )
        self.port = free_port()
        self.slots = load.workspaces
        ctx = load.pool_tokens or self.slots * load.n_ctx
        self.save_dir: Path | None = None
        flags = [
            "-c", str(ctx),
            "-t", str(threads),
            "-tb", str(threads),
            *(["--no-repack"] if cpu_has_amx() else []),  # as modeld: AMX crashes (blueprint 0009)
        ] if load.defaults else [
            "-c", str(ctx),
            "-np", str(self.slots),
            "--kv-unified",
            "--cache-ram", str(CACHE_RAM_MIB),
            *(["--cache-reuse", str(cache_reuse)] if cache_reuse else []),  # 0: llama-server's default
            "-t", str(threads),
            "-tb", str(threads),
            "-b", "512",
            "-ub", "512",
            "-fa", "off",
            *(["--no-repack"] if cpu_has_amx() else []),  # as modeld: AMX crashes (blueprint 0009)
            *load.llama_server_flags,
        ]  # fmt: skip
        cwd = Path(tempfile.mkdtemp(prefix="bls"))
        self.save_dir = cwd / "slots"
        self.save_dir.mkdir()
        args = [
            binary,
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-webui",
            "--slot-save-path",
            str(self.save_dir),
            *flags,
        ]
        self.pending_restore: list[int] = []
        super().__init__(args, cwd=cwd)
        self.settings = {
            "command": "llama-server -m MODEL --host 127.0.0.1 --no-webui --slot-save-path DIR "
            + " ".join(flags),
            "why": "its defaults (slots, KV layout, RAM cache, flash attention), the window alone given"
            if load.defaults
            else (
                f"{self.slots} slot(s) = workspaces; -c {ctx} = "
                + (
                    f"the workload's KV pool ({load.pool_tokens} tokens)"
                    if load.pool_tokens
                    else f"{self.slots} x {load.n_ctx} (every workspace fits)"
                )
                + (
                    f"; {' '.join(load.llama_server_flags)}: {load.llama_server_why}"
                    if load.llama_server_flags
                    else ""
                )
            ),
        }

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def body(self, key: str, turn: Turn, max_tokens: int) -> dict[str, Any]:
        return {
            **super().body(key, turn, max_tokens),
            "cache_prompt": True,
            "stream_options": {"include_usage": True},
        }

    def accounting(self, streamed: Streamed, turn: Turn) -> tuple[int | None, int | None]:
        timings = streamed.final.get("timings") or {}
        if "prompt_n" in timings:
            return int(timings["prompt_n"]), int(timings.get("cache_n", 0))
        return super().accounting(streamed, turn)

    def before_turn(self) -> float | None:
        if not self.pending_restore:
            return None
        started = time.perf_counter()
        for slot in self.pending_restore:
            r = self.http.post(
                f"/slots/{slot}", params={"action": "restore"}, json={"filename": f"slot{slot}.bin"}
            )
            if r.status_code != 200:
                self.notes.append(f"slot {slot} restore failed: HTTP {r.status_code} {r.text[:200]}")
        self.pending_restore = []
        return time.perf_counter() - started

    def restart(self) -> float:
        """Save every slot that holds tokens, stop, start; the restore happens before the next
        request (timed as part of that turn, as a client would have to do it)."""
        started = time.perf_counter()
        saved = []
        for slot in range(self.slots):
            r = self.http.post(
                f"/slots/{slot}", params={"action": "save"}, json={"filename": f"slot{slot}.bin"}
            )
            if r.status_code == 200 and int(r.json().get("n_saved", 0)) > 0:
                saved.append(slot)
        self.stop()
        self._start()
        self.pending_restore = saved
        return time.perf_counter() - started
