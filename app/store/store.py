"""The store: one writer connection on its own thread, readers on another.

Every write is a function run inside `BEGIN IMMEDIATE` on the writer thread (the one
transaction helper); the event loop only awaits the result, so neither the GUI nor the
server ever waits on a disk.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from app.errors import StoreError
from app.store import db

log = logging.getLogger(__name__)
T = TypeVar("T")
SQLITE_FULL = 13


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="lmsp-writer")
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="lmsp-reader")
        self._local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._conn: sqlite3.Connection | None = None
        self.recovered_from_corruption: str | None = None

    async def open(self) -> None:
        opened = await asyncio.get_running_loop().run_in_executor(self._writer, db.open_database, self.path)
        self._conn = opened.conn
        self.recovered_from_corruption = opened.recovered_from_corruption

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(conn, *args) in one IMMEDIATE transaction on the writer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, self._transaction, fn, args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(conn, *args) on a read-only connection (WAL: readers never block the writer)."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._read, fn, args)

    def _transaction(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn = self._conn
        if conn is None:
            raise StoreError("store_closed", "The database is closed.")
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise StoreError("database_busy", f"The database is locked by another program: {exc}") from exc
        try:
            result = fn(conn, *args)
            conn.execute("COMMIT")
            return result
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == SQLITE_FULL:
                raise StoreError("disk_full", "The disk is full: nothing was written, and nothing stored was lost.") from exc
            raise

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
        loop = asyncio.get_running_loop()

        def close_writer() -> None:
            if self._conn is not None:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._conn.close()
                self._conn = None

        await loop.run_in_executor(self._writer, close_writer)
        self._readers.shutdown(wait=True)
        for conn in self._reader_conns:
            conn.close()
        self._writer.shutdown(wait=True)
