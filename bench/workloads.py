"""Coding-agent workloads: deterministic prompts sized in the model's own tokens.

A workspace is what a coding tool keeps stable: a system prompt, tool definitions, repo rules,
a repo map and pinned files. A turn adds a suffix: a diff, test output and the user's question,
or a tool result. Everything is generated from a seed (never from files that change) and sized
with the model's tokenizer, so every system sees the same text and the token counts are the
model's own.

Each turn carries its prompt as segments (what modeld's ContextBuilder gets) and as text (what
the HTTP servers get); their concatenation is the same string. Segments end with a newline and
a suffix starts with a letter, so the prefix/suffix junction is a pre-tokenizer boundary:
tokenizing prefix and suffix apart gives the same tokens as the whole prompt.

Each turn also knows what a *perfect* system would prefill: the prompt's tokens minus the longest
token prefix it shares with any earlier prompt of the workload (at least one token: the last
prompt token is evaluated for its logits). That is what an ideal cache of every earlier prompt
could reuse, and the number the report holds every system's ``prefilled`` against.

What not: no timing, no systems; see ``bench/runner.py``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["GOALS", "Turn", "Workload", "make_workloads", "workload_names"]

Tokenize = Callable[[str], list[int]]
Segments = tuple[tuple[str, str], ...]
"""(kind, text) pairs, in order; their concatenation is the text."""

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

# The goals the report holds each ratio against (issue 8 for the warm-state workloads, the
# engine's limit for the loops). "lower": the ratio must stay at or below; "higher": at or above.
GOALS: dict[str, tuple[str, float]] = {
    "modeld_over_limit": ("lower", 1.05),
    "modeld_over_llama_server": ("lower", 1.0),
    "modeld_over_lcp_server": ("lower", 1.0),
    "http_overhead_ms": ("lower", 5.0),
    "decode_over_limit": ("higher", 0.97),
    "restart_over_cold": ("lower", 0.05),
    "rss_over_llama_server": ("lower", 1.15),  # issue 22: peak RSS at the same warm capacity
    # issue 30: prompt tokens a session had computed before and modeld computed again (the
    # daemon's ``recomputed`` counter over the workload): an exact count, never noise
    "recomputed_tokens": ("lower", 0.0),
}


def _join(segments: Segments) -> str:
    return "".join(text for _, text in segments)


@dataclass(frozen=True)
class Turn:
    workspace: int
    prefix: Segments
    suffix: Segments
    prompt_tokens: int = 0  # BOS + prefix + suffix, the model's own count
    suffix_tokens: int = 0
    ideal_prefill: int = 0  # what a perfect system prefills (see the module docstring)
    wave: int = -1  # turns with the same wave >= 0, one after another in the list, run concurrently
    restart_before: bool = False  # every system restarts (state saved as it allows) before this turn

    @property
    def prefix_text(self) -> str:
        return _join(self.prefix)

    @property
    def suffix_text(self) -> str:
        return _join(self.suffix)


@dataclass
class Workload:
    name: str
    title: str
    limit: str  # what the limit is on this workload
    perfect: str  # what a perfect system would prefill, in words
    turns: list[Turn]
    workspaces: int = 1
    cold_turns: tuple[int, ...] = ()  # turns whose prompt is also measured cold (full prefill)
    continues: str = ""  # runs on the systems (and warm state) the named workload left behind
    pool_tokens: int = 0  # >0: the KV pool is this small (more workspaces than fit)
    goals: tuple[str, ...] = (
        "modeld_over_limit",
        "modeld_over_llama_server",
        "modeld_over_lcp_server",
        "decode_over_limit",
        "rss_over_llama_server",
        "recomputed_tokens",
    )
    fix: str = ""  # what would fix a loss here (the report quotes it beside a measured cause)
    # llama-server flags a well-informed user adds for this workload, with the reason
    llama_server_flags: tuple[str, ...] = ()
    llama_server_why: str = ""
    # Both systems at their own defaults (no bench tuning: llama-server without -np, --kv-unified,
    # --cache-ram, --cache-reuse, -fa off), the window alone given: what a new user gets.
    defaults: bool = False
    n_ctx: int = 0  # per-sequence context: the longest prompt + decode, rounded up
    notes: list[str] = field(default_factory=list)

    @property
    def warm(self) -> list[int]:
        """Turns whose workspace was seen before in this workload (or the one it continues)."""
        seen: set[int] = set(range(self.workspaces)) if self.continues else set()
        out = []
        for i, t in enumerate(self.turns):
            if t.workspace in seen:
                out.append(i)
            seen.add(t.workspace)
        return out

    def steps(self) -> list[list[int]]:
        """Turn indices grouped into steps: a wave of concurrent turns, or one turn."""
        out: list[list[int]] = []
        for i, t in enumerate(self.turns):
            if t.wave >= 0 and out and self.turns[out[-1][0]].wave == t.wave:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "title": self.title,
            "limit": self.limit,
            "perfect": self.perfect,
            "turns": len(self.turns),
            "workspaces": self.workspaces,
            "workspace_of_turn": [t.workspace for t in self.turns],
            "prompt_tokens": [t.prompt_tokens for t in self.turns],
            "suffix_tokens": [t.suffix_tokens for t in self.turns],
            "ideal_prefill": [t.ideal_prefill for t in self.turns],
            "waves": [t.wave for t in self.turns],
            "restart_before": [i for i, t in enumerate(self.turns) if t.restart_before],
            "warm": self.warm,
            "cold_turns": list(self.cold_turns),
            "continues": self.continues,
            "pool_tokens": self.pool_tokens,
            "goals": list(self.goals),
            "fix": self.fix,
            "llama_server_flags": list(self.llama_server_flags),
            "defaults": self.defaults,
            "n_ctx": self.n_ctx,
            "notes": self.notes,
        }


# --- text generators -------------------------------------------------------------------------


def _ident(rng: random.Random) -> str:
    return "_".join(rng.sample(WORDS, 2))


TOOL_NAMES = ("read_file", "search_code", "run_tests", "apply_patch", "list_directory", "git_diff")


def _tools_all(rng: random.Random, n: int = len(TOOL_NAMES)) -> str:
    tools = []
    for name in TOOL_NAMES[:n]:
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


def _segments(head: tuple[str, str, str], lines: list[str], pinned: str) -> Segments:
    system, tools, rules = head
    out: Segments = (
        ("system", system),
        ("tools", tools),
        ("repo_rules", rules),
        ("repo_map", "Repository map:\n" + "".join(lines)),
    )
    return (*out, ("pinned", pinned)) if pinned else out


def _fill_map(
    rng: random.Random, head: tuple[str, str, str], pinned: str, target: int, count: Callable[[str], int]
) -> list[str]:
    """Repo-map lines so that head + map + pinned has about ``target`` tokens."""
    lines: list[str] = []
    while len(lines) < 10 or count(_join(_segments(head, lines, pinned))) < target:
        lines.extend(_repo_line(rng, len(lines) + i) for i in range(8))
    while len(lines) > 10 and count(_join(_segments(head, lines[:-1], pinned))) >= target:
        lines.pop()
    return lines


def _pinned_all(rng: random.Random, functions: tuple[int, int]) -> str:
    parts = [_python_file(rng, n) for n in functions if n]
    return "Pinned files:\n" + "".join(parts)


def _pinned_sized(rng: random.Random, target: int, count: Callable[[str], int]) -> str:
    """Pinned files of about ``target`` tokens (a sub-agent's private tail)."""
    parts = ["Pinned files:\n"]
    while count("".join(parts)) < target:
        parts.append(_python_file(rng, 1))
    return "".join(parts)


def make_suffix(seed: int, target: int, count: Callable[[str], int]) -> Segments:
    """A diff, test output and a question, about ``target`` tokens in all."""
    rng = random.Random(seed)
    diff = [f"Diff of src/{_ident(rng)}.py:\n--- a\n+++ b\n"]
    while count("".join(diff)) < target * 0.6:
        diff.append(
            f"-    return {_ident(rng)}(items)\n+    return {_ident(rng)}(items, limit={rng.randint(1, 99)})\n"
        )
    test = ["Test output:\n"]
    while count("".join(diff + test)) < target * 0.9:
        test.append(
            f"FAILED tests/test_{_ident(rng)}.py::test_{_ident(rng)} - AssertionError: {rng.randint(1, 9)} != {rng.randint(10, 99)}\n"
        )
    question = f"Question: why does test_{_ident(rng)} fail after this change, and what is the fix?\n"
    return (("diff", "".join(diff)), ("terminal", "".join(test)), ("user_turn", question))


def _tool_result(seed: int, target: int, count: Callable[[str], int]) -> str:
    rng = random.Random(seed)
    lines = [f"Tool result ({rng.choice(['run_tests', 'read_file', 'search_code'])}):\n"]
    while count("".join(lines)) < target:
        lines.append(
            f"tests/test_{_ident(rng)}.py::test_{_ident(rng)} {rng.choice(['PASSED', 'FAILED'])} "
            f"[{rng.randint(1, 99)}%]\n"
        )
    return "".join(lines)


def _tool_call(seed: int) -> str:
    rng = random.Random(seed)
    call = {
        "name": rng.choice(["run_tests", "read_file", "search_code"]),
        "arguments": {"path": f"src/{_ident(rng)}.py"},
    }
    return f"Assistant tool call: {json.dumps(call)}\n"


# --- workloads -------------------------------------------------------------------------------


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _finish(
    load: Workload, tokenize: Tokenize, max_tokens: int, history: list[list[int]] | None = None
) -> None:
    """Fill in token counts, the perfect prefill per turn and the per-sequence n_ctx."""
    seen: list[list[int]] = list(history or [])
    turns = []
    longest = 0
    for t in load.turns:
        ids = [-1, *tokenize(t.prefix_text), *tokenize(t.suffix_text)]  # -1: the BOS token
        best = max((_lcp(ids, p) for p in seen), default=0)
        turns.append(
            Turn(
                t.workspace,
                t.prefix,
                t.suffix,
                len(ids),
                len(tokenize(t.suffix_text)),
                max(1, len(ids) - best),
                t.wave,
                t.restart_before,
            )
        )
        seen.append(ids)
        longest = max(longest, len(ids))
    load.turns = turns
    load.n_ctx = ((longest + max_tokens + 64) // 256 + 1) * 256


def make_workloads(tokenize: Tokenize, *, quick: bool, max_tokens: int) -> list[Workload]:
    """Every workload of ``make bench`` in run order (smaller sizes and fewer turns with ``quick``:
    one tool definition instead of six, one pinned function per file)."""

    def count(text: str) -> int:
        return len(tokenize(text))

    n_tools = 1 if quick else len(TOOL_NAMES)

    def tools(rng: random.Random) -> str:
        return _tools_all(rng, n_tools)

    def pinned_files(rng: random.Random, functions: tuple[int, int]) -> str:
        return _pinned_all(rng, (1, 0) if quick else functions)

    def workspace(
        seed: int, target: int, count: Callable[[str], int], pinned_fns: tuple[int, int] = (4, 3)
    ) -> Segments:
        rng = random.Random(seed)
        head = (SYSTEM, tools(rng), RULES)
        pinned = pinned_files(rng, pinned_fns)
        return _segments(head, _fill_map(rng, head, pinned, target, count), pinned)

    small, large = (500, 1000) if quick else (2000, 8000)
    loads: list[Workload] = []
    history: dict[str, list[list[int]]] = {}

    def add(load: Workload) -> None:
        _finish(load, tokenize, max_tokens, history.get(load.continues))
        history[load.name] = [
            *history.get(load.continues, []),
            *([-1, *tokenize(t.prefix_text + t.suffix_text)] for t in load.turns),
        ]
        loads.append(load)

    # 1. The coding loop: one workspace, a new diff/test output/question each turn.
    sizes_small = [64, 256, 128] if quick else [64, 1024, 128, 512, 256, 96]
    sizes_large = [64, 512, 256][: 2 if quick else 3]
    for target, sizes, name in ((small, sizes_small, "loop_small"), (large, sizes_large, "loop_large")):
        ws = workspace(1000 + target, target, count)
        add(
            Workload(
                name,
                f"Coding loop, ~{target}-token prefix, {len(sizes)} turns, suffix {min(sizes)}-{max(sizes)} tokens",
                "a hot llama.cpp context evaluating only the new suffix",
                "the suffix of each turn after the first (the prefix is unchanged)",
                [Turn(0, ws, make_suffix(target * 10 + i, n, count)) for i, n in enumerate(sizes)],
                # loop_large: the limit's first turn on a fresh context is itself the cold sample
                # (an 8k cold prefill costs ~80 s on the realistic model).
                cold_turns=(1,) if name == "loop_small" else (),
                goals=(
                    "modeld_over_limit",
                    "modeld_over_llama_server",
                    "modeld_over_lcp_server",
                    "decode_over_limit",
                    "http_overhead_ms",
                    "rss_over_llama_server",
                    "recomputed_tokens",
                ),
                fix="per-turn overhead in modeld (the prefill counts are the limit's)",
            )
        )

    # 2. Restart: the loop_large workspace, every system restarted, then the first turn.
    ws = loads[-1].turns[0].prefix
    add(
        Workload(
            "restart",
            f"Restart: the ~{large}-token loop_large prefix, every system restarted, then the first turn",
            "the direct driver saving its context to a file and loading it back (llama_state_seq_save/load_file): "
            "a perfect disk tier",
            "only the new suffix (the prefix comes back from disk)",
            [Turn(0, ws, make_suffix(77, 128, count), restart_before=True)],
            continues="loop_large",
            goals=(
                "restart_over_cold",
                "modeld_over_limit",
                "modeld_over_llama_server",
                "modeld_over_lcp_server",
                "rss_over_llama_server",
                "recomputed_tokens",
            ),
            fix="a disk tier that restores warm contexts after a restart (issue 8)",
        )
    )

    # 3. Edit inside the prefix: one repo-map line at ~60% of the map changes every turn.
    rng = random.Random(7)
    head = (SYSTEM, tools(rng), RULES)
    pinned = pinned_files(rng, (4, 3))
    lines = _fill_map(rng, head, pinned, small, count)
    at = int(len(lines) * 0.6)
    edit_token = count("".join(head) + "Repository map:\n" + "".join(lines[:at]))
    edit_turns = []
    for i in range(3):
        changed = [*lines[:at], lines[at].rstrip("\n") + f", revision_{i}()\n", *lines[at + 1 :]]
        edit_turns.append(Turn(0, _segments(head, changed, pinned), make_suffix(700 + i, 128, count)))
    add(
        Workload(
            "edit_prefix",
            f"Edit inside the prefix: one repo-map file changes at token ~{edit_token} of ~{small}",
            "a hot context truncated at the first changed token, re-evaluating from there",
            f"everything from the edit (token ~{edit_token}) to the end of the prompt",
            edit_turns,
            cold_turns=(1,),
            fix="prefill of the tokens after the edit (the prefill counts are the limit's)",
        )
    )

    # 4. Three workspaces in round robin.
    spaces = [workspace(300 + k, small * 3 // 4, count, (2, 1)) for k in range(3)]
    rounds = 1 if quick else 2
    rr = [
        Turn(k, spaces[k], make_suffix(900 + r * 3 + k, 128, count)) for r in range(rounds) for k in range(3)
    ]
    if quick:
        rr.append(Turn(0, spaces[0], make_suffix(999, 128, count)))
    add(
        Workload(
            "interleaved",
            f"Three workspaces (~{small * 3 // 4} tokens each), round robin, {len(rr)} turns",
            "one hot context per workspace",
            "each workspace's whole prompt once (minus the shared system prompt), then only suffixes",
            rr,
            workspaces=3,
            fix="several warm sequences per model (issue 8)",
        )
    )

    # 5. Sub-agents: a shared head (system, tools, rules, repo map), three private tails.
    rng = random.Random(55)
    head = (SYSTEM, tools(rng), RULES)
    shared_target, tail_target = (400, 150) if quick else (2000, 1000)
    lines = _fill_map(rng, head, "", shared_target, count)
    shared = _segments(head, lines, "")
    tails = [_pinned_sized(random.Random(560 + k), tail_target, count) for k in range(3)]
    agents = [(*shared, ("pinned", tails[k])) for k in range(3)]
    rounds = 1 if quick else 2
    sub = [
        Turn(k, agents[k], make_suffix(5600 + r * 3 + k, 128, count)) for r in range(rounds) for k in range(3)
    ]
    perfect_sub = f"the shared ~{shared_target}-token head once, each agent's ~{tail_target}-token tail once, then only suffixes"
    add(
        Workload(
            "subagents",
            f"Sub-agents: a ~{shared_target}-token shared head and three ~{tail_target}-token private tails, round robin",
            "one hot context per agent (the limit does not share the head between agents)",
            perfect_sub,
            sub,
            workspaces=3,
            fix="several warm sequences per model, the shared head stored once (issue 8)",
            llama_server_flags=("--slot-prompt-similarity", "0.75", "--no-cache-idle-slots"),
            llama_server_why=(
                "measured with the defaults: at similarity 0.1 every agent's prompt matches the slot last used "
                "by any agent (the shared head is ~60% of it), so the agents took turns in one slot; and "
                "--cache-idle-slots moves idle slots into the RAM cache, whose entries are swapped out when "
                "another agent borrows them for the shared head, so an agent lost its own state. 0.75 sends "
                "each agent back to its own slot and --no-cache-idle-slots keeps the slots resident (the pool "
                "holds all three; llama.cpp #22746)"
            ),
        )
    )
    conc = [
        Turn(k, agents[k], make_suffix(5700 + r * 3 + k, 128, count), wave=r)
        for r in range(rounds)
        for k in range(3)
    ]
    add(
        Workload(
            "subagents_concurrent",
            f"Sub-agents, concurrent: the same three agents, {rounds} rounds of three requests sent at once",
            "one hot context per agent, serving the three requests one after another "
            "(a request's TTFT includes the requests served before it)",
            "only each turn's suffix (every agent is warm from the round-robin workload)",
            conc,
            workspaces=3,
            continues="subagents",
            fix="each session's turn on its own warm sequence, decoded in one batch (issue 8)",
        )
    )

    # 6. More workspaces than fit in the KV pool.
    n_ws, ws_target = (3, 400) if quick else (5, 1200)
    pool_for = n_ws - 2  # workspaces whose contexts fit in the pool
    many = [workspace(1200 + k, ws_target, count, (1, 1)) for k in range(n_ws)]
    many_turns = [
        Turn(k, many[k], make_suffix(1300 + r * n_ws + k, 128, count)) for r in range(2) for k in range(n_ws)
    ]
    load = Workload(
        "many_workspaces",
        f"{n_ws} workspaces (~{ws_target} tokens each) in round robin, a KV pool for {pool_for}",
        "one hot context per workspace (unbounded memory)",
        "each workspace's prompt once (minus the shared system prompt), then only suffixes: "
        "evicted contexts come back from a RAM or disk tier",
        many_turns,
        workspaces=n_ws,
        fix="a RAM/disk tier behind the KV pool (issue 8)",
    )
    add(load)
    load.pool_tokens = pool_for * load.n_ctx

    # 7. Tool loop: ten rounds of tool results appended to the conversation.
    rng = random.Random(88)
    head = (SYSTEM, tools(rng), RULES)
    pinned = pinned_files(rng, (2, 2))
    base = _segments(head, _fill_map(rng, head, pinned, small, count), pinned)
    task = (
        "User: the test suite fails after the last refactor of the session cache. Find and fix the cause.\n"
    )
    sizes = [120, 60, 300, 180, 90, 250, 50, 200, 140, 280][: 3 if quick else 10]
    tool_turns = [Turn(0, base, (("user_turn", task),))]
    conversation = task
    for i, n in enumerate(sizes):
        conversation_with_call = conversation + _tool_call(8800 + i)
        result = _tool_result(8900 + i, n, count)
        tool_turns.append(Turn(0, (*base, ("history", conversation_with_call)), (("terminal", result),)))
        conversation = conversation_with_call + result
    add(
        Workload(
            "tool_loop",
            f"Tool loop: a ~{small}-token prefix, then {len(sizes)} rounds of tool results of {min(sizes)}-{max(sizes)} tokens",
            "a hot context evaluating only what was appended (the scripted tool call and the tool result)",
            "each round's tool call and tool result (the conversation before them is unchanged)",
            tool_turns,
            fix="reuse of the previous turn's suffix as the next turn's prefix",
        )
    )

    # 8. Memory at both systems' defaults (issue 30): one workspace, an 8k window nearly filled
    # by its prefix. The same sizes with --quick (the tiny model's 8k prefill takes seconds).
    window, prefix_target = 8192, 7800
    ws = workspace(8100, prefix_target - 64, count)
    load = Workload(
        "defaults_8k",
        f"Defaults: one workspace, an {window}-token window, a ~{prefix_target}-token prefix, both systems "
        "at their default flags",
        "a hot llama.cpp context evaluating only the new suffix",
        "the suffix of each turn after the first",
        [Turn(0, ws, make_suffix(8200 + i, n, count)) for i, n in enumerate((64, 128))],
        goals=("modeld_over_llama_server", "rss_over_llama_server", "recomputed_tokens"),
        fix="modeld's own memory at its defaults (blueprint 0016, \"Memory at both systems' defaults\")",
        defaults=True,
    )
    add(load)
    load.n_ctx = window  # the window a user sets (llama-server -c, modeld --num-ctx), not the fit
    return loads


def workload_names() -> list[str]:
    return [
        "loop_small",
        "loop_large",
        "restart",
        "edit_prefix",
        "interleaved",
        "subagents",
        "subagents_concurrent",
        "many_workspaces",
        "tool_loop",
        "defaults_8k",
    ]
