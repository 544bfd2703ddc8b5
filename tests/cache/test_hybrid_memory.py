"""Memory that cannot be cut at any token stays warm: the generated sliding-window, hybrid and
recurrent models (``modeld.testmodels.ARCH_SPECS``) on the real llama.cpp.

Each scenario runs on every class: gemma3 and gpt-oss (sliding window), lfm2 (short
convolutions), qwen35 (gated DeltaNet), granitehybrid (Mamba-2 beside attention), mamba2 (pure
recurrent). What they check, as the issue states it: warm equals fresh (greedy tokens and their
log-probabilities, bit for bit), an edit inside the prefix reuses what precedes it (back to the
last checkpoint at or before it), and a repeated prompt answers, the same as the first time.
Design record: ``blueprints/0016-warm-state.md``, "Checkpoints".
"""

from __future__ import annotations

import pytest
from greedy import greedy_logprobs

from modeld.backends.gguf_meta import GGUFInfo
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.settings import Residency

pytestmark = pytest.mark.llama

llama = pytest.importorskip("modeld.backends.llama")
testmodels = pytest.importorskip("modeld.testmodels")

SPECS = {spec.name: spec for spec in testmodels.ARCH_SPECS}

BASE = "".join(
    f"def handler_{i}(request):\n    value = compute({i}, request.body)\n    return respond(value)\n\n"
    for i in range(24)
)
"""About 700 tokens of code-like text (raw prompts: no turn starts, checkpoints by spacing)."""

BATCH = 16
"""Micro-batch of these tests: checkpoints every 64 tokens (4 batches)."""


def _request(path: str) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=path, config=Config(num_ctx=2048, num_batch=BATCH, num_threads=2)
    )


def _decode(session: object, n: int = 8) -> list[tuple[int, float]]:
    return greedy_logprobs(session, n)


def _fresh(path: str, prefix: str, suffix: str) -> list[tuple[int, float]]:
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(path))
        assert s.ensure_prefix(PrefixInput(text=prefix)).reuse.outcome == "cold"
        s.prefill_suffix(SuffixInput(text=suffix))
        return _decode(s)


@pytest.fixture(params=sorted(SPECS), scope="module")
def model(request: pytest.FixtureRequest) -> str:
    return str(testmodels.ensure_model(SPECS[request.param]))


EXPECTED = {
    "swa-gemma3": "sliding-window",
    "swa-gptoss": "sliding-window",
    "hybrid-lfm2": "hybrid",
    "hybrid-qwen35": "hybrid",
    "hybrid-granite": "hybrid",
    "recurrent-mamba2": "recurrent",
}


def _engine_sizes(runtime: object) -> tuple[int, int]:
    """What llama.cpp itself holds for one sequence: KV bytes per token (the growth of a
    sequence's whole state from 2 to 3 tokens, less its per-cell metadata) and the recurrent
    state (the partial state of a 1-token sequence, less that of an empty one, less metadata)."""
    from modeld.backends._llama_lib import bindings as L  # noqa: N812

    ctx, mem = runtime._ctx, runtime._mem  # type: ignore[attr-defined]
    sizes = []
    for n in (1, 2, 3):
        for _ in runtime.sync(0, 0, list(range(10, 10 + n))):  # type: ignore[attr-defined]
            pass
        sizes.append((L.llama_state_seq_get_size_ext(ctx, 0, 0), L.llama_state_seq_get_size_ext(ctx, 0, 1)))
    L.llama_memory_seq_rm(mem, 0, -1, -1)
    empty = L.llama_state_seq_get_size_ext(ctx, 0, 1)
    return sizes[2][0] - sizes[1][0], sizes[0][1] - empty


