"""Prometheus metrics for the daemon, observed on the transport path both listeners share.

What: :class:`Metrics` owns a private ``prometheus_client`` registry (never the global one, no
multiprocess mode). :meth:`Metrics.observe` wraps a contract :class:`~modeld.contract.Session`
in :class:`ObservedSession`, which counts what the contract already reports (``PrefixStatus``,
``SuffixStatus``, the chunks and the final ``Usage``), so the gRPC servicer and the HTTP
endpoint count turns the same way. A collector reads ``DaemonStatus`` at scrape time for the
gauges. ``blueprints/0015-metrics.md`` is the design record; names follow vLLM's where the
meaning is the same, under a ``modeld_`` prefix (counters get ``_total`` on exposition):

==========================================  ==================================================
``modeld_prefix_cache_queries_total``       prompt-prefix tokens looked up (ensure_prefix)
``modeld_prefix_cache_hits_total{source}``  of those, tokens reused; ``source`` is where they
                                            came from: ``kv`` (resident), ``ram``, ``disk``,
                                            ``shared`` (the fleet's shared store)
``modeld_prompt_tokens_total``              prompt tokens of finished decodes (Usage)
``modeld_prompt_tokens_cached_total``       of those, not computed during their turn (Usage)
``modeld_prompt_tokens_prefilled_total``    prompt tokens computed (prefix, suffix, restores;
                                            a decode's own re-prefill as far as Usage shows it)
``modeld_generation_tokens_total``          tokens generated
``modeld_requests_total{finish_reason}``    decodes finished
``modeld_spec_decode_num_drafts_total``     verify batches that carried a draft (speculation,
                                            blueprint 0021; from Usage)
``modeld_spec_decode_num_draft_tokens_total``    tokens drafted from the context and verified
``modeld_spec_decode_num_accepted_tokens_total`` of those, the model's own choice (acceptance
                                            rate = accepted / draft tokens)
``modeld_spec_decode_num_forced_tokens_total``   tokens a constraint forced, appended unsampled
``modeld_time_to_first_token_seconds``      turn start (its first operation) to first token
``modeld_inter_token_latency_seconds``      between generated tokens
``modeld_queue_wait_seconds``               waits for a busy model, as the engine reports them
``modeld_worker_restarts_total``            engine worker restarts, as the engine reports them
==========================================  ==================================================

Read from ``DaemonStatus`` at scrape time (a collector; always current):

==========================================  ==================================================
``modeld_sessions_open``, ``modeld_models_loaded``, ``modeld_resident_tokens{model,backend}``
``modeld_worker_state{model,state}``        1 for the state each model's worker is in (loading,
                                            ready, busy, restarting, failed), else 0
``modeld_worker_rss_bytes{model}``          the worker process's resident memory
``modeld_slots{model}``, ``modeld_slots_busy{model}``, ``modeld_queue_length{model}``
``modeld_busy_tokens{model}``               resident tokens held by running operations (the
                                            rest give way); of ``modeld_kv_capacity_tokens``
``modeld_warm_contexts{model,tier}``        warm contexts of a loaded model, by tier
``modeld_warm_context_bytes{model,tier}``   their bytes (a shared prefix counted once)
``modeld_tier_bytes{tier}``, ``modeld_tier_entries{tier}``, ``modeld_tier_budget_bytes{tier}``
``modeld_evictions_total{model,to}``        warm contexts evicted from the KV pool, to ``ram``,
                                            ``disk`` or ``dropped`` (per loaded model: restart
                                            at 0 when a model is loaded again)
``modeld_snapshots_rejected_total{model}``  snapshots refused (corrupt, stale, refused by the engine)
``modeld_recomputed_tokens_total{model}``   prompt tokens a session had computed before and computed
                                            again (status's ``recomputed``)
``modeld_model_memory_bytes{model,part}``   a worker's memory by part: ``weights``, ``kv_allocated``,
                                            ``kv_used``, ``checkpoints``, ``compute``, ``runtime``, ``rss``
``modeld_memory_bytes{part}``               the daemon's ``own`` memory and ``ram_tier``; ``parts``
                                            (every part of the daemon and its workers, summed)
                                            and ``measured`` (their RSS), which agree within
                                            ``tolerance`` besides ``untouched_max`` (compute
                                            buffers not yet resident; blueprint 0016)
``modeld_shared_store_snapshots_total{event}``  what this daemon did with the shared store:
                                            written, restored, rejected, write_failed, gone
``modeld_shared_store_pending_writes``      snapshots on their way to the shared store: queued,
                                            or still being written to disk (a backlog; what a
                                            SIGKILL now would lose)
==========================================  ==================================================

Every per-model series carries ``model`` (the model's name, never a path, at most
:data:`MAX_MODELS` distinct values; beyond, ``other``; loaded models sharing a label are
summed). The engine reports queue waits and worker restarts through :class:`~modeld.observe.status.EngineObserver`
(the daemon subscribes :class:`Metrics` with ``Engine.add_observer``); an engine without a
queue or workers never calls it, and those series stay at zero.

What not: no per-session or per-conversation labels (unbounded), no timing inside the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

from modeld.contract import (
    Closing,
    ContextReport,
    DecodeConfig,
    DecodeStream,
    ModelInfo,
    PrefixInput,
    PrefixStatus,
    ProgressCallback,
    Session,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
)
from modeld.manifest import ContextManifest
from modeld.observe.records import Recording, Records
from modeld.observe.status import DaemonStatus
from modeld.observe.turns import TurnRecorder

__all__ = [
    "MAX_MODELS",
    "WORKER_STATES",
    "Metrics",
    "ObservedSession",
    "model_label",
    "source_of",
]

log = logging.getLogger("modeld.metrics")

MAX_MODELS = 32
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_SOURCES = {"restored_from_ram": "ram", "restored_from_disk": "disk", "restored_from_shared": "shared"}
_TIERS = ("ram", "disk", "shared")
WORKER_STATES = ("loading", "ready", "busy", "restarting", "failed")


def source_of(status: PrefixStatus) -> str:
    """Where a prefix's reused tokens came from: ``ram``, ``disk`` or ``shared`` when the engine
    restored a snapshot from that tier or the shared store (``restored_from_ram``/``_disk``/
    ``_shared``, or a partial reuse of a restored snapshot, whose ``tier`` says so), else ``kv``
    (they were resident)."""
    decision = status.reuse
    if decision.reason in _SOURCES:
        return _SOURCES[decision.reason]
    if decision.outcome != "cold" and decision.tier in _TIERS:
        return decision.tier
    return "kv"


def model_label(name: str) -> str:
    """A model name fit for a label: the last path component, at most 64 characters."""
    base = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] or "unnamed"
    return base[:64]


class Metrics:
    """The daemon's metrics registry; also the :class:`~modeld.observe.status.EngineObserver` sink."""

    def __init__(self, status: Callable[[], DaemonStatus] | None = None) -> None:
        # No *_created series: they double the output and nobody graphs them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name: str, documentation: str, *labels: str) -> Counter:
            return Counter(name, documentation, list(labels or ("model",)), registry=r)

        self.queries = counter(
            "modeld_prefix_cache_queries", "Prompt-prefix tokens looked up in the prefix cache."
        )
        self.hits = counter(
            "modeld_prefix_cache_hits",
            "Prompt-prefix tokens reused from the prefix cache, by where they came from (kv, ram, disk, shared).",
            "model",
            "source",
        )
        self.prompt = counter("modeld_prompt_tokens", "Prompt tokens of finished decodes.")
        self.cached = counter(
            "modeld_prompt_tokens_cached",
            "Prompt tokens of finished decodes that were not computed during their turn.",
        )
        self.prefilled = counter(
            "modeld_prompt_tokens_prefilled",
            "Prompt tokens computed (prefix, suffix, and prefix tokens restored after displacement).",
        )
        self.generated = counter("modeld_generation_tokens", "Tokens generated.")
        self.requests = counter(
            "modeld_requests", "Decodes finished, by finish reason.", "model", "finish_reason"
        )
        self.drafts = counter(
            "modeld_spec_decode_num_drafts",
            "Verify batches that carried a draft from the context (speculation).",
        )
        self.draft_tokens = counter(
            "modeld_spec_decode_num_draft_tokens", "Tokens drafted from the context and verified."
        )
        self.accepted_tokens = counter(
            "modeld_spec_decode_num_accepted_tokens",
            "Drafted tokens that were the model's own choice (each saved a decode step).",
        )
        self.forced_tokens = counter(
            "modeld_spec_decode_num_forced_tokens",
            "Tokens a constraint forced (its only continuation), appended without a decode step.",
        )
        self.ahead = counter(
            "modeld_prefills_ahead",
            "Prefills of a conversation's next prefix while its user reads (an answer without a tool "
            "call; --prefill-ahead), by outcome (done, failed).",
            "model",
            "outcome",
        )
        self.ahead_tokens = counter(
            "modeld_prefill_ahead_tokens",
            "Prompt tokens computed ahead of the turn that uses them (--prefill-ahead).",
        )
        self.reports = counter(
            "modeld_context_reports",
            "explain-context reports built (ExplainContext, a session stream's explain, the live page's "
            "waiting turns); a turn itself asks for none.",
        )
        self.ttft = Histogram(
            "modeld_time_to_first_token_seconds",
            "From a turn's first operation (ensure_prefix, prefill_suffix or decode) to its first token.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "modeld_inter_token_latency_seconds",
            "Time between generated tokens.",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "modeld_queue_wait_seconds",
            "Waits for a model busy with other sessions, as the engine reports them.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.restarts = Counter(
            "modeld_worker_restarts", "Engine worker restarts, as the engine reports them.", registry=r
        )
        self._labels: set[str] = set()
        self._lock = threading.Lock()
        if status is not None:
            r.register(_StatusCollector(status, self.label))

    # --- EngineObserver ---------------------------------------------------------------------

    def queue_waited(self, seconds: float) -> None:
        self.queue_wait.observe(max(0.0, seconds))

    def worker_restarted(self) -> None:
        self.restarts.inc()

    def model_state(self, model_name: str, state: str) -> None:
        """Nothing to count: the worker state gauge is read from the status at scrape time,
        which is always current (events may arrive after a newer state)."""
        del model_name, state

    # --- observing sessions ---------------------------------------------------------------

    def label(self, model_name: str) -> str:
        """The ``model`` label for a name, keeping at most MAX_MODELS distinct values."""
        label = model_label(model_name)
        with self._lock:
            if label in self._labels:
                return label
            if len(self._labels) >= MAX_MODELS:
                return "other"
            self._labels.add(label)
        return label

    def observe(
        self, session: Session, records: Records | None = None, transport: str = "", job: str = ""
    ) -> ObservedSession:
        """``session`` counted here, its turns recorded in ``records`` (blueprint 0022)."""
        return ObservedSession(session, self, records, transport, job)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition (and its media type) for an HTTP ``Accept`` header; text by default."""
        if not accept:
            return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class _StatusCollector:
    """Gauges read from the engine's status at scrape time."""

    def __init__(self, status: Callable[[], DaemonStatus], label: Callable[[str], str]) -> None:
        self._status = status
        self._label = label

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        try:
            status = self._status()
        except Exception:  # a scrape must never fail because the engine is shutting down
            log.debug("status unavailable for metrics", exc_info=True)
            return
        yield GaugeMetricFamily("modeld_sessions_open", "Open sessions.", value=status.sessions)
        yield GaugeMetricFamily("modeld_models_loaded", "Models loaded.", value=len(status.models))
        resident, busy_tokens, capacity = _Sums(), _Sums(), _Sums()
        state = _Sums()
        rss = _Sums()
        slots, busy, queued = _Sums(), _Sums(), _Sums()
        contexts, context_bytes = _Sums(), _Sums()
        evictions, rejected, recomputed = _Sums(), _Sums(), _Sums()
        memory = _Sums()
        for m in status.models:
            name = self._label(m.model_name)
            resident.add((name, m.backend), m.resident_tokens)
            mm = m.memory
            for part, value in (
                ("weights", mm.weights_bytes),
                ("kv_allocated", mm.kv_allocated_bytes),
                ("kv_used", mm.kv_used_bytes),
                ("checkpoints", mm.checkpoint_bytes),
                ("compute", mm.compute_bytes),
                ("runtime", mm.runtime_bytes),
                ("rss", mm.rss_bytes),
            ):
                memory.add((name, part), value)
            busy_tokens.add((name,), m.busy_tokens)
            capacity.add((name,), m.pool_tokens)
            slots.add((name,), m.slots)
            busy.add((name,), m.busy_slots)
            queued.add((name,), m.queued)
            worker = m.worker
            for each in WORKER_STATES:
                state.add((name, each), 1 if worker is not None and worker.state == each else 0)
            if worker is not None:
                rss.add((name,), worker.rss_bytes)
            for c in m.contexts:
                contexts.add((name, c.tier), 1)
                context_bytes.add((name, c.tier), c.bytes)
            for to in ("ram", "disk", "dropped"):
                evictions.add(
                    (name, to),
                    m.counters.get(f"evicted_to_{to}" if to != "dropped" else "evicted_dropped", 0),
                )
            rejected.add((name,), m.counters.get("snapshots_rejected", 0))
            recomputed.add((name,), m.counters.get("recomputed", 0))
        yield resident.gauge(
            "modeld_resident_tokens", "Tokens resident in a loaded model's KV.", ["model", "backend"]
        )
        yield busy_tokens.gauge(
            "modeld_busy_tokens",
            "Of the resident tokens, those held by running operations (the rest are idle warm "
            "contexts, which give way when a turn needs the cells).",
            ["model"],
        )
        yield capacity.gauge("modeld_kv_capacity_tokens", "KV cells of a loaded model's pool.", ["model"])
        yield state.gauge(
            "modeld_worker_state",
            "1 for the state a model's engine worker is in (loading, ready, busy, restarting, failed).",
            ["model", "state"],
        )
        yield rss.gauge("modeld_worker_rss_bytes", "Resident memory of a model's engine worker.", ["model"])
        yield memory.gauge(
            "modeld_model_memory_bytes",
            "Where a loaded model's worker memory goes (weights, kv_*, checkpoints, compute, runtime, rss).",
            ["model", "part"],
        )
        daemon = GaugeMetricFamily(
            "modeld_memory_bytes",
            "The daemon's own memory and RAM tier; every part summed and the measured RSS (parts, measured, "
            "tolerance).",
            labels=["part"],
        )
        d = status.memory
        for part, value in (
            ("own", d.own_bytes),
            ("ram_tier", d.ram_tier_bytes),
            ("parts", d.parts_bytes),
            ("measured", d.measured_bytes),
            ("tolerance", d.tolerance_bytes),
            ("untouched_max", d.untouched_max_bytes),
        ):
            daemon.add_metric([part], value)
        yield daemon
        yield slots.gauge("modeld_slots", "Operations a model runs at once.", ["model"])
        yield busy.gauge("modeld_slots_busy", "Slots running an operation.", ["model"])
        yield queued.gauge("modeld_queue_length", "Operations waiting for a slot.", ["model"])
        yield contexts.gauge(
            "modeld_warm_contexts", "Warm contexts of a loaded model, by tier.", ["model", "tier"]
        )
        yield context_bytes.gauge(
            "modeld_warm_context_bytes",
            "Bytes of a loaded model's warm contexts, by tier (a shared prefix counted once).",
            ["model", "tier"],
        )
        yield evictions.counter(
            "modeld_evictions",
            "Warm contexts evicted from the KV pool, by where they went (ram, disk, dropped).",
            ["model", "to"],
        )
        yield rejected.counter(
            "modeld_snapshots_rejected",
            "Snapshots refused (corrupt, stale, refused by the engine).",
            ["model"],
        )
        yield recomputed.counter(
            "modeld_recomputed_tokens",
            "Prompt tokens a session had in its warm context before and computed again (each such "
            "turn says where they went).",
            ["model"],
        )
        tiers = status.tiers
        if tiers is not None:
            tier_bytes = GaugeMetricFamily("modeld_tier_bytes", "Bytes held by a tier.", labels=["tier"])
            entries = GaugeMetricFamily("modeld_tier_entries", "Snapshots held by a tier.", labels=["tier"])
            budget = GaugeMetricFamily(
                "modeld_tier_budget_bytes", "A tier's byte budget (0: off).", labels=["tier"]
            )
            rows = [
                ("ram", tiers.ram_bytes, tiers.ram_entries, tiers.ram_budget),
                ("disk", tiers.disk_bytes, tiers.disk_entries, tiers.disk_budget),
            ]
            if tiers.shared_location:
                rows.append(("shared", tiers.shared_bytes, tiers.shared_entries, tiers.shared_budget))
            for tier, held, count, limit in rows:
                tier_bytes.add_metric([tier], held)
                entries.add_metric([tier], count)
                budget.add_metric([tier], limit)
            yield from (tier_bytes, entries, budget)
            if tiers.shared_location:
                shared = CounterMetricFamily(
                    "modeld_shared_store_snapshots",
                    "Snapshots this daemon wrote through to the shared store, restored from it, saw "
                    "refused there (corrupt, foreign: removed), failed to write, or found gone.",
                    labels=["event"],
                )
                for event, value in (
                    ("written", tiers.shared_written),
                    ("restored", tiers.shared_restored),
                    ("rejected", tiers.shared_rejected),
                    ("write_failed", tiers.shared_write_failures),
                    ("gone", tiers.shared_read_failures),
                ):
                    shared.add_metric([event], value)
                yield shared
                yield GaugeMetricFamily(
                    "modeld_shared_store_pending_writes",
                    "Snapshots on their way to the shared store: queued for it, or still being written to disk "
                    "before it (a backlog; what a SIGKILL now would lose).",
                    value=tiers.shared_pending,
                )


