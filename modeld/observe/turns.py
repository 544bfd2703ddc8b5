"""A session's turns as request records: what :class:`~modeld.observe.metrics.ObservedSession`
adds to a turn's record beside each metric it counts.

:class:`TurnRecorder` holds the record of the turn a session is running: one the transport
opened and handed over (:meth:`TurnRecorder.hand`: the HTTP runner, which finishes it after
the answer's last byte), else one opened at the turn's first operation and finished at the
decode's end (a gRPC session's turn). The observed session calls it with the very values it
counts into the Prometheus counters, at the same points, so a model's records sum to
``/metrics`` (``blueprints/0022-live-page.md``, "One truth").
"""

from __future__ import annotations

from modeld.contract import PrefillProgress, PrefixStatus, ProgressCallback, Usage
from modeld.observe.records import EXCERPT_BYTES, Recording, Records

__all__ = ["TurnRecorder"]


class TurnRecorder:
    """The running turn's record of one session (not for concurrent use, like the session)."""

    def __init__(
        self, records: Records | None, transport: str, job: str, session_id: str, model: str
    ) -> None:
        self.records = records
        self.transport = transport or "grpc"
        self.job = job
        self.session_id = session_id
        self.model = model
        self.current: Recording | None = None
        self._handed = False  # the current record was handed over for the next turn

    def hand(self, recording: Recording) -> None:
        """The record the next turn counts into (its transport finishes it too: the record is
        done when both have let it go)."""
        self.end("prefix")
        recording.hold()
        recording.set(session=self.session_id, model=self.model)
        self.current, self._handed = recording, True

    def let_go(self, recording: Recording) -> None:
        """The session has stopped working on ``recording``'s turn (the engine is idle): let it go
        if it still holds it (a turn abandoned before its decode ended)."""
        if self.current is recording:
            self.end("canceled")

    def start(self, *, new_turn: bool) -> None:
        """An operation begins: ``new_turn`` when it starts a turn (a record left open by a turn
        that put a prefix in place and decoded nothing is finished first)."""
        if new_turn and not self._handed:
            self.end("prefix")
        self._handed = False
        if self.current is None and self.records is not None:
            self.current = self.records.begin(
                self.transport,
                model=self.model,
                job=self.job,
                session=self.session_id,
                conversation=f"{self.transport}:{self.session_id}",
            )

    def end(self, finish: str, error: str = "", message: str = "") -> None:
        """Let go of the turn's record: one opened here is finished with ``finish`` (``error`` if an
        operation of the turn failed and nothing ended it otherwise); one handed over keeps the
        finish its transport gives it."""
        recording, self.current = self.current, None
        if recording is None:
            return
        if not error and finish in ("prefix", "canceled") and recording.get("error"):
            finish, error, message = "error", recording.get("error"), recording.get("error_message")
        values = {"error": error, "error_message": message} if error else {}
        if recording.external:
            recording.finish(stage="answer", **values)
        else:
            recording.finish(finish=finish, **values)

    def failed(self, exc: BaseException) -> None:
        """An operation raised (a ModeldError's stable reason, else ``internal``). A record opened
        here ends with it (a gRPC client's next call is a new turn); one handed over says so and
        goes on until its transport ends it (the HTTP runner may retry a decode one way or
        another, and answers with the error)."""
        reason = getattr(exc, "reason", "")
        message = getattr(exc, "message", "")
        if not (isinstance(reason, str) and reason and isinstance(message, str)):
            reason, message = "internal", ""
        if self.current is None:
            return
        if self.current.external:
            self.current.set(error=reason, error_message=message[:300])
        else:
            self.end("error", reason, message[:300])

    def progress(self, stage: str, callback: ProgressCallback | None) -> ProgressCallback | None:
        """``callback`` that also moves the record's progress bar."""
        recording = self.current
        if recording is None:
            return callback
        recording.set(stage=stage)

        def report(step: PrefillProgress) -> None:
            recording.set(progress_done=step.done, progress_total=step.total)
            if callback is not None:
                callback(step)

        return report

    def prefix(self, status: PrefixStatus, source: str, text: str) -> None:
        """A prefix was put in place: the counts the metrics took, and where it diverged."""
        recording = self.current
        if recording is None:
            return
        recording.add(
            prefix_tokens=status.prefix_tokens,
            prefilled_tokens=status.prefilled_tokens,
            **{f"reused_{source}": status.reused_tokens},
        )
        d = status.reuse
        excerpt = ""
        if recording.show_prompts and d.diverged_at_byte is not None:
            data, at = text.encode("utf-8", errors="replace"), d.diverged_at_byte
            excerpt = data[max(0, at - EXCERPT_BYTES // 3) : at + 2 * EXCERPT_BYTES // 3].decode(
                "utf-8", errors="replace"
            )
        recording.set(
            outcome=d.outcome,
            reason=d.reason,
            tier=d.tier,
            diverged_at_token=d.diverged_at_token,
            diverged_at_byte=d.diverged_at_byte,
            diverged_segment=d.diverged_segment,
            prefill_ms=status.prefill_ms,
            restore_ms=status.restore_ms,
            progress_done=0,
            progress_total=0,
            excerpt=excerpt,
        )

    def suffix(self, computed: int, restored: int) -> None:
        if self.current is not None:
            self.current.add(prefilled_tokens=computed, restored_tokens=restored)

    def between(self) -> None:
        """An operation of the turn returned: the turn waits for its client's next call."""
        if self.current is not None:
            self.current.set(stage="between calls")

    def decoding(self) -> None:
        """The decode started (a failed attempt before it, retried, is no error of the turn)."""
        if self.current is not None:
            self.current.set(stage="decode", progress_done=0, progress_total=0, error="", error_message="")

    def first_token(self, seconds: float) -> None:
        if self.current is not None and self.current.get("ttft_ms") is None:
            self.current.set(ttft_ms=round(seconds * 1000.0, 3))

    def finished(self, usage: Usage | None, *, further_choice: bool, extra: int) -> None:
        """A choice's final chunk: the counts the metrics took (``extra``: prompt tokens the
        decode itself recomputed)."""
        recording = self.current
        if recording is None:
            return
        if usage is None:
            recording.add(decodes=1)
        elif further_choice:
            recording.add(decodes=1, generated_tokens=usage.completion_tokens)
        else:
            recording.add(
                decodes=1,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                generated_tokens=usage.completion_tokens,
                draft_batches=usage.draft_batches,
                drafted_tokens=usage.drafted_tokens,
                accepted_tokens=usage.accepted_tokens,
                forced_tokens=usage.forced_tokens,
                prefilled_tokens=extra,
            )
            recording.set(prefill_ms=usage.prefill_ms, restore_ms=usage.restore_ms, decode_ms=usage.decode_ms)
