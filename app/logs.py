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
    for handler in handlers:
        handler.setFormatter(RedactingFormatter(FORMAT))
    logging.basicConfig(level=os.environ.get("LMSP_LOG_LEVEL", "INFO"), handlers=handlers, force=True)
    return file
