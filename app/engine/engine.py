"""The parent's side of one engine child: start it, load a model, stream a generation.

A reader thread turns the child's messages into items on an asyncio queue, so the event loop
never blocks on the pipe. If the child dies, every waiter gets an `engine_crashed` error and
the next request starts a fresh child.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, AsyncIterator

from app.engine import child

log = logging.getLogger(__name__)
Message = dict[str, Any]
CRASHED: Message = {"ev": "error", "code": "engine_crashed", "message": "The inference process stopped unexpectedly."}


class EngineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Generation:
    """What the engine needs to generate, and where to pick up from (resume)."""
    messages: list[Message]
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    prefix_ids: list[int] | None = None
    emitted_chars: int = 0


class Engine:
    _ids = itertools.count(1)

    def __init__(self, name: str = "engine", n_ctx: int = 4096, n_threads: int | None = None) -> None:
        self.name = name
        self.n_ctx = n_ctx
        self.n_threads = n_threads or os.cpu_count() or 1
        self.model_path: str | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._inbox: asyncio.Queue[Message] | None = None
        self._lock = asyncio.Lock()  # one request to the child at a time
        self._job: str | None = None
        self._last_used = time.monotonic()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs Qt and threads
        parent, kid = ctx.Pipe()
        proc = ctx.Process(target=child.main, args=(kid,), name=f"lmsp-{self.name}", daemon=True)
        proc.start()
        kid.close()
        log.info("%s: started inference process %s", self.name, proc.pid)
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._proc, self._conn, self._inbox, self.model_path = proc, parent, inbox, None

        def pump() -> None:
            try:
                while True:
                    msg = parent.recv()
                    loop.call_soon_threadsafe(inbox.put_nowait, msg)
            except (EOFError, OSError):
                pass
            if not loop.is_closed():
                loop.call_soon_threadsafe(inbox.put_nowait, CRASHED)

        threading.Thread(target=pump, name=f"lmsp-{self.name}-pipe", daemon=True).start()

    def _send(self, msg: Message) -> None:
        if not self.alive or self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            raise EngineError(CRASHED["code"], CRASHED["message"]) from exc

    async def _next(self) -> Message:
        assert self._inbox is not None
        msg = await self._inbox.get()
        if msg is CRASHED:
            self._reap()
        return msg

    def _reap(self) -> None:
        if self._proc is not None:
            self._proc.join(timeout=1)
            log.warning("%s process exited with code %s", self.name, self._proc.exitcode)
        self._proc = self._conn = None
        self.model_path = None

    async def load(self, path: str) -> Message:
        """Load `path` unless it is already loaded. Raises EngineError on failure."""
        async with self._lock:
            if self.model_path == path and self.alive:
                return {"ev": "loaded", "cached": True}
            self._send({"op": "load", "path": path, "n_ctx": self.n_ctx, "n_threads": self.n_threads})
            msg = await self._next()
            if msg["ev"] != "loaded":
                raise EngineError(msg["code"], msg["message"])
            log.info("%s: loaded %s in %.2f s", self.name, path, msg["load_seconds"])
            self.model_path = path
            self._last_used = time.monotonic()
            return msg

    async def unload(self) -> None:
        async with self._lock:
            if self.alive and self.model_path is not None:
                self._send({"op": "unload"})
                await self._next()
            self.model_path = None

    async def generate(self, gen: Generation) -> AsyncIterator[Message]:
        """Yield `chunk` messages, then one `done`. Raises EngineError on failure."""
        async with self._lock:
            job = f"job{next(self._ids)}"
            self._job = job
            self._send({"op": "generate", "job": job, **gen.__dict__})
            while True:
                msg = await self._next()
                if msg["ev"] == "error":
                    raise EngineError(msg["code"], msg["message"])
                yield msg
                if msg["ev"] == "done":
                    self._last_used = time.monotonic()
                    return

    def idle_for(self) -> float:
        return time.monotonic() - self._last_used

    def cancel(self) -> None:
        """Ask the running generation to stop; it ends with reason `cancelled` within a token."""
        job = self._job
        if job and self._conn is not None and self.alive:
            try:
                self._conn.send({"op": "cancel", "job": job})
            except OSError:
                pass

    async def stop(self) -> None:
        if self._proc is None:
            return
        proc = self._proc
        try:
            if self._conn is not None:
                self._conn.send({"op": "shutdown"})
        except OSError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 3)
        if proc.is_alive():
            proc.kill()
        self._proc = self._conn = None
