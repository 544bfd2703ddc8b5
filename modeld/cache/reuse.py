"""Why a turn was warm, restored, partial or cold: the words ``explain-context`` shows people.

The cache chooses *what* to reuse (``modeld/cache/choice.py``: the candidate with the longest
common token prefix among the compatible warm contexts in the KV pool and the snapshots in the
RAM and disk tiers). This module turns that choice into a
:class:`~modeld.contract.ReuseDecision`; :func:`classify` is a pure function of its inputs, so
every reason a person can read is pinned by unit tests. :class:`RuntimeHistory` remembers the
runtime each model file was last warm under, for the ``model_changed`` and ``manifest_changed``
reasons.

Outcomes: ``warm`` when the candidate's whole prefix was kept (``full_match``, ``extended``, or
``restored_from_ram`` / ``restored_from_disk`` / ``restored_from_shared`` when it came back
from a tier or the shared store); ``partial`` when
the new prefix diverged from the candidate past the tokens every prefix of its format starts
with (``diverged``); ``cold`` when nothing was reused, or only those (a new conversation that
shares the chat template's head or the BOS token: ``diverged``, naming it), with the most useful
reason first: the engine lost its state (``engine_reset``),
the session's own warm context was evicted (``evicted``, naming where it went), a snapshot was
refused (``snapshot_rejected``), the model file holds another model now (``model_changed``), a
runtime field changed (``manifest_changed``), the memory
cannot be cut (``truncation_unsupported``), the text diverged at token 0, or nothing was warm
(``empty_cache``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from modeld.contract import ReuseDecision
from modeld.manifest import ContextManifest, Segment

__all__ = ["Candidate", "Loss", "RuntimeHistory", "classify", "common_prefix_len", "segment_at", "went_back"]

_CHUNK = 256
_SNAPSHOT_TIERS = ("ram", "disk", "shared")
"""Tiers a turn restores a snapshot from (``restored_from_<tier>``)."""


def common_prefix_len(a: Sequence[int] | str, b: Sequence[int] | str) -> int:
    """Length of the longest common prefix of two token lists or two texts (compares slices in
    chunks, so it runs at C speed)."""
    n = min(len(a), len(b))
    i = 0
    if (isinstance(a, list) and isinstance(b, list)) or (isinstance(a, str) and isinstance(b, str)):
        step = _CHUNK
        while step >= _CHUNK:  # grow the compared slice while it matches, shrink it when not
            while i + step <= n and a[i : i + step] == b[i : i + step]:
                i += step
                step = min(step * 2, 1 << 16)
            step //= 2
    while i < n and a[i] == b[i]:
        i += 1
    return i


def segment_at(manifest: ContextManifest, token: int) -> Segment | None:
    """The segment holding a token, once token ranges are known."""
    for seg in manifest.segments:
        if (
            seg.token_start is not None
            and seg.token_end is not None
            and seg.token_start <= token < seg.token_end
        ):
            return seg
    return None


@dataclass(frozen=True, slots=True)
class Candidate:
    """What a turn reused: ``tier`` is ``kv``, ``ram``, ``disk`` or ``shared``; ``own`` when it was the
    session's own warm context; ``prefix_tokens`` the candidate's stable prefix (keeping all of
    it is a warm hit); ``context`` its id for people."""

    tier: str
    context: str
    prefix_tokens: int
    own: bool = True


@dataclass(frozen=True, slots=True)
class Loss:
    """Why nothing better was available: the session's warm context was lost (``kind`` is
    ``engine_reset`` or ``evicted``, ``tier`` where an evicted one went), a snapshot was
    refused, or a runtime field changed."""

    kind: str = ""
    message: str = ""
    tier: str = ""


class RuntimeHistory:
    """The runtime each model file was last warm under (daemon-wide), so a cold turn names the
    runtime field that changed (``manifest_changed``) although each runtime config is a loaded
    model of its own, with a cache of its own. Keyed by (backend, path). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], ContextManifest] = {}

    def changed(self, key: tuple[str, str], manifest: ContextManifest) -> tuple[str, str, str] | None:
        """``(field, ours, theirs)`` when the file was last warm under another runtime."""
        with self._lock:
            last = self._last.get(key)
        if last is None:
            return None
        compat = last.compatible_runtime(manifest)
        return None if compat.ok else (compat.field, compat.ours, compat.theirs)

    def record(self, key: tuple[str, str], manifest: ContextManifest) -> None:
        """A prefix computed under ``manifest``'s runtime is now warm."""
        with self._lock:
            self._last[key] = manifest


