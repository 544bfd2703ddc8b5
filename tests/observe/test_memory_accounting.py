"""Where the memory goes, and that the parts add up (issue 22 item 2).

A real ``modeld serve`` with a llama worker: ``status`` and ``/metrics`` split the daemon's and
the worker's resident memory into the daemon's own, the RAM tier, and per worker the model's
weights, its KV pool (allocated and used), its compute buffer and its runtime; the test holds
their sum against psutil's RSS of the daemon and worker processes, and each part against what
it must be (the model file's size, the layout's arithmetic, the cells in use).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import httpx
import psutil
import pytest
from daemon_proc import serve_http, stop
from prometheus_client.parser import text_string_to_metric_families

import runtime_client as rc
from modeld.contract import Config, OpenSessionRequest, PrefixInput

testmodels = pytest.importorskip("modeld.testmodels")

TEXT = "def handler(request):\n    return respond(request.body)\n"
MIB = 1 << 20


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.llama
def test_status_and_metrics_add_up_to_the_processes_rss() -> None:
    tiny = str(testmodels.ensure_model(testmodels.TINY))
    tmp = Path(tempfile.mkdtemp(prefix="mdmem"))
    # One sequence and no write-behind: the second workspace evicts the first to the RAM tier.
    proc, record = serve_http(
        tmp, "--sequences", "1", "--persist-min-tokens", "100000", backend="llama", timeout=300
    )
    try:
        client = rc.connect(f"unix:{tmp / 's.sock'}")
        request = OpenSessionRequest(type="llama", path=tiny, config=Config(num_ctx=4096))
        a, b = client.open_session(request), client.open_session(request)
        first = a.ensure_prefix(PrefixInput(text=TEXT * 80))
        live = client.status()
        assert live.memory.ram_tier_bytes == 0  # the live context is in the KV only
        b.ensure_prefix(PrefixInput(text=TEXT.upper() * 80))  # a's context leaves the KV: to RAM
        status = client.status()
        pids = [record.pid] + [m.worker.pid for m in status.models if m.worker is not None]
        measured = sum(psutil.Process(pid).memory_info().rss for pid in pids)
        client.close()
        metrics = _metrics(record.http_endpoint)
    finally:
        _, err = stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    assert "Traceback" not in err, err[-3000:]

    memory = status.memory
    (model,) = status.models
    m = model.memory
    assert m.isolation == "process" and model.worker is not None
    # Each part is what it must be.
    assert memory.ram_tier_bytes > 0 and memory.ram_tier_bytes < memory.rss_bytes
    ram = [c for c in model.contexts if c.tier == "ram"]
    assert [c.tokens for c in ram] == [first.prefix_tokens]
    assert memory.ram_tier_bytes == sum(c.bytes for c in ram)
    assert memory.own_bytes == memory.rss_bytes - memory.ram_tier_bytes
    assert m.kv_allocated_bytes == model.pool_tokens * model.kv_bytes_per_token > 0
    assert m.kv_used_bytes == model.resident_tokens * model.kv_bytes_per_token > 0
    size = os.path.getsize(tiny)
    assert size - 2 * MIB < m.weights_bytes <= size + 4096  # every tensor was read by the prefill
    assert 0 < m.runtime_bytes < m.rss_bytes and m.compute_bytes > 0
    # The parts add up to the kernel's count, as status measured it and as psutil does now.
    assert memory.measured_bytes == memory.rss_bytes + m.rss_bytes
    assert abs(memory.measured_bytes - measured) < 16 * MIB  # a moment apart
    assert memory.parts_bytes == memory.own_bytes + memory.ram_tier_bytes + m.parts_bytes
    # The prefill touched the compute buffer: the parts are within the tolerance either side.
    assert memory.untouched_max_bytes == m.compute_bytes
    assert abs(memory.parts_bytes - measured) <= memory.tolerance_bytes, (memory, m)
    assert memory.adds_up(measured)
    # /metrics says the same.
    name = model.model_name
    for part, value in (("weights", m.weights_bytes), ("kv_allocated", m.kv_allocated_bytes)):
        assert metrics[("modeld_model_memory_bytes", (("model", name), ("part", part)))] == value
    assert metrics[("modeld_memory_bytes", (("part", "ram_tier"),))] == memory.ram_tier_bytes
    assert abs(metrics[("modeld_memory_bytes", (("part", "parts"),))] - memory.parts_bytes) < 16 * MIB


LEAN = """
import sys
from modeld.backends import gguf_header, llama_runtime
gguf_header._quant_sizes()
heavy = sorted(m for m in ("numpy", "yaml", "jinja2", "diskcache", "sqlite3") if m in sys.modules)
import gguf, llama_cpp
print(heavy, gguf.GGUFReader.__name__, llama_cpp.Llama.__name__, llama_cpp.llama_cpp is llama_runtime._llama)
"""


def test_the_daemon_reads_gguf_and_the_worker_loads_llama_cpp_without_their_packages_extras() -> None:
    """``_lean``: the daemon's GGUF reading takes gguf's constants without its ``__init__`` (which
    loaded numpy, OpenBLAS and yaml into the daemon: 12 MiB of its peak RSS), the worker llama.cpp's
    bindings without llama-cpp-python's high-level API (9 MiB); numpy stays for the worker's
    sampling, so it is the only heavy module; a later ``import`` of either package is whole."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", LEAN], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["['numpy']", "GGUFReader", "Llama", "True"], out.stdout + out.stderr


RACE = """
import sys, threading
from modeld.backends._lean import submodule
errors, go = [], threading.Event()
def read():
    go.wait()
    try:
        submodule("gguf", "constants").GGML_QUANT_SIZES
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=read) for _ in range(8)]
for t in threads:
    t.start()
go.set()
for t in threads:
    t.join()
print(errors[:1], "numpy" in sys.modules)
"""


def test_threads_that_read_gguf_headers_at_once_all_get_the_table() -> None:
    """The daemon reads GGUF headers on several threads (sessions opening at once): the
    stand-in package is put in place and taken away under a lock. Without it, 8 threads starting
    together failed with KeyError('gguf') or a partially initialized module in every try (the
    chaos test's first OpenSession hit it as an internal error)."""
    import subprocess
    import sys

    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120, check=True
        )
        assert out.stdout.split() == ["[]", "False"], out.stdout + out.stderr
