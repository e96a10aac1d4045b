"""The model registry (LMSP §4): metadata and digests in the database, files where they are."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from app.engine.registry import gguf
from app.errors import Conflict, InvalidRequest, LmspError, NotFound

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")  # \Z: "$" would let "id\n" through
DIGEST_CHECK_BYTES = 256 * 1024 * 1024  # files up to this size are hashed again before each load
PROJECTOR_PREFIX = "mmproj"  # how a vision projector beside its model is named (`projector`)


@dataclass(frozen=True)
class ModelFile:
    """What registering a file found out, before anything is written."""
    path: str
    size_bytes: int
    mtime_ns: int
    digest: str
    info: gguf.GgufInfo
    device: int  # with `inode`: which file the path led to, whatever links led there
    inode: int
    projector: str | None = None  # the vision projector it is loaded with (`projector`)


# The context a model runs with: its trained one, up to this. llama.cpp allocates the KV cache for
# all of it when it loads the model; 4096 is what Ollama and LM Studio give by default too.
CONTEXT = 4096


def context_length(trained: int | None) -> int:
    return min(trained or CONTEXT, CONTEXT)


@dataclass(frozen=True)
class Registered:
    """What loading a model needs: its path, and what the file validated at registration was."""
    path: str
    digest: str
    size_bytes: int
    mtime_ns: int
    device: int | None  # None for a model registered before they were recorded
    inode: int | None
    context_length: int = CONTEXT
    projector: str | None = None  # its vision projector's path: llama-server's `--mmproj`


class FileChanged(Exception):
    """The file at a model's path is not the one that was validated and hashed at registration."""


def registered(row: sqlite3.Row) -> Registered:
    return Registered(row["path"], row["digest"], row["size_bytes"], row["mtime_ns"], row["device"], row["inode"],
                      context_length(row["context_length"]), json.loads(row["metadata"] or "{}").get("projector"))


def is_projector(path: Path) -> bool:
    """Whether `path` is a GGUF vision projector llama.cpp loads with `--mmproj` (a `clip` file
    with a vision encoder). Blocking: it reads the file's header."""
    try:
        info = gguf.inspect(path)
    except gguf.GgufError:
        return False
    return info.architecture == "clip" and info.metadata.get("clip.has_vision_encoder") is True


def projector(model: Path, given: str | None) -> str | None:
    """The vision projector a model is registered with: `given` (an absolute path; InvalidRequest
    if it is not one), else a file beside the model named `mmproj*.gguf` (LM Studio's layout, and
    llama.cpp's own router's), the first by name that is one; None for a model that reads text."""
    if given is not None:
        path = Path(given)
        if not path.is_absolute() or not is_projector(path):
            raise InvalidRequest(f"{given} is not a vision projector (a GGUF file of llama.cpp's `clip` kind, as "
                                 "an `mmproj-*.gguf` is), given by its absolute path.", param="projector",
                                 code="invalid_model_file")
        return str(path)
    try:
        beside = sorted(p for p in model.parent.iterdir() if p.name.lower().startswith(PROJECTOR_PREFIX)
                        and p.name.lower().endswith(".gguf") and p.is_file())
    except OSError:
        return None
    return next((str(p) for p in beside if is_projector(p)), None)


def sha256_file(path: Path, progress: Callable[[int, int], None] | None = None,
                cancel: threading.Event | None = None) -> str:
    with path.open("rb") as fh:
        return _sha256(fh, progress, cancel)


def _sha256(fh: BinaryIO, progress: Callable[[int, int], None] | None = None,
            cancel: threading.Event | None = None) -> str:
    """The digest of an open file from where it stands to its end."""
    h = hashlib.sha256()
    total = os.fstat(fh.fileno()).st_size
    done = 0
    while chunk := fh.read(1 << 20):
        if cancel is not None and cancel.is_set():  # 40 GiB take minutes: nobody may be waiting
            raise gguf.Cancelled()
        h.update(chunk)
        done += len(chunk)
        if progress:
            progress(done, total)
    return "sha256:" + h.hexdigest()


