"""The parent's ends of an engine child's pipes: its messages onto the event loop, its standard
error into the log."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("app.engine.parent.engine")  # its lines read as the engine's
Message = dict[str, Any]
Deliver = Callable[[Message], None]  # on the loop: one message of the child to whoever waits for it
CRASHED: Message = {"ev": "error", "code": "engine_crashed", "message": "The inference process stopped unexpectedly."}


def drain(loop: asyncio.AbstractEventLoop, conn: Connection, deliver: Deliver) -> None:
    """On the loop, when the child's pipe is readable: take one message (the loop calls again
    while more wait; `recv` waits at most for the rest of one the child is writing). At the end
    of the pipe (the child gone) the engine hears CRASHED."""
    try:
        deliver(conn.recv())  # not `conn.poll()` first: it builds a selector each call
    except (EOFError, OSError):
        loop.remove_reader(conn.fileno())
        deliver(CRASHED)


def pump(loop: asyncio.AbstractEventLoop, conn: Connection, deliver: Deliver) -> None:
    """On a thread: hand each message of the child to the loop, then CRASHED when the pipe ends."""
    try:
        while True:
            msg = conn.recv()
            loop.call_soon_threadsafe(deliver, msg)
    except (EOFError, OSError):
        pass
    if not loop.is_closed():
        loop.call_soon_threadsafe(deliver, CRASHED)


def relay(stderr: Connection, name: str) -> None:
    """On a thread: each line the child writes to its standard error into the log, until the
    child is gone. Else llama.cpp's messages (why it aborted, say) would be in no log, and on a
    stderr nobody reads the child would wait for room in the pipe once the parent filled it."""
    with open(stderr.fileno(), "rb", closefd=False) as lines:
        for line in lines:
            log.info("%s: %s", name, line.decode(errors="replace").rstrip())
    stderr.close()
