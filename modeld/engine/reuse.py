"""Deciding how much resident KV to keep: the one place where reuse is decided.

:func:`plan_reuse` is a pure function of what is resident (tokens, the manifest they were
computed under, how long that context's prefix was) and what is wanted (tokens, manifest). It
keeps the longest common token prefix when, and only when, the manifests are runtime-compatible
and the engine can cut its memory there; otherwise it keeps nothing and says why. Its answer
is the :class:`~modeld.contract.ReuseDecision` that ``explain-context`` shows to people.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modeld.contract import ReuseDecision
from modeld.manifest import ContextManifest, Segment

__all__ = ["ReusePlan", "common_prefix_len", "plan_reuse", "segment_at"]

_CHUNK = 256


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (compares slices in chunks, so it runs at C speed)."""
    n = min(len(a), len(b))
    i = 0
    if isinstance(a, list) and isinstance(b, list):
        while i + _CHUNK <= n and a[i : i + _CHUNK] == b[i : i + _CHUNK]:
            i += _CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """Keep the first ``keep`` resident tokens; evaluate ``target[keep:]``."""

    keep: int
    decision: ReuseDecision


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


def plan_reuse(
    *,
    resident: Sequence[int],
    resident_manifest: ContextManifest | None,
    resident_prefix_tokens: int,
    target: Sequence[int],
    manifest: ContextManifest,
    can_truncate: bool,
    reset_reason: str = "",
    last_manifest: ContextManifest | None = None,
) -> ReusePlan:
    """How much of ``resident`` to keep so that the KV becomes ``target``.

    ``resident_prefix_tokens`` is the length of the prefix part of the resident context (what
    its last ensure_prefix made resident); keeping all of it is a warm hit. ``last_manifest`` is
    the manifest last used with this model file by any loaded model (so that a replaced file or
    a changed runtime shows as ``manifest_changed`` rather than an anonymous empty cache).
    """
    wanted = len(target)
    if not resident or resident_manifest is None:
        if reset_reason:
            return _cold(wanted, reset_reason, f"the engine's state was reset ({reset_reason})")
        if last_manifest is not None:
            compat = last_manifest.compatible_runtime(manifest)
            if not compat.ok:
                return _changed(wanted, compat.field, compat.ours, compat.theirs)
        return _cold(wanted, "empty_cache", f"nothing was resident: prefilled all {wanted} tokens")
    compat = resident_manifest.compatible_runtime(manifest)
    if not compat.ok:
        return _changed(wanted, compat.field, compat.ours, compat.theirs)
    keep = common_prefix_len(resident, target)
    if keep < len(resident) and not can_truncate and keep > 0:
        return _cold(
            wanted,
            "truncation_unsupported",
            f"the model's memory cannot be cut at token {keep} (recurrent or sliding-window "
            f"memory): prefilled all {wanted} tokens",
        )
    if keep >= min(resident_prefix_tokens, wanted) and keep > 0:
        reason = "full_match" if keep == wanted else "extended"
        verb = "all" if keep == wanted else f"{keep} of"
        return ReusePlan(
            keep,
            ReuseDecision(
                outcome="warm",
                reason=reason,
                message=f"reused {verb} {wanted} tokens",
            ),
        )
    seg = segment_at(manifest, keep)
    where = f" in segment {seg.kind!r}" if seg is not None else ""
    return ReusePlan(
        keep,
        ReuseDecision(
            outcome="partial" if keep > 0 else "cold",
            reason="diverged",
            message=(
                f"the prefix differs from the resident context at token {keep}{where}: "
                f"reused {keep} of {wanted} tokens"
            ),
            diverged_at_token=keep,
            diverged_segment=seg.kind if seg is not None else "",
        ),
    )


def _cold(wanted: int, reason: str, message: str) -> ReusePlan:
    return ReusePlan(0, ReuseDecision(outcome="cold", reason=reason, message=message))


def _changed(wanted: int, field: str, ours: str, theirs: str) -> ReusePlan:
    return ReusePlan(
        0,
        ReuseDecision(
            outcome="cold",
            reason="manifest_changed",
            field=field,
            message=(
                f"manifest field {field!r} changed ({ours} -> {theirs}): resident KV is not "
                f"reusable, prefilled all {wanted} tokens"
            ),
        ),
    )
