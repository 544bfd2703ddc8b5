"""Generated GGUF test models: real tokenizer and chat template, random weights, no downloads.

What: :func:`ensure_model` returns the path of a GGUF file described by a :class:`ModelSpec`,
generating it (with ``gguf`` + NumPy + ``tokenizers``) into a cache directory the first time.
Three specs ship:

* :data:`TINY`: llama architecture; loads and decodes in milliseconds; what the default test
  suite runs real engines (llama.cpp, OpenVINO GenAI) on.
* :data:`REALISTIC`: the shape of a ~0.5B coding model with GQA (386M parameters, q8_0,
  ~412 MB); real compute cost and KV size for benchmarks.
* :data:`RECURRENT`: a tiny Mamba (recurrent) model with TINY's tokenizer. llama.cpp keeps one
  state per sequence instead of per-token KV entries, so its memory cannot be truncated at a
  token position; backends test their full re-prefill fallback on it. llama.cpp only:
  OpenVINO GenAI kills the process (SIGFPE) when asked to load it.
* :data:`ARCH_SPECS` (:class:`ArchSpec`): one tiny model of each class whose memory cannot be
  cut at any token: sliding window (:data:`GEMMA3`, :data:`GPT_OSS`), short-convolution hybrid
  (:data:`LFM2`), gated-DeltaNet hybrid (:data:`QWEN35`), Mamba-2 hybrid
  (:data:`GRANITE_HYBRID`), pure recurrent (:data:`MAMBA2`). llama.cpp only.

Why: nothing can be downloaded here, and tests must exercise real engines. Both llama.cpp and
OpenVINO GenAI load the same file. The file is a pure function of ``(spec, GENERATOR_VERSION)``
(byte-identical on every machine and Python version), so its cache name is a digest of exactly
that and a changed spec or generator never reuses a stale file.

What not: the weights are random, so the text is garbage; correctness is checked as "warm
output equals cold output, token for token", never against expected text. Design record:
``blueprints/0008-test-models.md``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from filelock import FileLock

from modeld.testmodels._archs import (
    ARCH_SPECS,
    GEMMA3,
    GPT_OSS,
    GRANITE_HYBRID,
    LFM2,
    MAMBA2,
    QWEN35,
    ArchSpec,
    write_arch,
)
from modeld.testmodels._gguf import write_gguf
from modeld.testmodels._spec import (
    COPYING,
    GENERATOR_VERSION,
    REALISTIC,
    RECURRENT,
    REPLY,
    THINK,
    TINY,
    TOOLS,
    ModelSpec,
)

__all__ = [
    "ARCH_SPECS",
    "COPYING",
    "GEMMA3",
    "GPT_OSS",
    "GRANITE_HYBRID",
    "LFM2",
    "MAMBA2",
    "QWEN35",
    "GENERATOR_VERSION",
    "REALISTIC",
    "RECURRENT",
    "REPLY",
    "THINK",
    "TINY",
    "TOOLS",
    "ArchSpec",
    "ModelSpec",
    "default_cache_dir",
    "ensure_ir",
    "ensure_model",
]

_CACHE_ENV = "MODELD_MODEL_CACHE"


def default_cache_dir() -> Path:
    """``$MODELD_MODEL_CACHE`` if set, else the user cache directory + ``modeld/models``."""
    configured = os.environ.get(_CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    try:
        import platformdirs
    except ImportError:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    else:
        base = platformdirs.user_cache_path()
    return base / "modeld" / "models"


def ensure_model(spec: ModelSpec | ArchSpec = TINY, cache_dir: Path | None = None) -> Path:
    """The path of ``spec``'s GGUF file in ``cache_dir``, generated first if it is missing.

    The file name is ``<spec.name>-<digest of (spec, GENERATOR_VERSION)>.gguf``. The file is
    written to a temporary name in the same directory and renamed into place, so a reader never
    sees a partial file; a lock file next to it makes concurrent callers (other processes, other
    threads) wait for one generation instead of repeating it.
    """
    directory = default_cache_dir() if cache_dir is None else Path(cache_dir)
    path = directory / spec.file_name
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(directory / f"{spec.file_name}.lock"):
        if path.is_file():  # another process finished it while we waited
            return path
        fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.file_name}.", suffix=".tmp", dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            if isinstance(spec, ArchSpec):
                write_arch(spec, tmp)
            else:
                write_gguf(spec, tmp)
            with tmp.open("rb") as fh:
                os.fsync(fh.fileno())
            tmp.chmod(0o644)  # mkstemp creates 0600; the cache may be shared (CI)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def ensure_ir(spec: ModelSpec = TINY, cache_dir: Path | None = None) -> Path:
    """An OpenVINO IR directory of ``spec`` (exported from its GGUF by OpenVINO GenAI), cached.

    Needs openvino-genai. The directory name includes the OpenVINO GenAI version, because the
    export is that library's, not ours.
    """
    import openvino_genai

    from modeld.testmodels._ir import write_ir

    directory = default_cache_dir() if cache_dir is None else Path(cache_dir)
    version = openvino_genai.__version__.split("-")[0]
    target = directory / f"{Path(spec.file_name).stem}-ir-{version}"
    if (target / "openvino_model.xml").is_file():
        return target
    gguf = ensure_model(spec, directory)
    with FileLock(directory / f"{target.name}.lock"):
        if not (target / "openvino_model.xml").is_file():
            write_ir(spec, gguf, target)
    return target
