"""Know before you load (issue 22 item 4): what ``describe`` says a model will take, from its
file's header alone, checked against what llama.cpp allocates when it loads the model, and
worked out for a 7B-shaped header (a sparse file: the tensor table of a 7B model, no weights)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
from gguf_craft import STRING, UINT32, Tensor, load

from modeld.backends.base import LoadOptions
from modeld.backends.sizing import CELL_PAD, MODEL_OVERHEAD_BYTES, compute_bytes, layout_name
from modeld.contract import Config, ModelInfo, OpenSessionRequest
from modeld.engine import Engine
from modeld.settings import Residency

llama = pytest.importorskip("modeld.backends.llama")
testmodels = pytest.importorskip("modeld.testmodels")

MIB = 1 << 20


def _request(path: str, **config: object) -> OpenSessionRequest:
    return OpenSessionRequest(type="llama", path=path, config=replace(Config(), **config))  # type: ignore[arg-type]


class _Figures(logging.Handler):
    """llama.cpp's own log lines: "KV buffer size = X MiB", "compute buffer size = Y MiB"."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.kv = self.compute = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "buffer size" in text and "=" in text:
            mib = float(text.rsplit("=", 1)[1].split()[0])
            if "KV buffer" in text:
                self.kv += mib
            elif "compute buffer" in text:
                self.compute += mib


def _loaded(request: OpenSessionRequest, info: ModelInfo, options: LoadOptions) -> _Figures:
    """What llama.cpp says it allocated when it loaded ``request`` (then closed)."""
    figures = _Figures()
    logger = logging.getLogger("modeld.llama")
    logger.addHandler(figures)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        llama.LlamaBackend().load(request, info, options).close()
    finally:
        logger.removeHandler(figures)
        logger.setLevel(old)
    return figures


@pytest.mark.llama
@pytest.mark.parametrize(
    ("num_ctx", "kv", "flash_attn", "unified"),
    [
        (2048, "f16", False, True),
        (8192, "f16", False, True),
        (8192, "f16", True, True),
        (4096, "q8_0", True, True),
        (4096, "q4_0", True, False),
        (2048, "f16", False, False),
    ],
)
def test_describe_predicts_what_llama_cpp_allocates(
    num_ctx: int, kv: str, flash_attn: bool, unified: bool
) -> None:
    """KV bytes exactly (llama.cpp allocates the pool the plan names), the compute buffer within
    5% of llama.cpp's own figure (an estimate from the header's dimensions)."""
    path = str(testmodels.ensure_model(testmodels.TINY))
    request = _request(path, num_ctx=num_ctx, kv_cache_type=kv, flash_attn=flash_attn, num_batch=512)
    residency = Residency(sequences=2, kv_unified=unified)
    with Engine(backends=("llama",), residency=residency) as engine:
        info = engine.describe(request)
    fp = info.footprint
    assert fp.layout == (f"unified/2:{num_ctx}" if unified else "split/2")
    options = LoadOptions(
        n_seq=2, window=num_ctx, pool_tokens=fp.kv_bytes // fp.kv_bytes_per_token, unified=unified
    )
    assert layout_name(options) == fp.layout
    figures = _loaded(request, info, options)
    assert figures.kv == pytest.approx(fp.kv_bytes / MIB, abs=0.01)
    assert figures.compute == pytest.approx(fp.compute_bytes / MIB, rel=0.05)
    assert fp.total_bytes == fp.weights_bytes + fp.kv_bytes + fp.compute_bytes + MODEL_OVERHEAD_BYTES


