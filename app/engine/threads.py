"""How many threads decode: all of the engine's, or one, whichever is faster right now.

llama.cpp's threads wait for each other at every step of a token (an OpenMP barrier). On an
idle machine they should spin there rather than sleep: on two cores, sleeping after 1,000 spins
cost 17-26 % of decoding through the service on an Intel CPU whose `pause` is slow. But beside
another busy program a spinning thread waits for a sibling that is not running, and decoding
collapses (two threads with 100,000 spins beside one busy program: 1.2 tokens/s where one
thread alone makes 40). So the threads spin (child.SPIN_COUNT), and the decode loop times
every token and switches to one thread, which has no barrier to wait at, when that is faster:
it tries the other count after a token that took far longer than usual, and from time to time,
less often each time the trial loses (every 30 s of decoding at most: what a trial costs beside
a busy program, and how long decoding may stay on one thread after that program ended). The
clock is decoding time: a task started after a pause does not open with a trial. The thread
count does not change the numbers llama.cpp computes (each dot product is one thread's), so
greedy output stays the same (tests/test_busy_machine.py).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

STALL = 4.0          # a token this many times its recent median: try the other count at once
FIRST_TRY = 1.0      # seconds until the other count is tried again, doubled while it loses
LAST_TRY = 30.0
RECENT = 8           # tokens the median is taken over


class Threads:
    def __init__(self, llm: Any, most: int) -> None:
        self.llm = llm
        self.most = most
        self.using = most
        self.recent: dict[int, deque[float]] = {most: deque(maxlen=RECENT), 1: deque(maxlen=RECENT)}
        self.wait = FIRST_TRY
        self.decoding = 0.0  # seconds spent evaluating generated tokens: the clock of the trials
        self.next_try = self.wait
        self.trying = False  # the last token ran on a count switched to as a trial

    def _use(self, count: int) -> None:
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.llm._ctx.ctx, count, count)
        self.using = count

    def eval(self, tokens: list[int]) -> None:
        """Evaluate one generated token, timed, then pick the thread count of the next one."""
        start = time.perf_counter()
        self.llm.eval(tokens)
        took = time.perf_counter() - start
        if self.most == 1:
            return
        self.decoding += took
        recent = self.recent[self.using]
        stalled = len(recent) == RECENT and took > STALL * statistics.median(recent)
        recent.append(took)
        other = 1 if self.using == self.most else self.most
        if self.trying:
            self.trying = False
            # Against the token just before the switch: after a stall, that one is the stall.
            if took >= self.recent[other][-1]:  # lost: back, and the next trial comes later
                self.wait = min(self.wait * 2, LAST_TRY)
                self._use(other)
            self.next_try = self.decoding + self.wait
        elif stalled or self.decoding >= self.next_try:
            self.trying = True
            self._use(other)