def classify(
    *,
    wanted: int,
    keep: int,
    candidate: Candidate | None,
    manifest: ContextManifest,
    loss: Loss | None = None,
    changed: tuple[str, str, str] | None = None,
    truncation_blocked: bool = False,
    model_file: str = "",
    head: int = 0,
) -> ReuseDecision:
    """The decision for a turn that keeps ``keep`` of ``wanted`` tokens from ``candidate``.

    ``changed`` is ``(field, ours, theirs)`` when the only warm state of this model file was
    computed under another runtime (``model_changed`` when that field is the model digest: the
    file ``model_file`` names, shown as is, holds another model now); ``truncation_blocked``
    when a compatible context shared a prefix that the memory cannot be cut to. ``head``: how
    many of the prefix's first tokens every prefix of its format starts with, whatever its
    content (the chat template's head, a BOS token): a turn that shares no more than these with
    a warm context is a new conversation, cold, not a partial hit.
    """
    head_only = 0 < keep <= head and keep < wanted
    if candidate is not None and keep > 0 and not head_only:
        where = "" if candidate.own else f" (warm context {candidate.context})"
        if candidate.tier in _SNAPSHOT_TIERS:
            where = f" (restored from the {candidate.tier} tier)"
        if keep >= min(candidate.prefix_tokens, wanted):
            if candidate.tier in _SNAPSHOT_TIERS:
                reason = f"restored_from_{candidate.tier}"
            else:
                reason = "full_match" if keep == wanted else "extended"
            verb = "all" if keep == wanted else f"{keep} of"
            return ReuseDecision(
                outcome="warm",
                reason=reason,
                message=f"reused {verb} {wanted} tokens{where}",
                tier=candidate.tier,
                context=candidate.context,
            )
        seg = segment_at(manifest, keep)
        at = f" in segment {seg.label!r}" if seg is not None else ""
        return ReuseDecision(
            outcome="partial",
            reason="diverged",
            message=f"the prefix differs from the warm context at token {keep}{at}: reused {keep} of {wanted} tokens{where}",
            diverged_at_token=keep,
            diverged_segment=seg.label if seg is not None else "",
            tier=candidate.tier,
            context=candidate.context,
        )
    if loss is not None and loss.kind == "engine_reset":
        return _cold(
            "engine_reset", f"the engine's state was lost ({loss.message}): {_prefilled(wanted, keep)}"
        )
    if loss is not None and loss.kind == "evicted":
        return ReuseDecision(
            outcome="cold",
            reason="evicted",
            message=f"this session's warm context was evicted ({loss.message}): {_prefilled(wanted, keep)}",
            tier=loss.tier,
        )
    if loss is not None and loss.kind == "snapshot_rejected":
        return _cold(
            "snapshot_rejected",
            f"a snapshot of this context was refused and removed ({loss.message}): {_prefilled(wanted, keep)}",
        )
    if changed is not None and changed[0] == "model_digest" and model_file:
        _, ours, theirs = changed
        return ReuseDecision(
            outcome="cold",
            reason="model_changed",
            field="model_digest",
            message=(
                f"the model file {model_file} changed since its last warm context (digest "
                f"{ours[:12]} -> {theirs[:12]}): warm state of the old file is never reused, "
                f"prefilled all {wanted} tokens"
            ),
        )
    if changed is not None:
        name, ours, theirs = changed
        return ReuseDecision(
            outcome="cold",
            reason="manifest_changed",
            field=name,
            message=(
                f"manifest field {name!r} changed ({ours} -> {theirs}): resident KV is not "
                f"reusable, prefilled all {wanted} tokens"
            ),
        )
    if truncation_blocked:
        return _cold(
            "truncation_unsupported",
            "the model's memory cannot be cut inside a warm context (recurrent or sliding-window "
            f"memory): prefilled all {wanted} tokens",
        )
    if candidate is not None and head_only:
        what = "the chat template's head" if manifest.prompt_format == "chat" else "the BOS token"
        where = f"warm context {candidate.context}"
        if candidate.tier in ("ram", "disk"):
            where = f"a snapshot in the {candidate.tier} tier"
        seg = segment_at(manifest, keep)
        return ReuseDecision(
            outcome="cold",
            reason="diverged",
            message=(
                f"a new conversation: it shares only {what} (its first {keep} tokens, before any of "
                f"its text) with {where}: prefilled {wanted - keep} of {wanted} tokens"
            ),
            diverged_at_token=keep,
            diverged_segment=seg.label if seg is not None else "",
            tier=candidate.tier,
            context=candidate.context,
        )
    if candidate is not None:
        seg = segment_at(manifest, 0)
        at = f" in segment {seg.label!r}" if seg is not None else ""
        return ReuseDecision(
            outcome="cold",
            reason="diverged",
            message=f"the prefix differs from every warm context at token 0{at}: reused 0 of {wanted} tokens",
            diverged_at_token=0,
            diverged_segment=seg.label if seg is not None else "",
        )
    return _cold("empty_cache", f"nothing compatible was warm: prefilled all {wanted} tokens")


def went_back(decision: ReuseDecision, chosen: int, kept: int, wanted: int) -> ReuseDecision:
    """``decision`` for a turn that chose to keep ``chosen`` tokens of a warm context whose
    memory cannot be cut there: the engine went back to its last checkpoint at or before it, at
    ``kept`` (0: none), and evaluated the rest. The divergence stays where it was; the words
    name the checkpoint."""
    if kept <= 0:
        return replace(
            decision,
            outcome="cold",
            reason="truncation_unsupported",
            message=(
                f"the model's memory cannot be cut at token {chosen}: it holds no checkpoint of its state "
                f"before it (or its sliding window there is gone): prefilled all {wanted} tokens"
            ),
        )
    head = decision.message.split(": reused", 1)[0] if ": reused" in decision.message else ""
    note = (
        f"the model's memory cannot be cut at token {chosen}: restored its checkpoint at token {kept} "
        f"and recomputed the {chosen - kept} tokens after it; reused {kept} of {wanted} tokens"
    )
    return replace(decision, message=f"{head}; {note}" if head else note)


def _prefilled(wanted: int, keep: int) -> str:
    """What a cold turn computed: all of it, or all but the format's head (a turn that reused
    more is not cold)."""
    if keep <= 0:
        return f"prefilled all {wanted} tokens"
    return f"prefilled {wanted - keep} of {wanted} tokens (the first {keep} are the head every prefix of its format starts with)"


def _cold(reason: str, message: str) -> ReuseDecision:
    return ReuseDecision(outcome="cold", reason=reason, message=message)
