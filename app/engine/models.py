"""The model registry (LMSP §4): metadata and digests in the database, files where they are."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from app.engine import gguf
from app.errors import Conflict, InvalidRequest, LmspError, NotFound

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")  # \Z: "$" would let "id\n" through


@dataclass(frozen=True)
class ModelFile:
    """What registering a file found out, before anything is written."""
    path: str
    size_bytes: int
    mtime_ns: int
    digest: str
    info: gguf.GgufInfo


def sha256_file(path: Path, progress: Callable[[int, int], None] | None = None,
                cancel: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            if cancel is not None and cancel.is_set():  # 40 GiB take minutes: nobody may be waiting
                raise gguf.Cancelled()
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return "sha256:" + h.hexdigest()


def examine(path_text: str, progress: Callable[[int, int], None] | None = None,
            cancel: threading.Event | None = None, digest: str | None = None) -> ModelFile:
    """Validate and hash a model file (unless its `digest` is already known, as a verified
    download's is). Blocking: run it off the event loop. Raises gguf.Cancelled soon after
    `cancel` is set."""
    path = Path(path_text)
    if not path.is_absolute():
        raise InvalidRequest("The model path must be absolute.", param="path")
    if not path.is_file():
        raise InvalidRequest(f"No file at {path}.", param="path", code="model_file_not_found")
    try:
        info = gguf.inspect(path, cancel)
    except gguf.GgufError as exc:
        raise InvalidRequest(f"{path.name} is not a usable GGUF model: {exc}", param="path",
                             code="invalid_model_file") from exc
    stat = path.stat()
    return ModelFile(str(path), stat.st_size, stat.st_mtime_ns, digest or sha256_file(path, progress, cancel), info)


def suggest_id(path: str) -> str:
    """An id from the file name: `SmolLM2-135M-Instruct.Q4_1.gguf` -> `smollm2-135m-instruct.q4_1`."""
    stem = Path(path).stem if path.endswith(".gguf") else path
    stem = re.sub(r"[^A-Za-z0-9._:-]+", "-", stem).strip("-._:").lower()
    return (stem or "model")[:128]


def insert(conn: sqlite3.Connection, model_id: str, found: ModelFile, replace: bool = False) -> None:
    if not ID_PATTERN.match(model_id):
        raise InvalidRequest("A model id is 1-128 letters, digits and . _ : -", param="id")
    if conn.execute("SELECT 1 FROM models WHERE id = ?", (model_id,)).fetchone():
        if not replace:
            raise Conflict("model_exists", f"A model with id {model_id!r} is already registered.")
        conn.execute("DELETE FROM models WHERE id = ?", (model_id,))
    meta = {"architecture": found.info.architecture, "name": found.info.name,
            "has_chat_template": found.info.has_chat_template}
    conn.execute("INSERT INTO models(id, path, size_bytes, mtime_ns, digest, context_length, metadata, created_at) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                 (model_id, found.path, found.size_bytes, found.mtime_ns, found.digest,
                  found.info.context_length, json.dumps(meta), time.time()))


def file_status(row: sqlite3.Row) -> str:
    """`available`, `missing`, or `changed` (size or mtime differ from what was registered)."""
    try:
        stat = Path(row["path"]).stat()
    except OSError:
        return "missing"
    if stat.st_size != row["size_bytes"] or stat.st_mtime_ns != row["mtime_ns"]:
        return "changed"
    return "available"


def get(conn: sqlite3.Connection, model_id: str) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM models WHERE id = ?", (model_id,)).fetchone()
    if row is None:
        raise NotFound("model", model_id)
    return row


def usable(conn: sqlite3.Connection, model_id: str) -> sqlite3.Row:
    """The model's row if its file is there and unchanged; a clear error otherwise."""
    row = get(conn, model_id)
    status = file_status(row)
    if status == "missing":
        raise LmspError("model_missing", f"The file of model {model_id!r} is gone: {row['path']}.", status=409)
    if status == "changed":
        raise LmspError("model_changed", f"The file of model {model_id!r} changed on disk since it was "
                        "registered; register it again to use it.", status=409)
    return row


def model_object(row: sqlite3.Row, loaded_paths: set[str]) -> dict[str, Any]:
    status = file_status(row)
    if status == "available" and row["path"] in loaded_paths:
        status = "loaded"
    return {"id": row["id"], "object": "model", "created": int(row["created_at"]), "owned_by": "local",
            "format": "gguf", "path": row["path"], "size_bytes": row["size_bytes"], "digest": row["digest"],
            "status": status, "context_length": row["context_length"], **json.loads(row["metadata"])}