def test_describe_reads_what_the_engine_allocates(model: str) -> None:
    """describe's figures, read from the file before loading, are the engine's: its class
    (llama_model_is_recurrent / is_hybrid / n_swa, as the loaded layout reports it), the KV of
    the attention layers alone, the recurrent state; and the footprint counts the states and
    their checkpoints."""
    from modeld.backends.base import LoadOptions

    backend = llama.LlamaBackend()
    req = _request(model)
    info = backend.describe(req)
    fp = info.footprint
    runtime = backend.load(req, info, LoadOptions(n_seq=1, window=256, pool_tokens=256))
    try:
        kv, state = _engine_sizes(runtime)
        layout = runtime.layout
    finally:
        runtime.close()
    name = next(n for n, s in SPECS.items() if str(testmodels.ensure_model(s)) == model)
    assert fp.memory == layout.memory == EXPECTED[name]
    assert info.capabilities.truncation is False
    assert layout.can_truncate is False and layout.checkpoints is True
    # Per cell the state also stores its position and sequence ids (12 bytes a cache; gemma3
    # and gpt-oss have two caches, global and local); per recurrent layer 8 bytes.
    assert 0 <= kv - info.kv_bytes_per_token <= 24, (kv, info.kv_bytes_per_token)
    if fp.memory == "sliding-window":
        assert fp.state_bytes == 0  # its partial state is the window's KV, counted per token
    else:
        assert fp.state_bytes <= state <= fp.state_bytes + 8 * 8, (state, fp.state_bytes)
    with Engine(backends=("llama",), residency=Residency(sequences=2, checkpoints=3)) as engine:
        sized = engine.describe(req).footprint
    # A checkpoint is a recurrent state, or a sliding window's cells (at most its tokens' KV).
    each = fp.state_bytes or fp.sliding_window * info.kv_bytes_per_token
    assert each > 0 and sized.checkpoint_bytes == 2 * 3 * each
    assert sized.total_bytes == (
        sized.weights_bytes + sized.kv_bytes + sized.compute_bytes + sized.overhead_bytes
        + 2 * fp.state_bytes + sized.checkpoint_bytes
    )  # fmt: skip


def test_an_edit_inside_the_prefix_reuses_what_precedes_it_and_warm_equals_fresh(model: str) -> None:
    """Edit at ~60% of the prefix: the turn keeps the last checkpoint before the edit (at most
    4 batches back), names it, and its greedy tokens and log-probabilities are a fresh
    evaluation's."""
    edited = BASE.replace("handler_15(", "handler_15b(")
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(model))
        first = s.ensure_prefix(PrefixInput(text=BASE))
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        _decode(s)
        st = s.ensure_prefix(PrefixInput(text=edited))
        diverged = st.reuse.diverged_at_token
        assert diverged is not None and diverged > first.prefix_tokens // 2
        assert st.reuse.outcome == "partial", st.reuse
        assert diverged - 4 * BATCH <= st.reused_tokens <= diverged, st.reuse.message
        if st.reused_tokens < diverged:
            assert f"checkpoint at token {st.reused_tokens}" in st.reuse.message
        assert st.reused_tokens + st.prefilled_tokens == st.prefix_tokens
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        warm = _decode(s)
    assert warm == _fresh(model, edited, "fix it\n")


def test_a_repeated_prompt_answers_the_same_as_the_first_time(model: str) -> None:
    """The same prefix and suffix three times (a retry, a regeneration): every time an answer,
    and the same one."""
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(model))
        answers = []
        for _ in range(3):
            s.ensure_prefix(PrefixInput(text=BASE))
            s.prefill_suffix(SuffixInput(text="again\n"))
            answers.append(_decode(s))
        # The prefix alone, decoded twice (a completion sent twice): no suffix to evaluate.
        again = []
        for _ in range(2):
            s.ensure_prefix(PrefixInput(text=BASE + "again\n"))
            again.append(_decode(s))
    assert answers[0] == answers[1] == answers[2]
    assert again[0] == again[1]


