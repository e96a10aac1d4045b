"""Logging: a rotating file in the per-user log folder, no token ever written to it, and no flood."""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import sys
import time
from pathlib import Path

from app import paths
from app.secrets import make_private

# A token, also when a stray byte inside it is escaped in a repr (`\x7f`, `\x00`).
TOKEN = re.compile(r"lmsp_(?:[A-Za-z0-9_\-]|\\x[0-9a-fA-F]{2})+")
# Whatever follows "Bearer": the token of a malformed header, quoted or cut however a parser does it.
BEARER = re.compile(r"(?i)(bearer\s+)\S+")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def log_dir(data_dir: Path, explicit_data_dir: bool) -> Path:
    """With an explicit data folder, its logs live beside its state; else the platform's place."""
    if explicit_data_dir:
        return data_dir / "logs"
    return paths.default_log_dir()


def setup(folder: Path) -> Path:
    make_private(folder)
    file = folder / "lmsp-tray.log"
    handlers: list[logging.Handler] = [
        logging.handlers.RotatingFileHandler(file, maxBytes=2_000_000, backupCount=5, encoding="utf-8"),
        logging.StreamHandler(sys.stderr)]
    throttle = Throttle()
    for handler in handlers:
        handler.setFormatter(RedactingFormatter(FORMAT))
        handler.addFilter(throttle)
    logging.basicConfig(level=os.environ.get("LMSP_LOG_LEVEL", "INFO"), handlers=handlers, force=True)
    return file
