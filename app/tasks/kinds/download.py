"""Downloads from the Hugging Face hub as durable tasks (LMSP §13).

A download is a task of kind "download": the same table, states, sequence rules, cancel and
retention as a generation, taken by the same scheduler, but into slots of its own: it is I/O,
not engine work, so it never waits for an engine and runs beside generation (a few at once).

    queued -> loading (asking the hub where the bytes are) -> running (receiving, verifying)
    -> completed | failed;  queued -> cancelled;  loading|running -> cancelling -> cancelled

Events: `download.started` (each time the transfer (re)starts, with the bytes already on disk),
`download.progress`, `download.verifying`, `download.completed` (`model_id`), `download.failed`
(`error`), `download.cancelling`, `download.cancelled`.

Recovery: a download never starts over and never fails because the service stopped, whatever
happened (its `on_restart` is always "resume"): left queued, loading or running, it continues
at the next start from the bytes on disk; left cancelling, it ends cancelled. A failed or
cancelled download leaves no partial file (removed when it ends, and again at start).

"Pause new tasks" holds generations only: it is about the engines, and a download uses none.

The hub side (metadata, the transfer, the cache layout) is app/engine/net/hub.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from app.engine.net import hub
from app.engine.registry import models
from app.errors import LmspError
from app.tasks import limits, machine, records
from app.tasks.kinds.base import Claimed, Kind, Needs, Recovered, Room
from app.tasks.states import CANCELLED, CANCELLING, COMPLETED, FAILED, LOADING, QUEUED, RUNNING, TERMINAL

log = logging.getLogger(__name__)
PROGRESS_SECONDS = 1.0   # one progress event (and fsynced commit) a second per download
SLOTS = 3                # downloads at once: more only share the same line
TERMINAL_EVENTS = ("download.completed", "download.failed", "download.cancelled")
TRANSIENT = ("hub_unreachable", "hub_unavailable", "download_interrupted")
RETRY_SECONDS = (2, 10, 30, 60, 120)  # about four minutes of a lost line before giving up


class Downloads(Kind):
    name = "download"
    worker = "lmsp-download"
    terminal_events = TERMINAL_EVENTS

    def __init__(self, needs: Needs) -> None:
        self.store = needs.store
        self.bus = needs.bus
        self.token = needs.hub_token  # the hub token (blocking: a keyring read)
        self.active: dict[str, hub.Transfer] = {}
        # Whether a claim should look for a download: at start, when one is asked for, when one
        # ends; no longer once a claim found none (set on the writer, in that claim: whatever
        # asks for a download commits it, then wakes this, after such a claim has committed).
        self._look = True
        # The transfers and the hashing of a whole file take minutes: threads of their own, one a
        # slot, so that they never hold the default pool the rest of the service needs.
        self._threads = ThreadPoolExecutor(SLOTS, thread_name_prefix="lmsp-download")

    def wake(self) -> None:
        """A download may be waiting: the next claim looks for one."""
        self._look = True
        self.host.wake()

    def room(self) -> Room | None:
        if len(self.active) >= SLOTS or not self._look:
            return None
        return Room(("download",), tuple(self.active))

    def claim(self, conn: sqlite3.Connection, room: Room) -> Claimed | None:
        """The oldest download that should be moving and is not: queued, or left mid-way by a stop."""
        marks = ",".join("?" * len(room.busy))
        exclude = f" AND id NOT IN ({marks})" if room.busy else ""
        row = conn.execute(f"SELECT id, status FROM tasks WHERE kind = ? AND status IN ('queued', 'loading', "
                           f"'running'){exclude} ORDER BY created_at LIMIT 1", (self.name, *room.busy)).fetchone()
        if row is None:
            self._look = False
            return None
        if row["status"] == QUEUED:
            machine.transition(conn, row["id"], LOADING, only_from=(QUEUED,))
        return Claimed(self, row["id"], room, "download", [])

    def start(self, claimed: Claimed) -> Coroutine[Any, Any, None]:
        transfer = self.active[claimed.task_id] = hub.Transfer()
        return self._run(claimed.task_id, transfer)

    async def accept_cancel(self, task_id: str) -> list[machine.Event] | None:
        result: list[machine.Event] | None = await self.store.write(request_cancel, task_id)
        return result

    def cancel(self, task_id: str) -> None:
        """The database already says `cancelling` (or `cancelled`): stop the transfer."""
        transfer = self.active.get(task_id)
        if transfer is not None:
            transfer.stop = "cancel"

    def recover(self, conn: sqlite3.Connection) -> Recovered:
        """A download left cancelling ends cancelled; the partial files of every ended download
        go (off the writer thread, once committed)."""
        events: list[machine.Event] = []
        for row in conn.execute("SELECT id FROM tasks WHERE kind = ? AND status = 'cancelling'",
                                (self.name,)).fetchall():
            events += _cancelled(conn, row["id"]) or []
        marks = ",".join("?" * len(TERMINAL))
        ended = conn.execute(f"SELECT d.partial_path FROM downloads d JOIN tasks t ON t.id = d.task_id "
                             f"WHERE t.status IN ({marks})", TERMINAL).fetchall()
        return Recovered(events=events, cleanup=functools.partial(_remove, [r["partial_path"] for r in ended]))

    def halt(self) -> None:
        """Stop the transfers where they are: their bytes stay on disk for the next start."""
        for transfer in self.active.values():
            transfer.stop = "shutdown"

    def close(self) -> None:
        self._threads.shutdown(wait=False)

    async def _run(self, task_id: str, transfer: hub.Transfer) -> None:
        try:
            await self._attempts(task_id, transfer)
        finally:  # only once the task has left `running`: else a claim would take it again
            self.active.pop(task_id, None)
            self._look = True

    async def _attempts(self, task_id: str, transfer: hub.Transfer) -> None:
        row = await self.store.read(_download, task_id)
        partial = Path(row["partial_path"])
        for delay in (*RETRY_SECONDS, None):
            try:
                outcome = await self._execute(row, partial, transfer)
            except Exception as exc:  # noqa: BLE001 - every failure ends the task with a clear error
                outcome = _failure(exc)
            if not isinstance(outcome, LmspError) or outcome.code not in TRANSIENT or delay is None:
                break
            # The hub or the line failed after the library's own retries: the bytes so far stay,
            # and the download tries again a little later, unless stopped meanwhile.
            log.warning("download %s: %s; trying again in %d s", task_id, outcome.message, delay)
            await asyncio.sleep(delay)
            if transfer.stop:
                outcome = "cancel" if transfer.stop == "cancel" else None
                break
        if outcome is None:  # completed, or stopped by a shutdown: the bytes stay for the next start
            return
        await asyncio.to_thread(_remove, [str(partial)])
        if not isinstance(outcome, LmspError):  # "cancel"
            await self.bus.commit(self.store, _cancelled, task_id)
        elif await self.bus.commit(self.store, _fail, task_id, outcome.code, outcome.message) is None:
            await self.bus.commit(self.store, _cancelled, task_id)  # a cancel was accepted first

    async def _execute(self, row: sqlite3.Row, partial: Path, transfer: hub.Transfer) -> str | LmspError | None:
        """The download, from wherever it stands. Returns None when done or set aside by a
        shutdown, "cancel" when cancelled, or the error that failed it."""
        task_id = row["task_id"]
        token = await asyncio.to_thread(self.token)
        # Pinned to the commit seen when the download was asked for: a moved branch cannot swap
        # the file under a half-finished download. The URL is asked anew: signed CDN links expire.
        remote = await asyncio.to_thread(hub.describe, row["repo"], row["file"], row["commit_hash"], token)
        remote = dataclasses.replace(remote, revision=row["revision"])
        if remote.sha256 != row["sha256"]:
            return LmspError("digest_mismatch", f"The hub now gives {row['file']} another sha256 than when the "
                             "download was asked for; ask for it again.")
        # After a reboot (a power cut) only the bytes a progress commit counted were surely fsynced:
        # the transfer continues from there (hub.fetch cuts the file back to them).
        synced = await self.store.read(_synced, task_id)
        have = await asyncio.to_thread(hub.kept, partial, synced)
        if await self.bus.commit(self.store, _begin, task_id, have, remote.size) is None:
            return "cancel"
        blob = hub.blob_path(remote)
        # Already in the cache (another tool, or an earlier download): verified, not fetched. A bad
        # one fails the task but stays: the cache is shared, and that file is not ours to delete.
        if blob.exists():
            digest = await self._blocking(models.sha256_file, blob)
            partial = blob
        else:
            fetching = asyncio.ensure_future(self._blocking(hub.fetch, remote, partial, token, transfer, have))
            try:
                await self._report(task_id, fetching, transfer, remote.size)
            finally:
                if not fetching.done():  # this task itself was cancelled (service stopping hard)
                    transfer.stop = "shutdown"
            try:
                digest = "sha256:" + fetching.result()
            except hub.Stopped as exc:
                if exc.reason == "shutdown":
                    await self.bus.commit(self.store, _progress, task_id, transfer.synced, None)
                    return None
                return "cancel"
        if await self.bus.commit(self.store, _verifying, task_id, remote.size) is None:
            return "cancel"
        if digest != "sha256:" + remote.sha256:
            return LmspError("digest_mismatch", f"{remote.file} arrived with {digest}, not the sha256:{remote.sha256} "
                             "the hub announced: it was deleted and not registered.")
        found = await self._blocking(models.examine, str(partial), None, None, digest)
        if partial != blob:
            await asyncio.to_thread(hub.place, remote, partial)
        found = dataclasses.replace(found, path=str(blob))
        if await self.bus.commit(self.store, _complete, task_id, found, models.suggest_id(remote.file)) is None:
            return "cancel"
        self.bus.publish([{"type": "models.changed"}])
        return None

    def _blocking(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def _report(self, task_id: str, fetching: asyncio.Future[Any], transfer: hub.Transfer, total: int) -> None:
        """While the transfer runs: a progress event a second; a cancel seen in the database stops it."""
        last: tuple[int, float] | None = None
        while not fetching.done():
            await asyncio.wait([fetching], timeout=PROGRESS_SECONDS)
            last = last or transfer.receiving  # the speed counts from the first byte received, not read
            if fetching.done() or last is None or transfer.bytes == last[0]:
                continue
            last_bytes, last_time = last
            now = time.monotonic()
            rate = round(max(0, transfer.bytes - last_bytes) / (now - last_time), 1)
            last = (transfer.bytes, now)
            # The bytes fsynced, not those received: what a restart continues from (a second behind at most).
            written = await self.bus.commit(self.store, _progress, task_id, min(transfer.synced, total), rate)
            if written is None and not transfer.stop:
                transfer.stop = "cancel"  # the task left `running`: a cancel was accepted


def _failure(exc: Exception) -> LmspError:
    if isinstance(exc, LmspError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return LmspError("insufficient_storage", "The disk filled up during the download: the partial file was "
                         "deleted. Free some space and ask again.")
    if isinstance(exc, OSError):
        return LmspError("download_failed", f"The file could not be written: {exc}")
    log.exception("download failed unexpectedly", exc_info=exc)
    return LmspError("internal_error", "An unexpected error stopped this download.")


def _remove(paths: list[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)


# Transactions: each runs on the writer thread and returns the events it wrote.

def _download(conn: sqlite3.Connection, task_id: str) -> sqlite3.Row:
    row: sqlite3.Row | None = conn.execute("SELECT * FROM downloads WHERE task_id = ?", (task_id,)).fetchone()
    assert row is not None
    return row


def create(conn: sqlite3.Connection, settings: dict[str, Any], client_id: str, remote: hub.Remote, task_id: str,
           request_id: str, free: int | None) -> dict[str, Any] | None:
    """A new queued download, within the limits on queued work and the disk's `free` bytes (None:
    the file is in the cache already) less what the downloads not yet ended still need: checked
    here, in the transaction, so that downloads asked for together cannot overrun it either. Its
    request row in `responses` carries who asked and when. The task as committed: the 202 says
    `queued` even when the downloader has already taken it by the time the answer is written."""
    if free is not None:
        promised = promised_bytes(conn)
        if free - promised < remote.size:
            raise LmspError("insufficient_storage", f"{remote.file} needs {remote.size / 1e6:,.0f} MB and the disk "
                            f"holding the hub cache has {free / 1e6:,.0f} MB free, {promised / 1e6:,.0f} MB of "
                            "which the downloads under way or queued still need.", param="file")
    now = time.time()
    limits.store_request(conn, settings, request_id, client_id, f"{remote.repo}/{remote.file}",
                         json.dumps({"repo": remote.repo, "file": remote.file, "revision": remote.revision}),
                         True, "{}", now)
    conn.execute("INSERT INTO tasks(id, response_id, status, on_restart, created_at, kind) "
                 "VALUES (?, ?, 'queued', 'resume', ?, 'download')", (task_id, request_id, now))
    conn.execute("INSERT INTO downloads(task_id, repo, file, revision, commit_hash, sha256, total_bytes, partial_path) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                 (task_id, remote.repo, remote.file, remote.revision, remote.commit, remote.sha256, remote.size,
                  str(hub.partial_path(remote, task_id))))
    return records.one_task(conn, task_id)


def promised_bytes(conn: sqlite3.Connection) -> int:
    """The bytes that the downloads not yet ended have still to write."""
    marks = ",".join("?" * len(TERMINAL))
    return int(conn.execute(f"SELECT COALESCE(SUM(MAX(d.total_bytes - d.bytes, 0)), 0) FROM downloads d JOIN tasks t "
                            f"ON t.id = d.task_id WHERE t.status NOT IN ({marks})", TERMINAL).fetchone()[0])


def unfinished(conn: sqlite3.Connection, client_id: str, repo: str, file: str, revision: str) -> str | None:
    """The id of this client's download of the same file that has not ended, if any."""
    marks = ",".join("?" * len(TERMINAL))
    row = conn.execute(f"SELECT t.id FROM downloads d JOIN tasks t ON t.id = d.task_id JOIN responses r "
                       f"ON r.id = t.response_id WHERE d.repo = ? AND d.file = ? AND d.revision = ? "
                       f"AND r.client_id = ? AND t.status NOT IN ({marks})",
                       (repo, file, revision, client_id, *TERMINAL)).fetchone()
    return row["id"] if row else None


