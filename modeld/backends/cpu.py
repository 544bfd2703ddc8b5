"""What the CPU can do, as llama.cpp's build here cares: one place both the describing side and
the worker read (no import between ``llama.py`` and the worker-side ``llama_*`` modules)."""

from __future__ import annotations

__all__ = ["cpu_has_amx"]


def cpu_has_amx() -> bool:
    """Whether the CPU advertises Intel AMX (``amx_int8`` in ``/proc/cpuinfo``).

    On such a CPU llama.cpp puts quantized weights in its AMX buffer type, and its AMX matmul
    (``ggml_backend_amx_mul_mat``) dies of a general protection fault at ``ldtilecfg`` in this
    build (measured on a Xeon with AMX: every q8_0 model crashed the process at its first
    decode; llama.cpp #20824 reports the same crash with another GCC). So the runtime loads
    weights without llama.cpp's extra buffer types there (``use_extra_bufts``; llama-server's
    ``--no-repack``), which also skips CPU repacking."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_int8" in line.split(":", 1)[1].split()
    except OSError:
        pass
    return False