class _Sums:
    """Values by label tuple, summed (loaded models may share a label)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, ...], float] = {}

    def add(self, labels: tuple[str, ...], value: float) -> None:
        self.values[labels] = self.values.get(labels, 0) + value

    def gauge(self, name: str, documentation: str, labels: list[str]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=labels)
        for key, value in self.values.items():
            family.add_metric(list(key), value)
        return family

    def counter(self, name: str, documentation: str, labels: list[str]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=labels)
        for key, value in self.values.items():
            family.add_metric(list(key), value)
        return family


class ObservedSession(Closing):
    """A Session that counts what passes through it; otherwise the session it wraps.

    Not for concurrent use (like every Session). A turn starts with the first operation after
    the previous decode and ends with the next decode's final chunk; a decode abandoned before
    its final chunk was read is not counted. Each turn's request record
    (:class:`~modeld.observe.turns.TurnRecorder`) gets the same numbers beside each count.
    """

    def __init__(
        self,
        inner: Session,
        metrics: Metrics,
        records: Records | None = None,
        transport: str = "",
        job: str = "",
    ) -> None:
        self.inner = inner
        self._m = metrics
        self._model = metrics.label(inner.info.model_name)
        self._turn_started: float | None = None
        self._turn_computed = 0  # tokens of this turn counted as prefilled or generated
        self.turn = TurnRecorder(records, transport, job, inner.session_id, self._model)

    def record(self, recording: Recording) -> None:
        """The request record the next turn counts into (the transport that opened it finishes it)."""
        self.turn.hand(recording)

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    @property
    def info(self) -> ModelInfo:
        return self.inner.info

    @property
    def identity(self) -> ContextManifest:
        return self.inner.identity

    def _start(self) -> None:
        self.turn.start(new_turn=self._turn_started is None)
        if self._turn_started is None:
            self._turn_started = time.perf_counter()

    def ensure_prefix(self, prefix: PrefixInput, progress: ProgressCallback | None = None) -> PrefixStatus:
        self.turn.start(new_turn=True)
        self._turn_started = time.perf_counter()
        try:
            status = self.inner.ensure_prefix(prefix, self.turn.progress("prefix", progress))
        except BaseException as exc:
            self.turn.failed(exc)
            raise
        m = self._model
        source = source_of(status)
        self._m.queries.labels(m).inc(status.prefix_tokens)
        self._m.hits.labels(m, source).inc(status.reused_tokens)
        self._m.prefilled.labels(m).inc(status.prefilled_tokens)
        self.turn.prefix(status, source, prefix.text)
        self.turn.between()
        self._turn_computed = status.prefilled_tokens
        return status

    def prefill_suffix(self, suffix: SuffixInput, progress: ProgressCallback | None = None) -> SuffixStatus:
        self._start()
        try:
            status = self.inner.prefill_suffix(suffix, self.turn.progress("suffix", progress))
        except BaseException as exc:
            self.turn.failed(exc)
            raise
        # A suffix the last turn already computed is reused (status.reused_tokens), not computed.
        computed = max(0, status.suffix_tokens - status.reused_tokens) + status.restored_tokens
        self._m.prefilled.labels(self._model).inc(computed)
        self.turn.suffix(computed, status.restored_tokens)
        self.turn.between()
        self._turn_computed += computed
        return status

    def decode(self, config: DecodeConfig) -> DecodeStream:
        self._start()
        started = self._turn_started if self._turn_started is not None else time.perf_counter()
        self.turn.decoding()
        try:
            inner = self.inner.decode(config)
        except BaseException as exc:
            self.turn.failed(exc)
            raise
        return _ObservedStream(self, inner, started, max(1, config.n))

    def _finished(self, chunk: StreamChunk) -> None:
        m = self._model
        self._m.requests.labels(m, chunk.finish_reason or "error").inc()
        usage = chunk.usage
        if usage is not None and chunk.choice > 0:  # a further choice of the same prompt (n > 1)
            self._m.generated.labels(m).inc(usage.completion_tokens)
            self._turn_computed += usage.completion_tokens
        elif usage is not None:
            self._m.prompt.labels(m).inc(usage.prompt_tokens)
            self._m.cached.labels(m).inc(usage.cached_tokens)
            self._m.generated.labels(m).inc(usage.completion_tokens)
            self._m.drafts.labels(m).inc(usage.draft_batches)
            self._m.draft_tokens.labels(m).inc(usage.drafted_tokens)
            self._m.accepted_tokens.labels(m).inc(usage.accepted_tokens)
            self._m.forced_tokens.labels(m).inc(usage.forced_tokens)
            # Prompt tokens the decode itself recomputed (another session displaced them).
            extra = max(0, usage.prompt_tokens - usage.cached_tokens - self._turn_computed)
            if extra:
                self._m.prefilled.labels(m).inc(extra)
            self._turn_computed += extra + usage.completion_tokens
        further = usage is not None and chunk.choice > 0
        self.turn.finished(usage, further_choice=further, extra=0 if further or usage is None else extra)
        self._turn_started = None

    def explain_context(self) -> ContextReport:
        report = self.inner.explain_context()
        self._m.reports.labels(self._model).inc()
        return report

    def close(self) -> None:
        self.turn.end("prefix")
        self.inner.close()


class _ObservedStream(Closing):
    """A decode stream that times tokens and reports the final chunk to its session (and, when
    every choice ended or it was abandoned, ends the turn's record)."""

    def __init__(
        self, session: ObservedSession, inner: DecodeStream, started: float, choices: int = 1
    ) -> None:
        self._session = session
        self._inner = inner
        self._started = started
        self._last: float | None = None
        self._done: set[int] = set()
        self._choices = choices
        self._ended = False

    def __iter__(self) -> _ObservedStream:
        return self

    def __next__(self) -> StreamChunk:
        chunk = next(self._inner)
        if chunk.token_ids:
            now = time.perf_counter()
            model = self._session._model
            metrics = self._session._m
            if self._last is None:
                metrics.ttft.labels(model).observe(now - self._started)
                self._session.turn.first_token(now - self._started)
            else:  # a chunk holds the tokens generated since the last one (whole characters)
                gap = (now - self._last) / len(chunk.token_ids)
                for _ in chunk.token_ids:
                    metrics.itl.labels(model).observe(gap)
            self._last = now
        if chunk.final and chunk.choice not in self._done:  # each choice ends once (n > 1)
            self._done.add(chunk.choice)
            self._session._finished(chunk)
            failed = chunk.finish_reason == "error"
            if (failed or len(self._done) >= self._choices) and not self._ended:
                self._ended = True
                error = chunk.error if failed else None
                self._session.turn.end(
                    chunk.finish_reason or "error",
                    (error.reason if error is not None else "internal") if failed else "",
                    error.message[:300] if error is not None else "",
                )
        return chunk

    def cancel(self) -> None:
        self._inner.cancel()

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            if not self._ended:  # abandoned before its final chunk
                self._ended = True
                self._session.turn.end("canceled", "canceled", "the stream was closed before its end")