def examine(path_text: str, progress: Callable[[int, int], None] | None = None,
            cancel: threading.Event | None = None, digest: str | None = None,
            projector_path: str | None = None) -> ModelFile:
    """Validate and hash a model file (unless its `digest` is already known, as a verified
    download's is), and find its vision projector (`projector`). Blocking: run it off the event
    loop. Raises gguf.Cancelled soon after `cancel` is set."""
    path = Path(path_text)
    if not path.is_absolute():
        raise InvalidRequest("The model path must be absolute.", param="path")
    if not path.is_file():
        raise InvalidRequest(f"No file at {path}.", param="path", code="model_file_not_found")
    vision = projector(path, projector_path)  # before the hash: a bad one given is refused at once
    # One open for the check and the hash: the bytes validated are the bytes hashed, and the file
    # recorded (device, inode) is the one they came from, whatever the path points at later.
    try:
        with path.open("rb") as fh:
            before = os.fstat(fh.fileno())
            info = gguf.read(fh, cancel)
            fh.seek(0)
            digest = digest or _sha256(fh, progress, cancel)
            after = os.fstat(fh.fileno())
    except (gguf.GgufError, OSError) as exc:
        raise InvalidRequest(f"{path.name} is not a usable GGUF model: {exc}", param="path",
                             code="invalid_model_file") from exc
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise InvalidRequest(f"{path.name} changed while it was being read; try again when it is complete.",
                             param="path", code="invalid_model_file")
    return ModelFile(str(path), after.st_size, after.st_mtime_ns, digest, info, after.st_dev, after.st_ino, vision)


def open_verified(file: Registered) -> tuple[int, str]:
    """Open a model's file for loading, checking that it is still the file validated at
    registration: device and inode, size and mtime, and the digest when that costs little.
    Returns the open descriptor and a path naming exactly that open file where the system has
    one, so that llama.cpp reads the file checked here even if `path` is re-pointed meanwhile.
    The caller closes the descriptor. Raises FileChanged."""
    # Bytes as they are (Windows translates line ends without O_BINARY); a FIFO put there must not block.
    fd = os.open(file.path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        recorded = (file.size_bytes, file.mtime_ns, file.device, file.inode)
        found = (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)
        if any(want is not None and want != have for want, have in zip(recorded, found)):
            raise FileChanged(f"{file.path} is no longer the file that was registered (another file, or "
                              "changed since); register it again to use it.")
        if st.st_size <= DIGEST_CHECK_BYTES:
            with open(fd, "rb", closefd=False) as fh:
                if _sha256(fh) != file.digest:
                    raise FileChanged(f"The content of {file.path} changed since it was registered (its sha256 "
                                      "differs); register it again to use it.")
        by_fd = next((p for p in (f"/proc/self/fd/{fd}", f"/dev/fd/{fd}") if os.path.exists(p)), file.path)
    except BaseException:
        os.close(fd)
        raise
    return fd, by_fd


def suggest_id(path: str) -> str:
    """An id from the file name: `SmolLM2-135M-Instruct.Q4_1.gguf` -> `smollm2-135m-instruct.q4_1`."""
    stem = Path(path).stem if path.endswith(".gguf") else path
    stem = re.sub(r"[^A-Za-z0-9._:-]+", "-", stem).strip("-._:").lower()
    return (stem or "model")[:128]


def insert(conn: sqlite3.Connection, model_id: str, found: ModelFile, created_by: str, replace: bool = False) -> None:
    """Register `found` as `model_id`, on behalf of the client `created_by`."""
    if not ID_PATTERN.match(model_id):
        raise InvalidRequest("A model id is 1-128 letters, digits and . _ : -", param="id")
    if conn.execute("SELECT 1 FROM models WHERE id = ?", (model_id,)).fetchone():
        if not replace:
            raise Conflict("model_exists", f"A model with id {model_id!r} is already registered.")
        conn.execute("DELETE FROM models WHERE id = ?", (model_id,))
    meta = {"architecture": found.info.architecture, "name": found.info.name,
            "has_chat_template": found.info.has_chat_template, **({"projector": found.projector} if found.projector
                                                                  else {})}
    conn.execute("INSERT INTO models(id, path, size_bytes, mtime_ns, digest, context_length, metadata, created_at, "
                 "device, inode, created_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                 (model_id, found.path, found.size_bytes, found.mtime_ns, found.digest,
                  found.info.context_length, json.dumps(meta), time.time(), found.device, found.inode, created_by))


def file_status(row: sqlite3.Row) -> str:
    """`available`, `missing`, or `changed`: the path leads to another file (device, inode) than the
    one registered, or its size or mtime differ."""
    try:
        stat = Path(row["path"]).stat()
    except OSError:
        return "missing"
    if stat.st_size != row["size_bytes"] or stat.st_mtime_ns != row["mtime_ns"] or (
            row["inode"] is not None and (stat.st_dev, stat.st_ino) != (row["device"], row["inode"])):
        return "changed"
    return "available"


def get(conn: sqlite3.Connection, model_id: str) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM models WHERE id = ?", (model_id,)).fetchone()
    if row is None:
        raise NotFound("model", model_id)
    return row


def usable(conn: sqlite3.Connection, model_id: str) -> sqlite3.Row:
    """The model's row if its file is there and unchanged (or it is remote); a clear error otherwise."""
    row = get(conn, model_id)
    if row["format"] == "remote":
        return row
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
            "status": status, "context_length": context_length(row["context_length"]),
            "trained_context_length": row["context_length"], **json.loads(row["metadata"])}