def _begin(conn: sqlite3.Connection, task_id: str, have: int, total: int) -> list[machine.Event] | None:
    conn.execute("UPDATE downloads SET bytes = ? WHERE task_id = ?", (have, task_id))
    row = _download(conn, task_id)
    started = {"repo": row["repo"], "file": row["file"], "bytes": have, "total_bytes": total}
    return machine.transition(conn, task_id, RUNNING, [("download.started", started)], started_at=time.time())


def _progress(conn: sqlite3.Connection, task_id: str, done: int, rate: float | None) -> list[machine.Event] | None:
    events = machine.record(conn, task_id, (RUNNING,), [] if rate is None else [
        ("download.progress", {"bytes": done, "total_bytes": _total(conn, task_id), "bytes_per_second": rate})])
    if events is not None:
        conn.execute("UPDATE downloads SET bytes = ?, bytes_per_second = ? WHERE task_id = ?", (done, rate, task_id))
    return events


def _synced(conn: sqlite3.Connection, task_id: str) -> int:
    return int(_download(conn, task_id)["bytes"])


def _total(conn: sqlite3.Connection, task_id: str) -> int:
    return int(conn.execute("SELECT total_bytes FROM downloads WHERE task_id = ?", (task_id,)).fetchone()[0])


def _verifying(conn: sqlite3.Connection, task_id: str, total: int) -> list[machine.Event] | None:
    events = machine.record(conn, task_id, (RUNNING,), [("download.verifying", {"bytes": total})])
    if events is not None:
        conn.execute("UPDATE downloads SET bytes = ? WHERE task_id = ?", (total, task_id))
    return events


