"""The store: one writer connection on its own thread, readers on another.

Every write is a function run on the writer thread (the one transaction helper); the event
loop only awaits the result, so neither the GUI nor the server ever waits on a disk.

Group commit: the writer takes every write waiting in its queue, runs each in its own
SAVEPOINT inside one `BEGIN IMMEDIATE` transaction and commits them together, so writers
that arrive together share one fsync. A write that fails is rolled back to its savepoint
alone; every caller gets its own result or exception, and only after the commit that made
its write durable: a 202 is never answered before its task is on disk.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from app.errors import StoreError
from app.store import db

log = logging.getLogger(__name__)
T = TypeVar("T")
SQLITE_FULL = 13


@dataclass
class _Write:
    """One caller's write, waiting in the queue and then for its commit."""
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    outcome: tuple[bool, Any] = field(default=(False, None))  # (succeeded, value or exception)


def _resolve(answers: list[tuple[asyncio.Future[Any], tuple[bool, Any]]]) -> None:
    for future, (succeeded, value) in answers:
        if future.done():  # the caller stopped waiting; its write happened (or not) all the same
            continue
        if succeeded:
            future.set_result(value)
        else:
            future.set_exception(value)


def _translated(exc: Exception) -> Exception:
    if isinstance(exc, sqlite3.OperationalError) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == SQLITE_FULL:
        error = StoreError("disk_full", "The disk is full: nothing was written, and nothing stored was lost.")
        error.__cause__ = exc
        return error
    return exc


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="lmsp-reader")
        self._local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._conn: sqlite3.Connection | None = None
        self.recovered_from_corruption: str | None = None
        self.commits = 0       # commits that wrote something: one fsync each (for /metrics)
        self.transactions = 0  # writes committed; several share a commit under load

    async def open(self) -> None:
        opened = await asyncio.to_thread(db.open_database, self.path)
        self._conn = opened.conn
        self.recovered_from_corruption = opened.recovered_from_corruption
        self._writer = threading.Thread(target=self._serve, args=(opened.conn,), name="lmsp-writer", daemon=True)
        self._writer.start()

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(conn, *args) in its own savepoint of a write transaction; return once committed."""
        if self._conn is None:
            raise StoreError("store_closed", "The database is closed.")
        write = _Write(fn, args, asyncio.get_running_loop().create_future())
        self._queue.put(write)
        return await write.future  # type: ignore[no-any-return]

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(conn, *args) on a read-only connection (WAL: readers never block the writer)."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._read, fn, args)

    async def checkpoint(self, wait: float = 10.0) -> bool:
        """Copy the WAL into the database file and empty it, through a connection of its own (the
        writer's is for transactions): what deletes overwrote (`secure_delete`) is then gone from
        the disk, not only from the database; the old copies in the WAL went with it.

        It needs the write lock and no reader on an older snapshot: it waits up to `wait` seconds
        for them (writes wait meanwhile), then gives up. Returns whether the WAL was emptied."""
        def truncate() -> bool:
            conn = db.connect(self.path)
            try:
                conn.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")
                busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            finally:
                conn.close()
            return not busy

        return await asyncio.to_thread(truncate)

    # -- the writer thread -------------------------------------------------------------------

    def _serve(self, conn: sqlite3.Connection) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while True:  # everything that queued up while the last commit was on its way to disk
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = None in batch  # close() queues None after the last write
            writes = [w for w in batch if w is not None]
            if writes:
                self._commit(conn, writes)

    def _commit(self, conn: sqlite3.Connection, writes: list[_Write]) -> None:
        while writes:
            changes = conn.total_changes  # a commit that changed nothing writes nothing: no fsync
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                busy = StoreError("database_busy", f"The database is locked by another program: {exc}")
                self._settle(writes, (False, busy))
                return
            ran: list[_Write] = []
            alone = len(writes) == 1  # its own transaction: no savepoint needed to undo it alone
            for n, write in enumerate(writes):
                self._run(conn, write, alone)
                if not conn.in_transaction:
                    # The error (disk full, I/O) rolled back the whole transaction, the writes
                    # before it too: the failed one has its answer, the others run again.
                    self._settle([write])
                    writes = ran + writes[n + 1:]
                    break
                ran.append(write)
            else:
                try:
                    conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    self._settle(writes, (False, _translated(exc)))
                    return
                self.commits += conn.total_changes != changes
                self.transactions += sum(write.outcome[0] for write in writes)
                self._settle(writes)
                return

    @staticmethod
    def _run(conn: sqlite3.Connection, write: _Write, alone: bool) -> None:
        """Run one write in its savepoint, or, `alone` in its transaction, without one: a
        running task's writes mostly come one at a time, and the two statements cost a
        measurable share of each token."""
        if not alone:
            conn.execute("SAVEPOINT write")
        try:
            write.outcome = (True, write.fn(conn, *write.args))
        except Exception as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK" if alone else "ROLLBACK TO write")
                if not alone:
                    conn.execute("RELEASE write")
            write.outcome = (False, _translated(exc))
        else:
            if not alone:
                conn.execute("RELEASE write")

    @staticmethod
    def _settle(writes: list[_Write], outcome: tuple[bool, Any] | None = None) -> None:
        """Answer the callers of a commit with one wake-up of their event loop, not one each."""
        answers: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], tuple[bool, Any]]]] = {}
        for write in writes:
            answers.setdefault(write.future.get_loop(), []).append((write.future, outcome or write.outcome))
        for loop, batch in answers.items():
            loop.call_soon_threadsafe(_resolve, batch)

    # -- readers -----------------------------------------------------------------------------

    def _read(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = db.connect(self.path, readonly=True)
            self._reader_conns.append(conn)
        conn.execute("BEGIN")
        try:
            return fn(conn, *args)
        finally:
            conn.execute("COMMIT")

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if self._writer is not None:
            self._queue.put(None)  # the writer commits what is queued before it, then ends
            await asyncio.to_thread(self._writer.join)
        if conn is not None:
            await asyncio.to_thread(db.close, conn)
        self._readers.shutdown(wait=True)
        for reader in self._reader_conns:
            reader.close()
