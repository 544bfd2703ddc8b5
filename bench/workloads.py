"""Deterministic coding-session prompts sized in the model's own tokens.

A workspace is what a coding tool keeps stable: a system prompt, tool definitions, repo rules,
a repo map and pinned files. A turn adds a suffix: a diff, test output and the user's question.
Everything is generated from a seed (never from files that change), and sized with the model's
tokenizer, so every system sees the same text and the token counts are the model's own.

Segments end with a newline and the suffix starts with a letter, so the prefix/suffix junction
is a pre-tokenizer boundary: tokenizing prefix and suffix apart gives the same tokens as the
whole prompt (what the peer server does).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Turn", "Workload", "Workspace", "make_workloads"]

Tokenize = Callable[[str], int]

WORDS = (
    "config cache session prefix token lease socket request handler stream decode engine "
    "manifest segment worker batch window budget report digest owner fence retry timeout "
    "parser schema index vector buffer queue event signal client server record model"
).split()
SYSTEM = (
    "You are a careful senior software engineer working inside this repository. Read the "
    "repository map and the pinned files before answering. Answer with a unified diff that "
    "applies cleanly, then one short paragraph that explains the change. Never invent files, "
    "functions or test names that are not in the repository map. Keep functions small and typed.\n"
)
RULES = (
    "Repository rules:\n- Python 3.11, type hints everywhere, mypy strict.\n- Tests narrate the "
    "scenario and assert exact counts.\n- No print statements; use logging.\n- Public functions "
    "have docstrings that say what, why and what not.\n"
)


Segments = tuple[tuple[str, str], ...]
"""(kind, text) pairs, in order; their concatenation is the text."""


def _join(segments: Segments) -> str:
    return "".join(text for _, text in segments)


@dataclass(frozen=True)
class Turn:
    workspace: int
    segments: Segments
    suffix_tokens: int

    @property
    def suffix(self) -> str:
        return _join(self.segments)


@dataclass(frozen=True)
class Workspace:
    segments: Segments
    prefix_tokens: int

    @property
    def prefix(self) -> str:
        return _join(self.segments)


@dataclass
class Workload:
    name: str
    title: str
    workspaces: list[Workspace]
    turns: list[Turn]
    # turn index -> replacement prefix segments for that turn (edit-inside-prefix workload)
    prefix_per_turn: dict[int, Segments] = field(default_factory=dict)
    cold_turns: tuple[int, ...] = ()
    edit_token: int | None = None
    skip: tuple[str, ...] = ()  # systems not run on this workload (budget; the report says why)

    def prefix_segments(self, index: int) -> Segments:
        turn = self.turns[index]
        return self.prefix_per_turn.get(index, self.workspaces[turn.workspace].segments)

    def prefix_for(self, index: int) -> str:
        return _join(self.prefix_segments(index))


def _ident(rng: random.Random) -> str:
    return "_".join(rng.sample(WORDS, 2))


def _tools(rng: random.Random) -> str:
    tools = []
    for name in ("read_file", "search_code", "run_tests", "apply_patch", "list_directory", "git_diff"):
        params = {w: {"type": "string", "description": f"the {w} to use"} for w in rng.sample(WORDS, 3)}
        tools.append(
            {
                "name": name,
                "description": f"{name.replace('_', ' ')} in the workspace",
                "parameters": {"type": "object", "properties": params},
            }
        )
    return "Tools:\n" + json.dumps(tools, indent=1) + "\n"


def _python_file(rng: random.Random, functions: int) -> str:
    out = [f"# src/{_ident(rng)}.py\n", "from __future__ import annotations\n\n"]
    for _ in range(functions):
        name, arg = _ident(rng), rng.choice(WORDS)
        out.append(f"def {name}({arg}: str, limit: int = {rng.randint(1, 512)}) -> list[str]:\n")
        out.append(f'    """Return the {rng.choice(WORDS)} entries of {arg}, at most limit."""\n')
        out.append(f"    items = [x for x in {arg}.split() if x.startswith({rng.choice(WORDS)!r})]\n")
        out.append("    return items[:limit]\n\n")
    return "".join(out)


def _repo_line(rng: random.Random, index: int) -> str:
    symbols = ", ".join(f"{_ident(rng)}()" for _ in range(rng.randint(2, 5)))
    return f"src/{rng.choice(WORDS)}/{_ident(rng)}_{index}.py: {symbols}\n"


def _workspace_segments(head: tuple[str, str, str], lines: list[str], pinned: str) -> Segments:
    system, tools, rules = head
    return (
        ("system", system),
        ("tools", tools),
        ("repo_rules", rules),
        ("repo_map", "Repository map:\n" + "".join(lines)),
        ("pinned", pinned),
    )


def make_workspace(
    seed: int, target_tokens: int, tokenize: Tokenize, pinned_functions: tuple[int, int] = (4, 3)
) -> tuple[Workspace, list[str], tuple[str, str, str], str]:
    """A workspace whose prefix has about ``target_tokens`` tokens, and the parts it is made of."""
    rng = random.Random(seed)
    head = (SYSTEM, _tools(rng), RULES)
    pinned = (
        "Pinned files:\n" + _python_file(rng, pinned_functions[0]) + _python_file(rng, pinned_functions[1])
    )
    lines: list[str] = []
    while len(lines) < 10 or tokenize(_join(_workspace_segments(head, lines, pinned))) < target_tokens:
        lines.extend(_repo_line(rng, len(lines) + i) for i in range(8))
    while len(lines) > 10 and tokenize(_join(_workspace_segments(head, lines[:-1], pinned))) >= target_tokens:
        lines.pop()
    segments = _workspace_segments(head, lines, pinned)
    return Workspace(segments, tokenize(_join(segments))), lines, head, pinned


def make_suffix(seed: int, target_tokens: int, tokenize: Tokenize) -> tuple[Segments, int]:
    """A diff, test output and a question, about ``target_tokens`` tokens in all."""
    rng = random.Random(seed)
    diff = [f"Diff of src/{_ident(rng)}.py:\n--- a\n+++ b\n"]
    while tokenize("".join(diff)) < target_tokens * 0.6:
        diff.append(
            f"-    return {_ident(rng)}(items)\n+    return {_ident(rng)}(items, limit={rng.randint(1, 99)})\n"
        )
    test = ["Test output:\n"]
    while tokenize("".join(diff + test)) < target_tokens * 0.9:
        test.append(
            f"FAILED tests/test_{_ident(rng)}.py::test_{_ident(rng)} - AssertionError: {rng.randint(1, 9)} != {rng.randint(10, 99)}\n"
        )
    question = f"Question: why does test_{_ident(rng)} fail after this change, and what is the fix?\n"
    segments: Segments = (("diff", "".join(diff)), ("terminal", "".join(test)), ("user_turn", question))
    return segments, tokenize(_join(segments))


def make_workloads(tokenize: Tokenize, *, quick: bool) -> list[Workload]:
    """The four workloads of ``make bench`` (smaller sizes and fewer turns with ``quick``)."""
    small, large = (1500, 3000) if quick else (2000, 8000)
    loads: list[Workload] = []

    sizes_small = [64, 1024, 128, 512, 256, 768, 96, 384][: 3 if quick else 8]
    sizes_large = [64, 512, 256][: 2 if quick else 3]
    for target, sizes, name in ((small, sizes_small, "loop_small"), (large, sizes_large, "loop_large")):
        ws = make_workspace(1000 + target, target, tokenize)[0]
        turns = []
        for i, n in enumerate(sizes):
            segs, count = make_suffix(target * 10 + i, n, tokenize)
            turns.append(Turn(0, segs, count))
        loads.append(
            Workload(
                name,
                f"Coding loop, ~{ws.prefix_tokens}-token prefix, {len(turns)} turns, suffix 64-1024 tokens",
                [ws],
                turns,
                # loop_large: the limit's first turn is itself a cold prefill (a fresh context), so no
                # extra cold run is spent on it (each costs ~80 s on the realistic model). The peer
                # without its cache reuses exactly like peer+cache in a one-workspace loop (its own
                # in-context prefix reuse; loop_small shows both) and is skipped there to keep the
                # full run near 15 minutes.
                cold_turns=(1,) if quick or name == "loop_small" else (),
                skip=("peer",) if name == "loop_large" and not quick else (),
            )
        )

    # Edit inside the prefix: one repo-map line at ~60% of the map changes every turn.
    ws, lines, head, pinned = make_workspace(7, small, tokenize)
    at = int(len(lines) * 0.6)
    edit_token = tokenize("".join(head) + "Repository map:\n" + "".join(lines[:at]))
    edit_turns, prefixes = [], {}
    for i in range(3):
        changed = [*lines[:at], lines[at].rstrip("\n") + f", revision_{i}()\n", *lines[at + 1 :]]
        prefixes[i] = _workspace_segments(head, changed, pinned)
        segs, count = make_suffix(700 + i, 128, tokenize)
        edit_turns.append(Turn(0, segs, count))
    loads.append(
        Workload(
            "edit_prefix",
            f"Edit inside the prefix: one repo-map file changes at token ~{edit_token} of ~{ws.prefix_tokens}",
            [ws],
            edit_turns,
            prefix_per_turn=prefixes,
            cold_turns=(1,),
            edit_token=edit_token,
        )
    )

    # Three workspaces, served round-robin (a tool with sub-agents).
    spaces = [make_workspace(300 + k, small * 3 // 4, tokenize, pinned_functions=(2, 1))[0] for k in range(3)]
    rounds = 1 if quick else 2
    rr_turns = []
    for r in range(rounds):
        for k in range(3):
            segs, count = make_suffix(900 + r * 3 + k, 128, tokenize)
            rr_turns.append(Turn(k, segs, count))
    if quick:
        segs, count = make_suffix(999, 128, tokenize)
        rr_turns.append(Turn(0, segs, count))
    loads.append(
        Workload(
            "interleaved",
            f"Three workspaces (~{spaces[0].prefix_tokens} tokens each), round-robin, {len(rr_turns)} turns",
            spaces,
            rr_turns,
        )
    )
    return loads
