"""Ollama's names and durations (LMSP §15), for the surface that speaks Ollama's API.

Ollama names a model `name:tag` (`:latest` when none is given; Open WebUI adds it to a bare
name) and pulls Hugging Face files as `hf.co/owner/repo:QUANT`. Our models have ids; these
rules say which id an Ollama name means, and what name an id has there.
"""

from __future__ import annotations

import math
import re
import sqlite3
from typing import Any

from app.errors import InvalidRequest
from app.store.config import MAX_IDLE_SECONDS

LATEST = ":latest"
# What Ollama takes from the hub when no tag says which file: its default quantization.
DEFAULT_QUANT = "Q4_K_M"
HUB_NAME = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/([^/:\s]+/[^/:\s]+?)(?::([^/:\s]+))?\Z")
DURATION = re.compile(r"(-?[0-9.]+)(ns|us|µs|ms|s|m|h)")
# The longest `keep_alive` (a negative one aside): the idle setting's maximum, a year.
MAX_KEEP_ALIVE = MAX_IDLE_SECONDS
MAX_DURATION = 64  # characters: "8760h", "1h30m15.5s"
UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def ollama_name(model_id: str) -> str:
    """The name an Ollama app sees: the id, with `:latest` when it has no tag."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else model_id + LATEST


def _spellings(name: str) -> list[str]:
    if name.endswith(LATEST):
        return [name, name[:-len(LATEST)]]
    return [name] if ":" in name else [name, name + LATEST]


def resolve(conn: sqlite3.Connection, name: str) -> str | None:
    """The id of the model an Ollama `name` means: itself, with or without `:latest`, or the model a
    download of that hub name became (`hf.co/owner/repo:Q8_0`). None if there is none."""
    for spelling in _spellings(name):
        if conn.execute("SELECT 1 FROM models WHERE id = ?", (spelling,)).fetchone():
            return spelling
    hub = HUB_NAME.match(name)
    if hub is None:
        return None
    rows = conn.execute("SELECT d.file, d.model_id FROM downloads d JOIN models m ON m.id = d.model_id "
                        "WHERE d.repo = ? ORDER BY d.task_id", (hub[1],)).fetchall()
    chosen = choose_file([r["file"] for r in rows], hub[2])
    return next((r["model_id"] for r in rows if r["file"] == chosen), None)


def hub_file(name: Any) -> tuple[str, str | None]:
    """(repository, tag) of a name Ollama pulls from Hugging Face, or a 400: Ollama's own library
    is not a place this service downloads from."""
    hub = HUB_NAME.match(name) if isinstance(name, str) else None
    if hub is None:
        raise InvalidRequest(f"Only Hugging Face models can be pulled here, named hf.co/owner/repo[:quantization]; "
                             f"not {name!r}.", param="model")
    return hub[1], hub[2]


def choose_file(files: list[str], tag: str | None) -> str | None:
    """The GGUF file of a repository a tag means, as Ollama picks it: the file whose name has the
    tag (a quantization, any case); without a tag (or `latest`), Q4_K_M, else the only file."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    wanted = DEFAULT_QUANT if tag in (None, "latest") else tag
    named = [f for f in ggufs if wanted.lower() in f.rsplit("/", 1)[-1].lower()]
    if named:
        return named[0]
    return ggufs[0] if len(ggufs) == 1 and tag in (None, "latest") else None


def keep_alive(value: Any) -> float | None:
    """Ollama's `keep_alive` in seconds: a number of seconds or a duration ("5m", "1h30m", "-1");
    None when not given. 0 unloads the model after the request; a negative value keeps it until it
    is unloaded. Anything else must be finite and at most the idle setting's maximum (a year): a
    time past it could not be written as a date (`/api/ps`), and NaN would never come."""
    if value is None:
        return None
    seconds = _seconds(value)
    if seconds is None or not -math.inf < seconds <= MAX_KEEP_ALIVE:  # NaN fails every comparison
        raise InvalidRequest(f"`keep_alive` must be seconds or a duration such as \"5m\", finite and at most "
                             f"{MAX_KEEP_ALIVE // 86400} days (\"{MAX_KEEP_ALIVE // 3600}h\"); 0 unloads the model, "
                             "a negative value keeps it until it is unloaded.", param="keep_alive")
    return seconds


def _seconds(value: Any) -> float | None:
    """A number of seconds, or a string of one or of a duration, as a float; None if it is neither."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer past any float
            return None
    if not isinstance(value, str) or len(value) > MAX_DURATION:  # the pattern's scan of a long one is quadratic
        return None
    text = value.strip()
    try:
        return float(text)  # seconds, written as a string
    except ValueError:
        pass
    parts = DURATION.findall(text)
    if parts and "".join(n + u for n, u in parts) == text:
        try:
            return sum(float(n) * UNIT_SECONDS[u] for n, u in parts)
        except ValueError:
            pass
    return None


# Ollama's default allowed origins (its OLLAMA_ORIGINS defaults): pages on this computer at any port,
# and the desktop and editor shells its apps run in.
OLLAMA_ORIGIN = re.compile(r"^(?:https?://(?:localhost|127\.0\.0\.1|0\.0\.0\.0)(?::[0-9]{1,5})?"
                           r"|(?:app|file|tauri|vscode-webview|vscode-file)://.*)\Z")


def is_ollama_path(path: str) -> bool:
    """A path of Ollama's API: `/` (its "Ollama is running") and everything under `/api/`."""
    return path == "/" or path.startswith("/api/")


def default_origin(path: str, origin: str) -> bool:
    """Whether a request to `path` from `origin` is allowed without being in `allowed_origins`."""
    return is_ollama_path(path) and OLLAMA_ORIGIN.match(origin) is not None