def _seven_b(tmp_path: Path) -> Path:
    """A header with a 7B model's shape (32 layers, 4096 wide, 32 heads / 8 KV heads of 128,
    SwiGLU 14336, q8_0 weights, a 32k trained window) and the tiny model's tokenizer; its
    7 GB of weights are a hole in a sparse file."""
    tiny = load(testmodels.ensure_model(testmodels.TINY))
    layers, embd, heads, kv_heads, ff, vocab = 32, 4096, 32, 8, 14336, 4096
    g = tiny
    for key, value in (
        ("llama.block_count", layers),
        ("llama.embedding_length", embd),
        ("llama.attention.head_count", heads),
        ("llama.attention.head_count_kv", kv_heads),
        ("llama.feed_forward_length", ff),
        ("llama.context_length", 32768),
        ("llama.rope.dimension_count", embd // heads),
        ("general.file_type", 7),
    ):
        g = g.set(key, value, UINT32)
    g = g.set("general.name", "seven-b-shape", STRING)

    def q8(rows: int, cols: int) -> int:
        return rows * cols // 32 * 34

    kv_width = kv_heads * (embd // heads)
    tensors = [
        Tensor("token_embd.weight", (embd, vocab), 8, b"", size=q8(vocab, embd)),
        Tensor("output_norm.weight", (embd,), 0, b"", size=embd * 4),
        Tensor("output.weight", (embd, vocab), 8, b"", size=q8(vocab, embd)),
    ]
    for i in range(layers):
        tensors += [
            Tensor(f"blk.{i}.attn_norm.weight", (embd,), 0, b"", size=embd * 4),
            Tensor(f"blk.{i}.attn_q.weight", (embd, embd), 8, b"", size=q8(embd, embd)),
            Tensor(f"blk.{i}.attn_k.weight", (embd, kv_width), 8, b"", size=q8(kv_width, embd)),
            Tensor(f"blk.{i}.attn_v.weight", (embd, kv_width), 8, b"", size=q8(kv_width, embd)),
            Tensor(f"blk.{i}.attn_output.weight", (embd, embd), 8, b"", size=q8(embd, embd)),
            Tensor(f"blk.{i}.ffn_norm.weight", (embd,), 0, b"", size=embd * 4),
            Tensor(f"blk.{i}.ffn_gate.weight", (embd, ff), 8, b"", size=q8(ff, embd)),
            Tensor(f"blk.{i}.ffn_up.weight", (embd, ff), 8, b"", size=q8(ff, embd)),
            Tensor(f"blk.{i}.ffn_down.weight", (ff, embd), 8, b"", size=q8(embd, ff)),
        ]
    return replace(g, tensors=tensors).write(tmp_path / "seven-b.gguf")


def test_a_7b_header_says_what_a_32k_window_costs(tmp_path: Path) -> None:
    path = str(_seven_b(tmp_path))
    # From the dimensions, independently of modeld's code: K and V, 32 layers x 8 KV heads x 128, f16.
    per_token = 2 * 32 * 8 * 128 * 2
    assert per_token == 128 << 10
    window = 32768
    budget = 64 << 30
    for unified, layout, kv_cells in ((True, f"unified/4:{window}", window), (False, "split/4", 4 * window)):
        residency = Residency(kv_unified=unified, memory_budget_bytes=budget)
        with Engine(backends=("llama",), residency=residency) as engine:
            info = engine.describe(_request(path, num_ctx=window, num_batch=512))
        fp = info.footprint
        assert (info.kv_bytes_per_token, fp.trained_window, fp.trained_kv_bytes) == (
            per_token,
            window,
            4 << 30,
        )
        assert (fp.layout, fp.kv_bytes) == (layout, kv_cells * per_token)  # 4 GiB unified, 16 GiB split
        # 6.98B parameters at 34 bytes per 32: what the tensor table says, hole or not.
        assert 7.3e9 < fp.weights_bytes < 7.5e9
        # Flash attention off: llama.cpp's attention scores and mask for 512 tokens over every cell.
        assert fp.compute_bytes >= 512 * window * (32 + 1) * 4  # 2.06 GiB: more than half the KV
        assert fp.total_bytes == fp.weights_bytes + fp.kv_bytes + fp.compute_bytes + MODEL_OVERHEAD_BYTES
        assert fp.max_window == window and info.effective_context == window


def test_the_budget_decides_the_largest_window(tmp_path: Path) -> None:
    path = str(_seven_b(tmp_path))
    budget = 12 << 30
    with Engine(backends=("llama",), residency=Residency(memory_budget_bytes=budget)) as engine:
        info = engine.describe(_request(path, num_ctx=32768, num_batch=512))
        fa = engine.describe(_request(path, num_ctx=32768, num_batch=512, flash_attn=True))
    fp = info.footprint

    def total(window: int) -> int:
        return (
            fp.weights_bytes
            + window * fp.kv_bytes_per_token
            + compute_bytes(fp, window)
            + MODEL_OVERHEAD_BYTES
        )

    assert 0 < fp.max_window < 32768 and fp.max_window % CELL_PAD == 0
    assert total(fp.max_window) <= budget < total(fp.max_window + CELL_PAD)
    assert info.effective_context == fp.max_window == fp.window  # the context is capped by the budget
    assert fp.total_bytes <= budget
    # Flash attention keeps the compute buffer small: a larger window fits the same budget.
    assert fa.footprint.max_window > fp.max_window


@pytest.mark.llama
def test_a_session_that_leaves_the_batch_to_the_model_gets_48_on_attention_and_512_elsewhere() -> None:
    """``Config.num_batch`` 0 (the default): attention on the CPU without flash attention takes
    micro-batches of 48 tokens, so llama.cpp reserves the attention scores of 48 tokens over
    every cell, not 512 (10x less of the compute buffer that grows with the window); memory that
    cannot be cut (a checkpoint at batch starts) and flash attention (no scores kept) take 512.
    The session's runtime digest is over the concrete value."""
    tiny = str(testmodels.ensure_model(testmodels.TINY))
    hybrid = str(testmodels.ensure_model(testmodels.QWEN35))
    sliding = str(testmodels.ensure_model(testmodels.GEMMA3))
    with Engine(backends=("llama",), residency=Residency(sequences=2)) as engine:
        default = engine.describe(_request(tiny, num_ctx=8192))
        large = engine.describe(_request(tiny, num_ctx=8192, num_batch=512))
        assert default.footprint.micro_batch == 48 and large.footprint.micro_batch == 512
        assert engine.describe(_request(tiny, num_ctx=8192, flash_attn=True)).footprint.micro_batch == 512
        assert engine.describe(_request(tiny, num_ctx=8192, num_batch=200)).footprint.micro_batch == 200
        for path in (hybrid, sliding):
            assert engine.describe(_request(path, num_ctx=4096)).footprint.micro_batch == 512
        # What llama.cpp itself reserves at the default, against 512: the estimate holds, and
        # the scores over 8192 cells are a tenth.
        fp = default.footprint
        options = LoadOptions(
            n_seq=2, window=8192, pool_tokens=fp.kv_bytes // fp.kv_bytes_per_token, unified=True
        )
        figures = _loaded(_request(tiny, num_ctx=8192), default, options)
        assert figures.compute == pytest.approx(fp.compute_bytes / MIB, rel=0.05)
        assert (
            fp.compute_bytes - fp.compute_floor_bytes
            < (large.footprint.compute_bytes - fp.compute_floor_bytes) / 4
        )
        # Sessions: the default and an explicit 48 are one runtime; 512 is another.
        same = [
            engine.open_session(_request(tiny, num_ctx=2048, **batch)) for batch in ({}, {"num_batch": 48})
        ]
        other = engine.open_session(_request(tiny, num_ctx=2048, num_batch=512))
        assert (
            same[0].identity.runtime_digest
            == same[1].identity.runtime_digest
            != other.identity.runtime_digest
        )
        for session in (*same, other):
            session.close()
