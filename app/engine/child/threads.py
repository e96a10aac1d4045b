"""How many threads evaluate: all of the engine's, or one, whichever is faster right now.

llama.cpp's threads wait for each other at every step of a batch (an OpenMP barrier). On an
idle machine they should spin there rather than sleep: on two cores, sleeping after 1,000 spins
cost 17-26 % of decoding through the service on an Intel CPU whose `pause` is slow. But beside
another busy program a spinning thread waits for a sibling that is not running, and decoding
collapses (two threads with 100,000 spins beside one busy program: 1.2 tokens/s where one
thread alone makes 40; a 700-token prompt: 18-32 s where one thread takes 5). So the threads
spin (child.SPIN_COUNT), and every batch the engine evaluates (a prompt slice, one token) is
timed: the engine switches to one thread, which has no barrier to wait at, when that is faster.
It tries the other count after a batch that took far longer than usual, and from time to time,
less often each time the trial loses and the more it lost (every 30 s of evaluating at most:
what a trial costs beside a busy program, and how long the engine may stay on one thread after
that program ended). A trial runs on a batch of the size of the one before, so that the two
compare. The clock is evaluating time: a task started after a pause does not open with a
trial. The thread count does not change the numbers llama.cpp computes (each dot product is
one thread's), so greedy output stays the same (tests/test_busy_machine.py).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

STALL = 4.0          # a batch this many times the recent median of its size: try the other count
FIRST_TRY = 1.0      # seconds until the other count is tried again, doubled while it loses
LAST_TRY = 30.0
COST = 30.0          # a trial that lost L seconds waits at least COST * L: a prompt slice's trial costs more
RECENT = 8           # batches of a size the median is taken over


class Threads:
    def __init__(self, ctx: Any, most: int) -> None:
        """`ctx`: the llama.cpp context (a `llama_context_p`) whose evaluations are timed."""
        self.ctx = ctx
        self.most = most
        self.using = most
        # Seconds each recent batch took, by thread count and batch size.
        self.recent: defaultdict[tuple[int, int], deque[float]] = defaultdict(lambda: deque(maxlen=RECENT))
        self.wait = FIRST_TRY
        self.busy = 0.0  # seconds spent evaluating: the clock of the trials
        self.next_try = self.wait
        self.due = False     # a trial is due, on the next batch of the last one's size
        self.trying = False  # the last batch ran on a count switched to as a trial
        self.last = 0        # the size of the last batch

    def _use(self, count: int) -> None:
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.ctx, count, count)
        self.using = count

    def _other(self) -> int:
        return 1 if self.using == self.most else self.most

    def run(self, size: int, evaluate: Callable[[], T]) -> T:
        """Evaluate a batch of `size` tokens (`evaluate` does), timed, on the thread count that is faster."""
        if self.most == 1:
            return evaluate()
        # A trial of all threads beside a busy program costs what that count takes: on one token
        # 0.15-0.8 s, on a prompt slice 2-3 s. So it waits for one token (every task has some).
        if self.due and size == self.last and (self.using == self.most or size == 1):
            self.due, self.trying = False, True
            self._use(self._other())
        start = time.perf_counter()
        result = evaluate()
        took = time.perf_counter() - start
        self.busy += took
        recent = self.recent[self.using, size]
        stalled = len(recent) == RECENT and took > STALL * statistics.median(recent)
        recent.append(took)
        if self.trying:
            self.trying = False
            # Against the batch just before the switch: after a stall, that one is the stall.
            lost = took - self.recent[self._other(), size][-1]
            if lost >= 0:  # back, and the next trial comes later: the more it cost, the later
                self.wait = min(max(self.wait * 2, lost * COST), LAST_TRY)
                self._use(self._other())
            self.next_try = self.busy + self.wait
        elif stalled or self.busy >= self.next_try:
            self.due = True
        self.last = size
        return result
