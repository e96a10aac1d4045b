"""Logging: a rotating file in the per-user log folder, no token ever written to it, and no flood.

Records are written on threads of their own (`Detached`), never on the event loop that the GUI
and the server share: a parent that starts the app with stderr on a pipe it never reads (a
launcher, a script) fills that pipe after some 270 tasks, and a write to stderr on the loop then
stopped the whole app. Now only that pipe's thread waits; the log file goes on.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import re
import threading
import time
from pathlib import Path

from app import paths
from app.secrets import make_private

# A token, also when a stray byte inside it is escaped in a repr (`\x7f`, `\x00`).
TOKEN = re.compile(r"lmsp_(?:[A-Za-z0-9_\-]|\\x[0-9a-fA-F]{2})+")
# Whatever follows "Bearer": the token of a malformed header, quoted or cut however a parser does it.
BEARER = re.compile(r"(?i)(bearer\s+)\S+")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The HTTP client of remote endpoints and downloads: at INFO it logs every URL it fetches, the
# hub's signed CDN links among them, and each endpoint probe every 30 s.
QUIET = ("httpx2", "httpcore2")
LOG_FILE = "lmsp-tray.log"  # in the log folder (log_dir); `lmsp-tray logs` reads it


def redact(text: str) -> str:
    return BEARER.sub(r"\1[redacted]", TOKEN.sub("lmsp_[redacted]", text))


class RedactingFormatter(logging.Formatter):
    """Redacts the whole record as written: the message, and the traceback and stack the formatter
    appends (aiohttp puts the raw header line of a malformed request in its exception), whatever
    module logged it and however."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class Throttle(logging.Filter):
    """The same warning or error (logger, level, first line of the format) at most `burst` times
    a `window`; the first one after a quiet spell says how many were dropped. Under file-descriptor
    exhaustion asyncio's accept loop logs one error per failed accept(), tens of thousands a
    second, which would rotate the whole log history away in seconds. Routine INFO lines of a busy
    service are never dropped."""

    def __init__(self, burst: int = 20, window: float = 60.0) -> None:
        super().__init__()
        self.burst, self.window = burst, window
        self.seen: dict[tuple[str, int, str], list[float]] = {}  # key -> [window start, count]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        verdict = getattr(record, "lmsp_throttle", None)  # one decision per record, however many handlers
        if verdict is None:
            verdict = record.lmsp_throttle = self._admit(record)
        return bool(verdict)

    def _admit(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0])
        start, count = self.seen.get(key, (now, 0))
        if now - start > self.window:
            if count > self.burst:
                record.msg = f"{record.msg} ({count - self.burst} more like this were not logged)"
            start, count = now, 0
            if len(self.seen) > 1000:  # forget keys whose window is over
                self.seen = {k: v for k, v in self.seen.items() if now - v[0] <= self.window}
        self.seen[key] = [start, count + 1]
        return count < self.burst


class Detached(logging.Handler):
    """Hands each record, formatted and redacted here, to `target` on a thread of its own. At most
    `limit` wait: beyond that (a pipe nobody reads) records for this target are dropped, not held
    in memory without end, and counted in the first line that finds room again. `flush` and
    `close` (logging does both at exit) wait for what is queued, but not forever."""

    def __init__(self, target: logging.Handler, limit: int = 10_000, patience: float = 1.0) -> None:
        super().__init__()
        self.setFormatter(RedactingFormatter(FORMAT))
        target.setFormatter(logging.Formatter("%(message)s"))
        self.target, self.patience = target, patience
        self.dropped = 0  # records that found the queue full since the last one that did not
        self.queue: queue.Queue[logging.LogRecord | None] = queue.Queue(limit)
        self.thread = threading.Thread(target=self._write, name="lmsp-log", daemon=True)
        self.thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        if self.dropped:  # room again: say first how many did not fit
            note = logging.LogRecord(__name__, logging.WARNING, __file__, 0, "%d log lines were not written here: "
                                     "they came faster than they could be", (self.dropped,), None)
            if not self._offer(note):
                self.dropped += 1
                return
            self.dropped = 0
        if not self._offer(record):
            self.dropped += 1

    def _offer(self, record: logging.LogRecord) -> bool:
        # Formatted now: its arguments may change once the caller goes on; a copy, as other
        # handlers see the record too.
        line = logging.makeLogRecord({**record.__dict__, "msg": self.format(record), "args": None,
                                      "exc_info": None, "exc_text": None, "stack_info": None})
        try:
            self.queue.put_nowait(line)
        except queue.Full:
            return False
        return True

    def _write(self) -> None:
        while (record := self.queue.get()) is not None:
            self.target.handle(record)
            self.queue.task_done()
        self.queue.task_done()

    def flush(self) -> None:
        with self.queue.all_tasks_done:
            self.queue.all_tasks_done.wait_for(lambda: not self.queue.unfinished_tasks, self.patience)
        self.target.flush()

    def close(self) -> None:
        if self.thread.is_alive():
            try:
                self.queue.put(None, timeout=self.patience)
            except queue.Full:
                pass
            else:
                self.thread.join(self.patience)
        self.target.close()
        super().close()


class Stderr(logging.Handler):
    """Lines to file descriptor 2, with no lock and no buffer shared with the rest of the process:
    when nobody reads that pipe, only the thread writing here waits. (A StreamHandler's lock, and
    sys.stderr's buffer, would make logging's shutdown and Python's exit wait for it forever.)"""

    def createLock(self) -> None:
        self.lock = None  # only its Detached thread writes here

    def emit(self, record: logging.LogRecord) -> None:
        data = (self.format(record) + "\n").encode("utf-8", "replace")
        while data:
            data = data[os.write(2, data):]


def log_dir(data_dir: Path, explicit_data_dir: bool) -> Path:
    """With an explicit data folder, its logs live beside its state; else the platform's place."""
    if explicit_data_dir:
        return data_dir / "logs"
    return paths.default_log_dir()


def setup(folder: Path) -> Path:
    make_private(folder)
    file = folder / LOG_FILE
    # One thread each: a stderr nobody reads must not hold up the file.
    handlers: list[logging.Handler] = [
        Detached(logging.handlers.RotatingFileHandler(file, maxBytes=2_000_000, backupCount=5, encoding="utf-8")),
        Detached(Stderr())]
    throttle = Throttle()
    for handler in handlers:
        handler.addFilter(throttle)
    logging.basicConfig(level=os.environ.get("LMSP_LOG_LEVEL", "INFO"), handlers=handlers, force=True)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    return file
