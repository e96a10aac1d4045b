"""Getting models from the Hugging Face hub (LMSP §13): asking for a download, listing a repository."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.core.auth import Client
from app.core.ids import new_id
from app.engine.net import hub
from app.errors import InvalidRequest
from app.secrets import hub_token
from app.store.store import Store
from app.tasks import records
from app.tasks.kinds import download as downloads


def _parse(body: Any) -> tuple[str, str, str]:
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object with `repo` and `file`.")
    unknown = sorted(set(body) - {"repo", "file", "revision"})
    if unknown:
        raise InvalidRequest(f"Unknown parameter {unknown[0]!r}.", param=unknown[0])
    file = body.get("file")
    if (not isinstance(file, str) or not file.lower().endswith(".gguf") or file.startswith("/")
            or ".." in file.split("/") or any(ord(c) < 32 or c == "\x7f" for c in file)):
        raise InvalidRequest("`file` must be the path of a .gguf file in the repository.", param="file")
    return hub.check_repo(body.get("repo")), file, hub.check_revision(body.get("revision", "main"))


def free_bytes(folder: Path) -> int:
    """Free space where `folder` is (or would be: its nearest existing parent)."""
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return shutil.disk_usage(folder).free


class Downloads:
    def __init__(self, store: Store, settings: Mapping[str, Any], transfers: downloads.Downloads) -> None:
        self.store = store
        self.settings = settings
        self.transfers = transfers  # the task kind that runs them

    async def create_download(self, client: Client, body: Any) -> dict[str, Any]:
        """Ask the hub about the file, check the disk, and commit a queued download task. The
        same file already downloading for this client answers with that task instead."""
        repo, file, revision = _parse(body)
        task_id = await self.store.read(downloads.unfinished, client.id, repo, file, revision)
        if task_id is None:
            remote = await asyncio.to_thread(hub.describe, repo, file, revision, await asyncio.to_thread(hub_token))
            cached = await asyncio.to_thread(hub.blob_path(remote).exists)
            free = None if cached else await asyncio.to_thread(free_bytes, hub.storage(repo))
            row = await self.store.write(downloads.create, dict(self.settings), client.id, remote, new_id("task"),
                                         new_id("dl"), free)
            self.transfers.wake()
        else:
            row = await self.store.read(records.one_task, task_id)
        assert row is not None  # committed just now, or an unfinished task (retention keeps those)
        return records.task_object(row)

    async def hub_files(self, repo: Any, revision: Any = "main") -> list[dict[str, Any]]:
        """A hub repository's GGUF files with their sizes."""
        token = await asyncio.to_thread(hub_token)
        return await asyncio.to_thread(hub.gguf_files, hub.check_repo(repo), hub.check_revision(revision), token)
