"""Where a prefill of memory that cannot be cut at any token begins its batches
(:func:`modeld.backends.llama_checkpoints.canonical`): a function of the tokens and the segment
starts alone, which an edit leaves unchanged before it, with line starts inside long stretches
(blueprint 0016, "Edits inside a segment"). The end-to-end checks on the real models are in
``tests/cache/test_hybrid_lines.py``."""

from __future__ import annotations

import math
import random

import pytest

checkpoints = pytest.importorskip("modeld.backends.llama_checkpoints")
canonical = checkpoints.canonical
LINE_GAP, LINE_SHARE = checkpoints.LINE_GAP, checkpoints.LINE_SHARE

NL, TURN = 10, 1
LINES = frozenset({NL})
TURNS = frozenset({TURN})


def _text(n: int, line: int, seed: int = 0) -> list[int]:
    """``n`` tokens, a newline token ending every line of about ``line`` tokens."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out += [rng.randrange(100, 4000) for _ in range(rng.randrange(line // 2, line * 3 // 2))] + [NL]
    return out[:n]


def test_line_starts_inside_a_long_stretch_are_batch_starts_64_tokens_or_more_apart() -> None:
    tokens = _text(1800, 20)
    marks = canonical(tokens, 512, frozenset(), lines=LINES)
    for a, b in zip([0, *marks], marks, strict=False):
        if b % 512:
            assert tokens[b - 1] == NL, b  # a line start
            assert LINE_GAP <= b - a <= LINE_GAP + 31, (a, b)  # the first one 64 tokens on (lines <= 31)
            assert 512 - b % 512 >= LINE_GAP // 2, b  # none just before the grid
    assert {512, 1024, 1536} <= set(marks)
    # Without line tokens (or for memory that can be cut, which passes none): the grid only.
    assert canonical(tokens, 512, frozenset()) == [512, 1024, 1536]


def test_the_spacing_grows_with_the_position_and_the_extra_batches_are_bounded() -> None:
    tokens = _text(60000, 12)
    marks = canonical(tokens, 512, frozenset(), lines=LINES)
    extra = [q for q in marks if q % 512]
    for a, b in zip([0, *marks], marks, strict=False):
        if b % 512:
            assert b - a >= max(LINE_GAP, a // LINE_SHARE), (a, b)
    assert extra and max(extra) < 512 * LINE_SHARE  # the grid alone from there on
    assert len(extra) <= LINE_SHARE * (1 + math.log(512 / LINE_GAP)) + 8, len(extra)
    assert len(canonical(tokens, 512, frozenset(), lines=LINES, share=10**9)) > 3 * len(marks)


@pytest.mark.parametrize("seed", range(8))
def test_an_edit_leaves_every_batch_start_before_it_and_a_prefix_has_the_same(seed: int) -> None:
    """What makes a warm turn a fresh evaluation: the positions before a divergence are the same
    in the old prompt and the edited one, and a prefix of a prompt has the prompt's positions."""
    rng = random.Random(seed)
    tokens = _text(3000, rng.choice([8, 20, 60]), seed)
    for q in rng.sample(range(1, 3000), 12):
        tokens[q] = TURN
    segments = sorted(rng.sample(range(1, 3000), 10))
    edit = rng.randrange(1, 3000)
    edited = tokens[:edit] + _text(3000 - edit, 15, seed + 100)

    def marks(t: list[int]) -> list[int]:
        return canonical(t, 512, TURNS, segments=segments, lines=LINES)

    before = [q for q in marks(tokens) if q <= edit]
    assert [q for q in marks(edited) if q <= edit] == before
    assert [q for q in marks(tokens[: edit + 1]) if q <= edit] == before
