"""What an OpenVINO model is: the one reader of its source, for both sides of the backend.

A source is a GGUF file (f16/q8_0, byte-level BPE; the same file the llama backend takes) or an
IR directory (``openvino_model.xml`` + tokenizer/detokenizer IR, as optimum-intel or
``enable_save_ov_model`` write them). The daemon side (``openvino.py``: describe) and the worker
side (``openvino_runtime.py``: the pipeline) both read it here, with the settings they share
(the inference precision, the device), so neither imports the other.

A GGUF file is read from its metadata (:mod:`modeld.backends.gguf_meta`). Reading an IR needs
OpenVINO, which the daemon never imports: :func:`read_source` runs ``python -m
modeld.backends.openvino_source --describe PATH`` in a short-lived child process (with a
timeout; cached by the directory's digest), which calls :func:`read_ir` and prints JSON. Design
record: ``blueprints/0011-openvino-backend.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from modeld.backends.gguf_meta import KV_TYPE_BYTES, read_gguf
from modeld.backends.probe import open_model_file, probe_model_path
from modeld.contract import Config, SpecialToken
from modeld.errors import (
    InvalidArgumentError,
    ModeldError,
    ModelLoadError,
    UnsupportedError,
    error_from_reason,
)

__all__ = [
    "KV_PRECISIONS",
    "Source",
    "device",
    "dir_digest",
    "kv_bytes",
    "precision",
    "read_ir",
    "read_source",
    "special_tokens",
]

KV_PRECISIONS = {"f32": "f32", "f16": "f16", "bf16": "bf16"}
PRECISIONS = ("f32", "bf16", "f16")
GGUF_FILE_TYPES = {1: "f16", 7: "q8_0"}
IR_DESCRIBE_SECONDS = 120.0


def precision() -> str:
    """The inference precision (``MODELD_OPENVINO_PRECISION``: f32 by default, so greedy decoding
    matches llama.cpp on the generated models; part of ``backend_version``)."""
    value = os.environ.get("MODELD_OPENVINO_PRECISION", "f32")
    if value not in PRECISIONS:
        raise InvalidArgumentError(
            f"MODELD_OPENVINO_PRECISION must be one of {', '.join(PRECISIONS)}, got {value!r}",
            field="MODELD_OPENVINO_PRECISION",
        )
    return value


@dataclass(frozen=True, slots=True)
class Source:
    """What describe learned about a GGUF file or an IR directory."""

    path: str
    kind: str  # gguf | ir
    digest: str
    name: str
    context_length: int
    layers: int
    architecture: str
    kv_values_per_token: int  # sum over layers of kv_heads * (key_length + value_length)
    vocab_size: int
    tokenizer_digest: str
    chat_template: str
    add_bos: bool
    bos_token: str
    eos_token: str
    weights_bytes: int


def kv_bytes(values: int, kv_cache_type: str) -> int:
    block_bytes, block_values = KV_TYPE_BYTES[kv_cache_type]
    return -(-values * block_bytes // block_values)


def dir_digest(path: Path) -> str:
    """``ir-v1``: xxh3-128 over each file's name, size, first 8 MiB and last 64 KiB."""
    h = xxhash.xxh3_128(b"modeld.ir.v1\0")
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open_model_file(str(file), what="IR file") as f:
            h.update(f.read_at(0, 8 << 20))
            if size > (8 << 20):
                h.update(f.read_at(size - (64 << 10), 64 << 10))
    return h.hexdigest()


_ir_cache: dict[tuple[str, str], Source] = {}
_ir_lock = threading.Lock()