def _complete(conn: sqlite3.Connection, task_id: str, found: models.ModelFile, suggested: str
              ) -> list[machine.Event] | None:
    """Register the model and end the task, together: a completed download always is a model,
    the downloading client's (a file registered before stays its registrant's)."""
    same_file = conn.execute("SELECT id, created_by FROM models WHERE path = ?", (found.path,)).fetchone()
    taken = conn.execute("SELECT 1 FROM models WHERE id = ?", (suggested,)).fetchone()
    model_id = same_file["id"] if same_file else (f"{suggested}-{found.digest[7:15]}" if taken else suggested)
    events = machine.transition(conn, task_id, COMPLETED, [("download.completed", {"model_id": model_id})],
                                finished_at=time.time())
    if events is None:
        return None
    creator = same_file["created_by"] if same_file else conn.execute(
        "SELECT r.client_id FROM tasks t JOIN responses r ON r.id = t.response_id WHERE t.id = ?",
        (task_id,)).fetchone()[0]
    models.insert(conn, model_id, found, creator, replace=True)
    conn.execute("UPDATE downloads SET model_id = ?, bytes_per_second = NULL WHERE task_id = ?", (model_id, task_id))
    return events


def _fail(conn: sqlite3.Connection, task_id: str, code: str, message: str) -> list[machine.Event] | None:
    error = {"code": code, "message": message}
    return machine.transition(conn, task_id, FAILED, [("download.failed", {"error": error})],
                              error_code=code, error_message=message, finished_at=time.time())


def _cancelled(conn: sqlite3.Connection, task_id: str) -> list[machine.Event] | None:
    return machine.transition(conn, task_id, CANCELLED, [("download.cancelled", {})],
                              only_from=(CANCELLING,), finished_at=time.time())


def request_cancel(conn: sqlite3.Connection, task_id: str) -> list[machine.Event] | None:
    """Accept a cancel atomically: queued ends at once, loading/running go to `cancelling`.
    None when the download has already ended."""
    events = machine.transition(conn, task_id, CANCELLED, [("download.cancelled", {})],
                                only_from=(QUEUED,), finished_at=time.time())
    if events is None:
        events = machine.transition(conn, task_id, CANCELLING, [("download.cancelling", {})])
    return events
