"""The one thing the core asks of whoever called it: is it still there? Work done for a caller
alone (a foreground answer, embeddings, a model being examined) stops when it leaves."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
# True once the caller has gone. A predicate, asked every POLL_SECONDS, because that is what a
# surface can always answer: aiohttp tells no handler that its client left (`handler_cancellation`
# is off in `Server`), it only shows the transport closing.
Left = Callable[[], bool]
POLL_SECONDS = 0.25


async def unless_left(left: Left, work: Awaitable[T]) -> T:
    """Await `work`, unless the caller leaves first (then CancelledError, and `work` is cancelled)."""
    waiter = asyncio.ensure_future(work)
    try:
        while not waiter.done():
            if left():
                raise asyncio.CancelledError("the caller left")
            await asyncio.wait([waiter], timeout=POLL_SECONDS)
        return waiter.result()
    finally:
        waiter.cancel()
