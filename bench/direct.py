"""The limit: llama-cpp-python driven directly, in its own process, with no daemon in between.

Written independently of modeld's backend (only llama-cpp-python's low-level API), it keeps one
hot context per workspace and evaluates exactly the tokens that differ from what that context
holds (longest common prefix, ``llama_memory_seq_rm``, prefill the rest, greedy decode): what a
perfect daemon would cost. A separate context, cleared before every use, gives the cold cost of
the same prompt (what no cache costs). ``restart`` saves every hot context to a file
(``llama_state_seq_save_file``) and frees it; the next turn of that workspace creates a fresh
context and loads the file back (``llama_state_seq_load_file``) inside its timed turn: what a
perfect disk tier would cost.

Protocol: one JSON object per line on stdin, one JSON answer per line on stdout.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import time
from typing import Any

import llama_cpp as lc
import numpy as np

from modeld.backends.cpu import cpu_has_amx


def _quiet(_level: int, _text: bytes, _data: Any) -> None:
    return None


_LOG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_quiet)


def tokenize(vocab: Any, text: str) -> list[int]:
    """llama.cpp's tokens for ``text`` (control-token text parsed, no BOS)."""
    data = text.encode()
    buf = (lc.llama_token * (len(data) + 8))()
    n = lc.llama_tokenize(vocab, data, len(data), buf, len(buf), False, True)
    return list(buf[:n])


class Driver:
    def __init__(self, model_path: str, n_ctx: int, n_batch: int, threads: int) -> None:
        lc.llama_log_set(_LOG, ctypes.c_void_p(0))
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.use_extra_bufts = not cpu_has_amx()  # llama.cpp's AMX matmul crashes (blueprint 0009)
        self.model = lc.llama_model_load_from_file(model_path.encode(), params)
        if not self.model:
            raise RuntimeError(f"cannot load {model_path}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx, self.n_batch, self.threads = n_ctx, n_batch, threads
        self.contexts: dict[str, tuple[Any, list[int]]] = {}
        self.saved: dict[str, str] = {}  # workspace -> state file written by restart()

    def close(self) -> None:
        """Free every context and the model."""
        for ctx, _ in self.contexts.values():
            lc.llama_free(ctx)
        self.contexts.clear()
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None

    def restart(self, directory: str) -> int:
        """Save every hot context to a file and free it; returns the bytes written."""
        written = 0
        for name, (ctx, held) in list(self.contexts.items()):
            if name == "cold" or not held:
                continue
            path = os.path.join(directory, f"{len(self.saved)}.state")
            arr = (lc.llama_token * len(held))(*held)
            written += lc.llama_state_seq_save_file(ctx, path.encode(), 0, arr, len(held))
            self.saved[name] = path
        for ctx, _ in self.contexts.values():
            lc.llama_free(ctx)
        self.contexts.clear()
        return written

    def _restore(self, name: str) -> None:
        ctx, held = self._context(name)
        path = self.saved.pop(name)
        buf = (lc.llama_token * self.n_ctx)()
        n = ctypes.c_size_t(0)
        if lc.llama_state_seq_load_file(ctx, path.encode(), 0, buf, self.n_ctx, ctypes.byref(n)) == 0:
            raise RuntimeError(f"cannot load {path}")
        held[:] = list(buf[: n.value])

    def _context(self, name: str) -> tuple[Any, list[int]]:
        if name not in self.contexts:
            p = lc.llama_context_default_params()
            p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = self.n_ctx, self.n_batch, self.n_batch, 1
            p.n_threads = p.n_threads_batch = self.threads
            p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as modeld's and the peer's default
            p.no_perf = True
            ctx = lc.llama_init_from_model(self.model, p)
            self.contexts[name] = (ctx, [])
        return self.contexts[name]

    def tokenize(self, text: str, bos: bool) -> list[int]:
        out = tokenize(self.vocab, text)
        return [lc.llama_vocab_bos(self.vocab), *out] if bos else out

    def _decode(self, ctx: Any, tokens: list[int]) -> None:
        arr = (lc.llama_token * len(tokens))(*tokens)
        if lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, ctx: Any) -> int:
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def turn(self, name: str, prefix: str, suffix: str, max_tokens: int, cold: bool) -> dict[str, Any]:
        started = time.perf_counter()
        restore = 0.0
        if not cold and name in self.saved:
            self._restore(name)
            restore = time.perf_counter() - started
        ctx, held = self._context("cold" if cold else name)
        mem = lc.llama_get_memory(ctx)
        tokens = self.tokenize(prefix, True) + self.tokenize(suffix, False)
        keep = 0
        if not cold:
            while keep < min(len(held), len(tokens)) and held[keep] == tokens[keep]:
                keep += 1
            keep = min(keep, len(tokens) - 1)  # the last prompt token is evaluated for its logits
        if keep == 0:
            lc.llama_memory_clear(mem, True)
        else:
            lc.llama_memory_seq_rm(mem, 0, keep, -1)
        del held[keep:]
        for start in range(keep, len(tokens), self.n_batch):
            self._decode(ctx, tokens[start : start + self.n_batch])
        held.extend(tokens[keep:])
        token = self._argmax(ctx)
        first = time.perf_counter()
        generated = [token]
        while len(generated) < max_tokens and not lc.llama_vocab_is_eog(self.vocab, token):
            self._decode(ctx, [token])
            held.append(token)
            token = self._argmax(ctx)
            generated.append(token)
        last = time.perf_counter()
        return {
            "ttft_s": first - started,
            "total_s": last - started,
            "prefilled": len(tokens) - keep,
            "prompt_tokens": len(tokens),
            "completion_tokens": len(generated),
            "decode_tps": (len(generated) - 1) / (last - first) if last > first else 0.0,
            "restore_s": restore,
            "token_ids": generated,
        }


def vocab_tokenizer(model: str) -> Any:
    """The model's own tokenizer (llama.cpp, vocabulary only: no weights): text -> token ids."""
    lc.llama_log_set(_LOG, ctypes.c_void_p(0))
    params = lc.llama_model_default_params()
    params.vocab_only = True
    vocab = lc.llama_model_get_vocab(lc.llama_model_load_from_file(model.encode(), params))
    return lambda text: tokenize(vocab, text)


def main() -> None:
    driver: Driver | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "load":
            driver = Driver(cmd["model"], cmd["n_ctx"], cmd["n_batch"], cmd["threads"])
            answer: dict[str, Any] = {"ok": True, "pid": os.getpid()}
        elif op == "turn":
            assert driver is not None
            answer = driver.turn(cmd["name"], cmd["prefix"], cmd["suffix"], cmd["max_tokens"], cmd["cold"])
        elif op == "restart":
            assert driver is not None
            answer = {"bytes": driver.restart(cmd["directory"])}
        elif op == "tokens":
            assert driver is not None
            answer = {"n": len(driver.tokenize(cmd["text"], False))}
        elif op == "peak_rss":
            answer = {"bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        else:
            break
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
