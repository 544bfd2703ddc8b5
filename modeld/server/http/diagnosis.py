"""Cache diagnosis on the wire: why a turn's prompt did not reuse an earlier request's prefix.

Anthropic (``diagnostics.previous_message_id``, beta ``cache-diagnosis-2026-04-07``) and OpenAI's
Responses API (``prompt_cache_options.comparison_response_id``) let a client name an earlier
response and ask where this request's prompt parted from that one's. modeld answers from the
same facts as ``modeld explain-context``, exact to the token: the engine's reuse decision for
the turn (:class:`~modeld.contract.ReuseDecision`: the first token that differed from what the
conversation's session held, which is the earlier request's prompt and its answer), placed in
the prompt by the engine itself (:class:`~modeld.contract.PrefixStatus` names the part, the
message and the warm context), so a turn makes no explain-context round trip.

:class:`Diagnoses` keeps a small fingerprint of every chat turn, by turn id (the model, the
session that served it, its prompt's length, its ``prompt_cache_key``), and which turn each
session served last. A comparison with turn ``P``:

* ``P`` unknown (never served here, or forgotten: the table keeps the last
  :data:`REMEMBERED_TURNS`): ``not_found``;
* another model: ``model`` (every token of ``P``'s prompt is missed);
* another ``prompt_cache_key`` (Responses): ``prompt_cache_key``;
* ``P`` was the last turn of the session serving this one, and the engine compared this
  prompt with that session's warm context (``P``'s prompt and answer), token by token. No difference inside ``P``'s prompt: ``none``;
  else the part holding the first differing token (``system``, ``tools`` or ``messages``), the
  tokens of ``P``'s prompt from there on (``missed_tokens``) and before it (``reusable_tokens``);
* otherwise (``P`` is another conversation's, or an older turn of this one, the session's
  state was lost, or another warm context shared a longer prefix): ``unavailable``: the engine
  compared with something else.

Each API words the result (``anthropic/diagnosis.py``, ``responses/diagnosis.py``); the
``X-Modeld-Prefix`` header (:func:`prefix_header`) carries the engine's own comparison on every
API, requested or not.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from modeld.contract import PrefixStatus
from modeld.server.http.requests import ident
from modeld.server.http.turn import Turn

__all__ = [
    "REMEMBERED_TURNS",
    "Diagnoses",
    "Diagnosis",
    "Divergence",
    "Fingerprint",
    "compared_turn",
    "divergence",
    "prefix_header",
]


REMEMBERED_TURNS = 4096
"""Turns whose fingerprint is kept (about 200 bytes each)."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a later comparison needs of a turn."""

    model: str
    session_id: str
    prompt_tokens: int
    cache_key: str  # the request's prompt_cache_key ("" when none)
    context: str = ""  # the session's warm context after the turn's prefix ("" when none)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The answer to "where did this prompt part from turn P's?".

    ``outcome``: ``none`` (no difference inside P's prompt), ``changed`` (``part`` says where:
    ``model``, ``prompt_cache_key``, ``system``, ``tools``, ``messages``), ``not_found``,
    ``unavailable``. ``missed_tokens``: P's prompt tokens from the first difference on (all of
    them for ``model`` and ``prompt_cache_key``); ``reusable_tokens``: those before it."""

    outcome: str
    part: str = ""
    missed_tokens: int = 0
    reusable_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where this turn's prompt parted from what its session held (the engine's comparison)."""

    token: int | None  # the first token that differed (None: none did)
    part: str = ""  # system, tools or messages
    segment: str = ""  # the manifest segment's label (its kind, or a whole message's role)
    message: int | None = None  # the message (index) holding it


NO_DIVERGENCE = Divergence(None)


def compared_turn(value: object, where: str, prefix: str) -> str:
    """The turn id an API's response id names (``msg_<turn id>``, ``resp_<turn id>``): an id that
    is not one of this daemon's is kept as it is, and is then not found."""
    given = ident(value, where)
    return given.removeprefix(prefix) if given.startswith(prefix) else given


def divergence(status: PrefixStatus) -> Divergence:
    """The engine's comparison of a turn's prefix with what was warm, placed in the prompt: the
    status carries the part and the message, so the turn asks the session nothing more."""
    token = status.reuse.diverged_at_token
    if token is None:
        return NO_DIVERGENCE
    return Divergence(
        token, status.diverged_part, status.reuse.diverged_segment, status.diverged_segment_index
    )


