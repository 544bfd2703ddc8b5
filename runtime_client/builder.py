"""The context builder: typed segments in; prefix text, suffix text and a manifest out.

A coding tool describes its prompt as segments (system prompt, tool definitions, repo rules,
repo map, pinned files, history; then the diff, terminal output and the user's turn). The
builder puts the stable segments first and the volatile ones last -- whatever order they were
added in -- so that everything that changes each turn sits after everything that does not,
which is what makes the prefix reusable. It records each segment's byte range and hash in a
:class:`~modeld.manifest.ContextManifest`; the daemon adds token ranges and token hashes.

Put nothing that changes every turn (a timestamp, a request id) into a stable segment: it
makes every turn cold from that byte on. ``modeld explain-context`` shows the segment where a
prefix first diverged when that happens, and a builder reused across turns notices it itself:
:attr:`BuiltContext.warnings` names a stable segment whose text changed on each of the last
:data:`CHURN_TURNS` builds.

Run-time metadata (the "BIOS" a worker prepends: platform instructions, the current date and
time, remaining budgets) goes through :meth:`ContextBuilder.runtime`: the instructions, which do
not change, become a stable ``system`` segment in the prefix; the values, which change every
turn, become a volatile ``runtime`` segment at the start of the suffix (role ``user``, so in
chat format it joins the user's turn). A timestamp then costs only its own tokens each turn.

Tool loops (:mod:`runtime_client.tools`) grow the conversation with :meth:`ContextBuilder.next_turn`:
the volatile segments (except run-time values) become history, then the assistant's turn and
the tool results are appended as history, so each round's prefix extends the last one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from modeld.context import CHURN_TURNS, Part, SegmentChurn, assemble
from modeld.contract import PrefixInput, SuffixInput
from modeld.errors import InvalidArgumentError
from modeld.manifest import (
    CACHE_CLASSES,
    DEFAULT_CACHE_CLASS,
    DEFAULT_ROLE,
    ROLES,
    SEGMENT_KINDS,
    STABLE_KINDS,
    ContextManifest,
    bytes_hash,
)

__all__ = ["CHURN_TURNS", "BuiltContext", "ContextBuilder"]


@dataclass(frozen=True, slots=True)
class BuiltContext:
    """What the builder produced: send ``prefix_input()`` then ``suffix_input()``."""

    prefix_text: str
    suffix_text: str
    manifest: ContextManifest
    tools_json: str = ""
    warnings: tuple[str, ...] = ()  # e.g. a stable segment that changes every turn

    def prefix_input(self) -> PrefixInput:
        return PrefixInput(text=self.prefix_text, manifest=self.manifest, tools_json=self.tools_json)

    def suffix_input(self) -> SuffixInput:
        return SuffixInput(text=self.suffix_text, manifest=self.manifest)


@dataclass(slots=True)
class _Part:
    kind: str
    text: str
    stable: bool
    cache_class: str
    role: str


@dataclass
class ContextBuilder:
    """Collects segments; :meth:`build` lays them out stable-first.

    ``identity`` (a session's ``identity``) fills in the manifest's runtime fields so the daemon
    can check them; without it the daemon fills them in itself.
    """

    identity: ContextManifest | None = None
    profile_id: str = ""
    tools_json: str = ""
    _parts: list[_Part] = field(default_factory=list)
    _churn: SegmentChurn = field(default_factory=SegmentChurn, repr=False)

    def add(
        self, kind: str, text: str, *, stable: bool | None = None, cache_class: str = "", role: str = ""
    ) -> ContextBuilder:
        """Add a segment. ``role`` matters with prompt_format ``chat`` (default: by kind)."""
        if kind not in SEGMENT_KINDS:
            raise InvalidArgumentError(
                f"segment kind must be one of {', '.join(SEGMENT_KINDS)}, got {kind!r}", field="kind"
            )
        if cache_class and cache_class not in CACHE_CLASSES:
            raise InvalidArgumentError(
                f"cache_class must be one of {', '.join(CACHE_CLASSES)}, got {cache_class!r}",
                field="cache_class",
            )
        if role and role not in ROLES:
            raise InvalidArgumentError(f"role must be one of {', '.join(ROLES)}, got {role!r}", field="role")
        if not isinstance(text, str):
            raise InvalidArgumentError("segment text must be a string", field="text")
        self._parts.append(
            _Part(
                kind=kind,
                text=text,
                stable=kind in STABLE_KINDS if stable is None else stable,
                cache_class=cache_class or DEFAULT_CACHE_CLASS[kind],
                role=role,
            )
        )
        return self

    def system(self, text: str) -> ContextBuilder:
        return self.add("system", text)

    def tools(self, text: str) -> ContextBuilder:
        return self.add("tools", text)

    def repo_rules(self, text: str) -> ContextBuilder:
        return self.add("repo_rules", text)

    def repo_map(self, text: str) -> ContextBuilder:
        return self.add("repo_map", text)

    def pinned(self, text: str) -> ContextBuilder:
        return self.add("pinned", text)

    def history(self, text: str, role: str = "user") -> ContextBuilder:
        """An earlier turn; in chat format each history segment is one message of ``role``."""
        return self.add("history", text, role=role)

    def diff(self, text: str) -> ContextBuilder:
        return self.add("diff", text)

    def terminal(self, text: str) -> ContextBuilder:
        return self.add("terminal", text)

    def user_turn(self, text: str) -> ContextBuilder:
        return self.add("user_turn", text)

    def runtime(self, instructions: str, values: Mapping[str, str]) -> ContextBuilder:
        """Run-time metadata: ``instructions`` (stable: how to read the values) in the prefix, the
        ``values`` (date, time, budgets, ...) as a volatile segment. Replaces earlier values."""
        self._parts = [p for p in self._parts if p.kind != "runtime"]
        if instructions:
            self.add("system", instructions)
        lines = "".join(f"{k}: {v}\n" for k, v in values.items())
        if lines:
            self.add("runtime", "Run-time values:\n" + lines)
        return self

    def assistant(self, text: str) -> ContextBuilder:
        """An assistant turn in the history (e.g. the text and tool calls it generated)."""
        return self.add("history", text, role="assistant")

    def tool_result(self, text: str) -> ContextBuilder:
        """A tool's result in the history (role ``tool``)."""
        return self.add("history", text, role="tool")

    def copy(self) -> ContextBuilder:
        twin = ContextBuilder(identity=self.identity, profile_id=self.profile_id, tools_json=self.tools_json)
        twin._parts = [replace(p) for p in self._parts]
        twin._churn = self._churn.copy()
        return twin

    def next_turn(self) -> ContextBuilder:
        """The conversation so far, made stable: volatile segments (the user's turn, the diff, the
        terminal output) become history in their order; run-time values stay volatile."""
        stable = [p for p in self._parts if p.stable]
        moved = [
            _Part("history", p.text, True, "conversation", p.role or DEFAULT_ROLE[p.kind])
            for p in self._parts
            if not p.stable and p.kind != "runtime"
        ]
        runtime = [p for p in self._parts if not p.stable and p.kind == "runtime"]
        self._parts = stable + moved + runtime
        return self

    def build(self) -> BuiltContext:
        """Stable segments first (``modeld.context.assemble``); a stable segment whose text
        changed on each of the last CHURN_TURNS builds is named in ``warnings``."""
        laid = assemble(Part(p.kind, p.text, p.stable, p.cache_class, p.role) for p in self._parts)
        warnings = tuple(
            f"stable segment {c.kind!r} #{c.position} changed on each of the last {c.turns} turns: "
            "move what changes (a timestamp, an id) into the volatile suffix "
            "(ContextBuilder.runtime), or every turn is cold from there"
            for c in self._churn.observe(laid.segments)
        )
        base = self.identity if self.identity is not None else ContextManifest()
        manifest = replace(
            base,
            profile_id=self.profile_id,
            stable_bytes=laid.stable_bytes,
            total_bytes=laid.total_bytes,
            stable_byte_hash=bytes_hash(laid.prefix_text),
            stable_token_hash="",
            volatile_token_hash="",
            segments=laid.segments,
        )
        return BuiltContext(laid.prefix_text, laid.suffix_text, manifest, self.tools_json, warnings)
