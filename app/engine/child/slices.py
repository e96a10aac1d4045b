"""The slices a prompt is evaluated in, fixed by position so that a cached prefix is reused only
where this prompt's own plan computes it the same way (app/engine/child/main.py `generate`)."""

from __future__ import annotations

# Prompts are evaluated in slices fixed by absolute position (see `grid_point`): fine at the
# start, where requests share a chat template's preamble, then COARSE tokens (at most llama.cpp's
# batch): only whole slices are reused from the cache, so the next turn of a conversation reuses
# all of the previous prompt but its last partial slice (with slices of 512, turns of ~75 tokens
# reused nothing new for six turns in a row: tests/bench/test_conversations.py).
FINE, FINE_UNTIL, COARSE = 16, 128, 128


def grid_point(position: int, coarse: int) -> int:
    """The last slice boundary at or before `position`."""
    if position < FINE_UNTIL:
        return position // FINE * FINE
    return FINE_UNTIL + (position - FINE_UNTIL) // coarse * coarse


def grid(start: int, end: int, coarse: int) -> list[tuple[int, int]]:
    """The slices that evaluate positions start..end (start on the grid)."""
    cuts = []
    while start < end:
        step = FINE if start < FINE_UNTIL else coarse
        cuts.append((start, min(end, grid_point(start, coarse) + step)))
        start = cuts[-1][1]
    return cuts


def shared_slices(plan: list[tuple[int, int]], body: list[int], done: list[tuple[int, int]],
                  cached: list[int]) -> int:
    """How many leading tokens of `body` the cache holds as this plan would compute them: the
    end of the last slice both plans share, with the same tokens up to it."""
    reuse = 0
    for cut, was in zip(plan, done):
        if cut != was or body[reuse:cut[1]] != cached[reuse:cut[1]]:
            break
        reuse = cut[1]
    return reuse