def prefix_header(status: PrefixStatus, where: Divergence) -> str:
    """The ``X-Modeld-Prefix`` header: how much of the prefix was reused and, when it parted from
    what was warm, the first differing token, its part, segment and message."""
    reuse = status.reuse
    parts = [
        f"reused={status.reused_tokens}",
        f"prefix={status.prefix_tokens}",
        f"outcome={reuse.outcome}",
        f"reason={reuse.reason}",
    ]
    if where.token is not None:
        parts.append(f"diverged-token={where.token}")
        if where.part:
            parts.append(f"diverged-part={where.part}")
        if where.segment:
            parts.append(f"diverged-segment={where.segment}")
        if where.message is not None:
            parts.append(f"diverged-message={where.message}")
    return "; ".join(parts)


class Diagnoses:
    """The fingerprints of recent turns and each session's last turn (thread-safe)."""

    def __init__(self, capacity: int = REMEMBERED_TURNS) -> None:
        self.capacity = capacity
        self._turns: OrderedDict[str, Fingerprint] = OrderedDict()
        self._last: OrderedDict[str, str] = OrderedDict()  # session id -> its last turn's id
        self._lock = threading.Lock()

    def record(self, turn_id: str, print_: Fingerprint) -> None:
        """Turn ``turn_id`` finished on ``print_.session_id``."""
        with self._lock:
            self._turns[turn_id] = print_
            self._turns.move_to_end(turn_id)
            self._last[print_.session_id] = turn_id
            self._last.move_to_end(print_.session_id)
            while len(self._turns) > self.capacity:
                self._turns.popitem(last=False)
            while len(self._last) > self.capacity:
                self._last.popitem(last=False)

    def last_turn(self, session_id: str) -> str | None:
        with self._lock:
            return self._last.get(session_id)

    def of_prompt(
        self, turn: Turn, session_id: str, status: PrefixStatus, prompt: int
    ) -> tuple[Divergence, Diagnosis | None, Fingerprint]:
        """Where ``turn``'s prompt (``prompt`` tokens, served by ``session_id`` with ``status``)
        parted from the session's warm context, the comparison the turn asked for (if any), and
        the fingerprint a later turn compares with, all from ``status`` (no round trip: the
        engine placed the divergence and named the warm context)."""
        where = divergence(status) if turn.chat else NO_DIVERGENCE
        diagnosis = (
            self.of_turn(turn, session_id, status, where) if turn.chat and turn.compare is not None else None
        )
        print_ = Fingerprint(turn.model, session_id, prompt, turn.keys.prompt_cache_key, status.context_id)
        return where, diagnosis, print_

    def of_turn(self, turn: Turn, session_id: str, status: PrefixStatus, where: Divergence) -> Diagnosis:
        """The comparison ``turn`` asked for (``Turn.compare``; "" names no turn yet: nothing to
        compare), on the session that served it."""
        if not turn.compare:
            return Diagnosis("none")
        return self.diagnose(
            turn.compare,
            model=turn.model,
            session_id=session_id,
            cache_key=turn.keys.prompt_cache_key,
            last_turn=self.last_turn(session_id),
            status=status,
            where=where,
        )

    def diagnose(
        self,
        previous: str,
        *,
        model: str,
        session_id: str,
        cache_key: str,
        last_turn: str | None,
        status: PrefixStatus,
        where: Divergence,
    ) -> Diagnosis:
        """This turn (``model``, served by ``session_id`` whose last turn before it was
        ``last_turn``, with the engine's ``status`` and ``where`` it diverged) against turn
        ``previous``."""
        with self._lock:
            before = self._turns.get(previous)
        if before is None:
            return Diagnosis("not_found")
        if before.model != model:
            return Diagnosis("changed", "model", before.prompt_tokens, 0)
        if before.cache_key != cache_key:
            return Diagnosis("changed", "prompt_cache_key", before.prompt_tokens, 0)
        # Another warm context in the pool served the turn (it shared a longer start): the
        # engine compared the prompt with that one, not with ``previous``. A snapshot restored
        # from a tier is named by its entry, not by the context it left, so it cannot be told
        # apart here and is taken as the session's own: the pool moves a session's idle state
        # out and back all the time, and calling that "unavailable" made the answer depend on
        # the pool's timing (a later fix: carry the entry's origin context in the decision).
        compared = status.reuse.context if status.reuse.tier == "kv" else ""
        elsewhere = bool(before.context and compared and compared != before.context)
        if (
            before.session_id != session_id
            or last_turn != previous
            or elsewhere
            or status.reuse.reason in _LOST
        ):
            return Diagnosis("unavailable")
        if where.token is None or where.token >= before.prompt_tokens:
            return Diagnosis("none", reusable_tokens=before.prompt_tokens)
        return Diagnosis("changed", where.part or "messages", before.prompt_tokens - where.token, where.token)


_LOST = frozenset({"evicted", "engine_reset", "snapshot_rejected", "manifest_changed", "model_changed"})
"""Reuse reasons that say the session's own state was not what the turn was compared with."""