def test_two_sessions_share_a_prefix_through_a_copy(model: str) -> None:
    """A second conversation with the same head copies the first's context and goes back to a
    checkpoint inside it: its output is a fresh evaluation's (split KV: exact by construction).
    A sliding window's copy between split streams holds only the last window (llama.cpp saves a
    sequence without its masked cells); its checkpoints travel with it and serve the cut."""
    other = BASE[: len(BASE) // 2] + "class Other:\n    pass\n"
    with Engine(backends=("llama",), residency=Residency(sequences=2, kv_unified=False)) as engine:
        a = engine.open_session(_request(model))
        a.ensure_prefix(PrefixInput(text=BASE))
        b = engine.open_session(_request(model))
        st = b.ensure_prefix(PrefixInput(text=other))
        assert st.reuse.outcome == "partial" and st.reused_tokens > 0, st.reuse
        assert f"checkpoint at token {st.reused_tokens}" in st.reuse.message
        b.prefill_suffix(SuffixInput(text="go\n"))
        warm = _decode(b)
    assert warm == _fresh(model, other, "go\n")


def test_speculation_is_off_and_says_why(model: str) -> None:
    """Rejected drafts are taken back by cutting the memory: a recurrent state cannot be cut,
    and a sliding-window model's verify batches round up to 0.03 of a logit from single steps
    (blueprint 0016): these models decode one token per step, and a request for speculation
    says why (describe's capabilities too)."""
    from modeld.errors import UnsupportedError

    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(model))
        assert s.info.capabilities.speculation == ("off",)
        s.ensure_prefix(PrefixInput(text=BASE))
        with pytest.raises(UnsupportedError, match="cannot be cut at any token"):
            s.decode(DecodeConfig(max_tokens=4, speculation="ngram"))
        # Unset, the daemon's default (ngram) falls back to one token per step.
        with s.decode(DecodeConfig(max_tokens=4)) as stream:
            assert len([t for c in stream for t in c.token_ids]) == 4
        assert s.explain_context().speculation == "off"