def _read_ir_in_child(raw: str) -> Source:
    """Describe an IR directory in a short-lived child process (reading an IR needs OpenVINO,
    which the daemon never imports), with a timeout; cached by the directory's digest."""
    digest = dir_digest(Path(raw).expanduser())
    with _ir_lock:
        cached = _ir_cache.get((raw, digest))
    if cached is not None:
        return cached
    try:
        done = subprocess.run(
            [sys.executable, "-m", "modeld.backends.openvino_source", "--describe", raw],
            capture_output=True,
            timeout=IR_DESCRIBE_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ModelLoadError(
            f"describing the OpenVINO IR {raw!r} took longer than {IR_DESCRIBE_SECONDS:.0f}s", path=raw
        ) from None
    try:
        answer = json.loads(done.stdout.decode("utf-8") or "{}")
    except ValueError:
        answer = {}
    if "error" in answer:
        raise error_from_reason(
            answer["error"]["reason"], answer["error"]["message"], answer["error"]["details"]
        )
    if done.returncode != 0 or "source" not in answer:
        tail = done.stderr.decode("utf-8", errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(f"{raw!r} is not a readable OpenVINO IR ({tail[0][:300]})", path=raw)
    source = Source(**answer["source"])
    with _ir_lock:
        _ir_cache[(raw, digest)] = source
    return source


def read_source(raw: str) -> Source:
    """What a GGUF file or an IR directory is (raises ``model_load_failed`` / ``unsupported``)."""
    if probe_model_path(raw, directory_ok=True).kind == "directory":  # never blocks; no FIFOs inside
        return _read_ir_in_child(raw)
    meta = read_gguf(raw)
    if meta.tokenizer_model != "gpt2":
        raise UnsupportedError(
            f"OpenVINO GenAI loads GGUF files with a byte-level BPE (gpt2) vocabulary; {raw!r} has "
            f"{meta.tokenizer_model or 'none'}: use the llama backend",
            field="path",
        )
    if meta.file_type not in GGUF_FILE_TYPES:
        raise UnsupportedError(
            f"OpenVINO GenAI loads f16 or q8_0 GGUF files; {raw!r} has file type {meta.file_type}",
            field="path",
        )
    if meta.recurrent or meta.hybrid or meta.architecture not in ("llama", "qwen2", "qwen3", "mistral"):
        raise UnsupportedError(
            f"OpenVINO GenAI does not load {meta.architecture!r} GGUF models; use the llama backend",
            field="path",
        )
    return Source(
        path=raw,
        kind="gguf",
        digest=meta.digest,
        name=meta.name,
        context_length=meta.context_length,
        layers=meta.layers,
        architecture=meta.architecture,
        kv_values_per_token=sum(kv * (meta.key_length + meta.value_length) for kv in meta.kv_heads),
        vocab_size=meta.vocab_size,
        tokenizer_digest=meta.tokenizer_digest,
        chat_template=meta.chat_template,
        add_bos=meta.add_bos,
        bos_token=meta.bos_token,
        eos_token=meta.eos_token,
        weights_bytes=meta.weights_bytes,
    )


def special_tokens(source: Source) -> tuple[SpecialToken, ...]:
    """A GGUF file's control tokens (an IR directory's are not read: none listed)."""
    if source.kind != "gguf":
        return ()
    return tuple(SpecialToken(i, text, kind) for i, text, kind in read_gguf(source.path).special_tokens)


def device(config: Config) -> str:
    """CPU by default; ``MODELD_OPENVINO_DEVICE`` (CPU, GPU, NPU, GPU.1, ...) names another one,
    and ``num_gpu_layers > 0`` asks for the GPU. A device this machine lacks is refused (the
    devices come from the hardware inventory, which asks OpenVINO in a child process)."""
    from modeld.observe.hardware import inventory

    available = [d.name for d in inventory().openvino_devices] or ["CPU"]
    wanted = os.environ.get("MODELD_OPENVINO_DEVICE", "GPU" if config.num_gpu_layers > 0 else "CPU")
    if wanted not in available:
        field = "config.num_gpu_layers" if config.num_gpu_layers > 0 else "MODELD_OPENVINO_DEVICE"
        raise UnsupportedError(
            f"OpenVINO device {wanted} is not on this machine (available: {', '.join(available)})",
            field=field,
        )
    return wanted


def read_ir(raw: str) -> Source:
    """Describe an IR directory (needs OpenVINO: run in the child process, see :func:`main`)."""
    import openvino as ov
    import openvino_genai as og

    path = Path(raw).expanduser()
    model_xml = path / "openvino_model.xml"
    if not model_xml.is_file():
        raise ModelLoadError(f"{raw!r} is a directory without openvino_model.xml", path=raw)
    if not (path / "openvino_tokenizer.xml").is_file():
        raise ModelLoadError(f"{raw!r} has no openvino_tokenizer.xml (convert the tokenizer too)", path=raw)
    config: dict[str, Any] = {}
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except ValueError as exc:
            raise ModelLoadError(f"{raw!r}: config.json is not valid JSON: {exc}", path=raw) from exc
    try:
        core = ov.Core()
        model = core.read_model(str(model_xml))
        tokenizer = og.Tokenizer(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{raw!r} is not a readable OpenVINO IR: {exc}", path=raw) from exc
    states = [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]
    values = 0
    for state in states:
        shape = state.get_output_partial_shape(0)
        if shape.rank.get_length() == 4 and shape[1].is_static and shape[3].is_static:
            values += shape[1].get_length() * shape[3].get_length()
    template = tokenizer.chat_template or ""
    if not template and (path / "tokenizer_config.json").is_file():
        template = str(
            json.loads((path / "tokenizer_config.json").read_text()).get("chat_template", "") or ""
        )
    with_special = list(tokenizer.encode("a", add_special_tokens=True).input_ids.data[0])
    without = list(tokenizer.encode("a", add_special_tokens=False).input_ids.data[0])
    bos_id = int(tokenizer.get_bos_token_id())
    add_bos = len(with_special) > len(without) and with_special[0] == bos_id
    tok_hash = xxhash.xxh3_128()
    for name in (
        "openvino_tokenizer.xml",
        "openvino_tokenizer.bin",
        "openvino_detokenizer.xml",
        "openvino_detokenizer.bin",
    ):
        if (path / name).is_file():
            tok_hash.update((path / name).read_bytes())
    return Source(
        path=raw,
        kind="ir",
        digest=dir_digest(path),
        name=str(config.get("_name_or_path") or path.name),
        context_length=int(config.get("max_position_embeddings") or 0),
        layers=int(config.get("num_hidden_layers") or len(states) // 2),
        architecture=str(config.get("model_type") or ""),
        kv_values_per_token=values,
        vocab_size=int(config.get("vocab_size") or len(tokenizer.get_vocab())),
        tokenizer_digest=tok_hash.hexdigest(),
        chat_template=template,
        add_bos=add_bos,
        bos_token=tokenizer.get_bos_token(),
        eos_token=tokenizer.get_eos_token(),
        weights_bytes=sum(p.stat().st_size for p in path.glob("openvino_model.bin")),
    )


def main(argv: list[str] | None = None) -> int:
    """Describe an IR directory and print ``{"source": {...}}`` or ``{"error": {...}}`` as JSON."""
    parser = argparse.ArgumentParser(prog="modeld.backends.openvino_source")
    parser.add_argument("--describe", required=True)
    args = parser.parse_args(argv)
    try:
        source = read_ir(args.describe)
    except ModeldError as exc:
        print(json.dumps({"error": {"reason": exc.reason, "message": exc.message, "details": exc.details}}))
        return 0
    print(json.dumps({"source": dataclasses.asdict(source)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
