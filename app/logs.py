"""Logging: a rotating file in the per-user log folder, and no token ever written to it."""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import sys
from pathlib import Path

from app import paths

TOKEN = re.compile(r"lmsp_[A-Za-z0-9_\-]{8,}")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class Redact(logging.Filter):
    """Blanks anything shaped like a token, whatever module logged it and however."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if TOKEN.search(message):
            record.msg, record.args = TOKEN.sub("lmsp_[redacted]", message), None
        return True


def log_dir(data_dir: Path, explicit_data_dir: bool) -> Path:
    """With an explicit data folder, its logs live beside its state; else the platform's place."""
    if explicit_data_dir:
        return data_dir / "logs"
    return paths.default_log_dir()


def setup(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "lmsp-tray.log"
    redact = Redact()
    handlers: list[logging.Handler] = [
        logging.handlers.RotatingFileHandler(file, maxBytes=2_000_000, backupCount=5, encoding="utf-8"),
        logging.StreamHandler(sys.stderr)]
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(redact)
    logging.basicConfig(level=os.environ.get("LMSP_LOG_LEVEL", "INFO"), handlers=handlers, force=True)
    return file