@pytest.mark.parametrize("name", ["hybrid-qwen35", "swa-gemma3"])
def test_agents_over_http_get_answers_to_repeats_and_reuse_before_an_edit(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The issue's symptoms, through the OpenAI SDK against a real daemon: the same completion
    three times answers three times (it used to answer 200, then 500: "cannot re-evaluate its
    last token"), the same each time; a chat whose system prompt changes in the middle (a repo
    map that changes) reuses what precedes the change."""
    import openai
    from daemon_proc import serve_http, stop

    path = str(testmodels.ensure_model(SPECS[name]))
    tmp = tmp_path_factory.mktemp("http")
    proc, record = serve_http(tmp, "--model", f"m={path}", "--num-ctx", "4096", backend="llama")
    client = openai.OpenAI(
        base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0, timeout=120
    )
    try:
        import httpx

        # What the model's memory is, truthful on both listings (read from the file's structure).
        listed = httpx.get(f"{record.http_endpoint}/v1/models", timeout=30).json()["data"][0]["modeld"]
        shown = httpx.post(f"{record.http_endpoint}/api/show", json={"model": "m"}, timeout=30).json()
        memory = EXPECTED[name]
        assert listed["footprint"]["memory"] == shown["model_info"]["modeld.memory"] == memory
        assert (listed["footprint"]["state_bytes"] > 0) is (memory != "sliding-window")
        texts = [
            client.completions.create(model="m", prompt=BASE, max_tokens=6, temperature=0).choices[0].text
            for _ in range(3)
        ]
        assert texts[0] == texts[1] == texts[2]

        def ask(repo_map: str) -> tuple[int, int]:
            messages = [
                {
                    "role": "system",
                    "content": f"You are a coding agent.\n{BASE}\nrepo map:\n{repo_map}\n{BASE}",
                },
                {"role": "user", "content": "Why does handler_3 fail?"},
            ]
            done = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
            assert done.usage is not None and done.usage.prompt_tokens_details is not None
            diverged = (done.model_extra or {}).get("modeld", {}).get("diverged_at_token") or 0
            return done.usage.prompt_tokens_details.cached_tokens or 0, diverged

        ask("src/app.py\n")
        cached, diverged = ask("src/app.py\nsrc/db.py\n")
        # Back to the last checkpoint before the edit: at most one batch (512 tokens) before it.
        assert diverged > 512 and diverged - 512 <= cached <= diverged, (cached, diverged)
    finally:
        client.close()
        stop(proc)


def test_arch_specs_are_checked_and_their_files_are_a_function_of_the_spec(tmp_path: object) -> None:
    """A spec that cannot describe a loadable model is refused by name; the file is a pure
    function of the spec (the cache names it by a digest of it)."""
    import hashlib
    from dataclasses import replace
    from pathlib import Path

    from modeld.testmodels._archs import write_arch

    with pytest.raises(ValueError, match="arch 'nope'"):
        testmodels.ArchSpec(name="x", arch="nope")
    with pytest.raises(ValueError, match="attention names layers"):
        testmodels.ArchSpec(name="x", arch="lfm2", layers=2, attention=(5,))
    spec = testmodels.MAMBA2
    assert replace(spec, seed=1).file_name != spec.file_name
    digests = []
    for i in range(2):
        path = Path(str(tmp_path)) / f"m{i}.gguf"
        write_arch(spec, path)
        digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert Path(testmodels.ensure_model(spec)).read_bytes() == (Path(str(tmp_path)) / "m0.gguf").read_bytes()


def _renamed(spec: object, arch: str, tmp: object, drop: tuple[str, ...] = (), **kvs: object) -> GGUFInfo:
    """A generated model's header under another architecture's name (its keys renamed):
    describe reads the structure, whatever the name (the engine's loader is not run)."""
    from pathlib import Path

    import gguf_craft as c

    from modeld.backends.gguf_meta import read_gguf

    base = c.load(Path(str(testmodels.ensure_model(spec))))
    old = next(kv.value for kv in base.kvs if kv.key == "general.architecture").decode()
    crafted = c.GGUF(
        kvs=[
            c.KV(kv.key.replace(f"{old}.", f"{arch}.", 1), kv.type, kv.value, kv.item)
            for kv in base.kvs
            if kv.key.replace(f"{old}.", "", 1) not in drop
        ],
        tensors=base.tensors,
        alignment=base.alignment,
    ).set("general.architecture", arch.encode(), c.STRING)
    for key, (kind, value) in kvs.items():  # type: ignore[misc]
        crafted = crafted.set(f"{arch}.{key}", value, kind)
    return read_gguf(str(crafted.write(Path(str(tmp)) / f"{arch}.gguf")))


def test_describe_classifies_other_architectures_by_their_structure(tmp_path: object) -> None:
    """The header shapes of architectures not generated here (Jamba and Nemotron-H: a per-layer
    head_count_kv of 0 beside Mamba keys; Falcon-H1: attention and Mamba in every layer;
    Qwen3-Next: full_attention_interval; LFM2-MoE: short convolutions; RWKV: a WKV state) are
    classified from their keys, never from a list of names."""
    import gguf_craft as c

    granite, qwen, lfm, mamba = (
        testmodels.GRANITE_HYBRID, testmodels.QWEN35, testmodels.LFM2, testmodels.MAMBA2,
    )  # fmt: skip
    for arch in ("jamba", "nemotron_h"):
        info = _renamed(granite, arch, tmp_path)
        assert (info.memory, info.recurrent_layers) == ("hybrid", 3)
        assert info.kv_heads == (0, 0, 2, 0)
    falcon = _renamed(granite, "falcon-h1", tmp_path, **{"attention.head_count_kv": (c.UINT32, 2)})
    assert (falcon.memory, falcon.recurrent_layers) == ("hybrid", 4)
    assert falcon.kv_heads == (2, 2, 2, 2)
    nextgen = _renamed(qwen, "qwen3next", tmp_path)
    assert (nextgen.memory, nextgen.recurrent_layers, nextgen.kv_heads) == ("hybrid", 3, (0, 0, 0, 2))
    moe = _renamed(lfm, "lfm2moe", tmp_path)
    assert (moe.memory, moe.recurrent_layers) == ("hybrid", 4)
    ssm = tuple(
        f"ssm.{k}" for k in ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count")
    )
    rwkv = _renamed(mamba, "rwkv6", tmp_path, drop=ssm, **{"wkv.head_size": (c.UINT32, 64)})
    assert (rwkv.memory, rwkv.recurrent_layers) == ("recurrent", 2)
    assert rwkv.state_bytes == 2 * (2 * 128 + 128 * 64) * 4


@pytest.mark.parametrize("name", ["hybrid-qwen35", "hybrid-lfm2", "recurrent-mamba2"])
def test_checkpoints_travel_with_their_context_across_a_restart_and_to_another_box(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A prefix written to disk (and through to the shared store) carries its checkpoints: after
    a restart, and on another daemon that shares only the store (a moved conversation), an edit
    inside it restores the snapshot and goes back to the checkpoint before the edit, and the
    answer is a fresh evaluation's."""
    path = str(testmodels.ensure_model(SPECS[name]))
    tmp = tmp_path_factory.mktemp("tiers")
    store = tmp / "store"

    def engine(data: str) -> Engine:
        residency = Residency(sequences=1, persist_min_tokens=64, shared_store=str(store))
        return Engine(backends=("llama",), residency=residency, data_dir=tmp / data)

    with engine("a") as a:
        s = a.open_session(_request(path))
        assert s.ensure_prefix(PrefixInput(text=BASE)).reuse.outcome == "cold"
        assert a.tiers is not None and a.tiers.flush(60)
    # A restart, then another box (each edit its own: the restarted daemon writes its turn
    # through to the store too).
    for data, tier, line in (("a", "disk", 15), ("b", "shared", 16)):
        edited = BASE.replace(f"handler_{line}(", f"handler_{line}b(")
        expected = _fresh(path, edited, "go\n")
        with engine(data) as e:
            s = e.open_session(_request(path))
            st = s.ensure_prefix(PrefixInput(text=edited))
            diverged = st.reuse.diverged_at_token or 0
            assert (st.reuse.outcome, st.reuse.tier) == ("partial", tier), st.reuse
            assert diverged - 4 * BATCH <= st.reused_tokens < diverged, st.reuse.message
            assert f"checkpoint at token {st.reused_tokens}" in st.reuse.message
            s.prefill_suffix(SuffixInput(text="go\n"))
            assert _decode(s) == expected


@pytest.mark.parametrize("name", ["hybrid-qwen35", "hybrid-granite", "recurrent-mamba2"])
def test_a_context_leaves_the_kv_whole_with_its_checkpoints(name: str) -> None:
    """A context that leaves the KV keeps every token, its suffix and decode too (blueprint 0016,
    "Where a context goes"); on recurrent and hybrid memory its checkpoints go with it, so the
    snapshot serves a turn that shares only its start: the session's next turn, an edit inside
    the prefix, restores it from the RAM tier, goes back to the checkpoint before the edit, and
    answers as a fresh evaluation."""
    path = str(testmodels.ensure_model(SPECS[name]))
    edited = BASE.replace("handler_15(", "handler_15b(")
    expected = _fresh(path, edited, "fix it\n")
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        a = engine.open_session(_request(path))
        prefix = a.ensure_prefix(PrefixInput(text=BASE)).prefix_tokens
        resident = a.prefill_suffix(SuffixInput(text="fix it\n")).resident_tokens
        decoded = len(_decode(a))
        b = engine.open_session(_request(path))  # the one sequence: a's context leaves the KV
        assert b.ensure_prefix(PrefixInput(text="class Other:\n    pass\n" * 40)).reuse.outcome == "cold"
        assert engine.tiers is not None
        held = [len(e.tokens) for e in engine.tiers.entries() if e.tier == "ram"]
        assert resident + decoded - 1 in held or resident + decoded in held, (held, prefix, resident, decoded)
        st = a.ensure_prefix(PrefixInput(text=edited))
        diverged = st.reuse.diverged_at_token or 0
        assert (st.reuse.outcome, st.reuse.tier) == ("partial", "ram"), st.reuse
        assert diverged - 4 * BATCH <= st.reused_tokens < diverged, st.reuse.message
        assert f"checkpoint at token {st.reused_tokens}" in st.reuse.message
        a.prefill_suffix(SuffixInput(text="fix it\n"))
        assert _decode(a) == expected
