"""The Hugging Face hub, through `huggingface_hub`: a file's metadata, a repository's GGUF files,
and a transfer into the hub's own cache (`HF_HOME`/hub) that survives a kill and is verified.

The library does the HTTP (its URL and metadata helpers, its `http_get` with Range resume and
retries, its list API, its token handling: `HF_TOKEN` and the saved login). Three parts are ours,
each because `hf_hub_download` (2.4) cannot serve a durable task:

- Resume across processes: it downloads to `<blob>.<uuid>.incomplete` and deletes that file on
  failure; a killed process leaves it under a name no later call reuses. We keep the partial file
  at a path of our own, remembered in the task, and hand `http_get` the bytes already there
  (`resume_size`: an HTTP Range request).
- The digest: it checks a plain HTTP download by size only. We hash while writing and compare
  with the LFS sha256 the hub announces (`X-Linked-Etag`) before the blob enters the cache.
- Progress and stopping: it reports through tqdm and cannot be stopped; `Transfer.bar` is a
  tqdm stand-in that counts bytes for the task and raises to stop (cancel, shutdown).

The finished file is placed exactly where the library puts it (blobs/<sha256>, the snapshot
symlink, refs/<revision>), the symlink with the library's own writer, so `hf_hub_download(...,
local_files_only=True)`, other tools, and our own discovery find it.

Blocking: run everything here off the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast
from urllib.parse import urlparse

import httpx2
from huggingface_hub import HfApi, RepoFile, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import (
    _create_symlink,
    _get_pointer_path,
    http_get,
    repo_folder_name,
)
from huggingface_hub.utils import build_hf_headers, validate_repo_id

from app import durable
from app.engine.registry import discovery
from app.errors import LmspError

# `http_get` reads the response in chunks of this size (10 MiB by default): the unit in which a
# transfer reaches the disk, reports progress and sees a stop. 10 MiB would be what a kill loses
# and how long a cancel can wait on a slow line; 256 KiB costs no measurable speed.
constants.DOWNLOAD_CHUNK_SIZE = 256 * 1024

SHA256 = re.compile(r"[0-9a-f]{64}\Z")
SYNC_SECONDS = 1.0  # a download fsyncs its bytes this often: what a restart may continue from
REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")
COMMIT = re.compile(r"[0-9a-f]{40}\Z")
# What `git check-ref-format` refuses anywhere in a ref name: control characters, space, ~ ^ : ? * [ \,
# "..", "@{". A revision names a folder of the cache (refs/<revision>): these rules keep it there.
REF_REFUSED = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{")


@dataclass(frozen=True)
class Remote:
    """One file of one revision, as the hub describes it."""
    repo: str
    file: str
    revision: str
    commit: str       # the commit `revision` pointed at
    sha256: str       # the LFS digest: the blob's name in the cache, and what the bytes must hash to
    size: int
    url: str          # where the bytes are (the hub, or the CDN it redirects to)


class Stopped(Exception):
    """Raised inside a transfer to stop it: `reason` is "cancel" or "shutdown"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def endpoint() -> str | None:
    # Read per call: the library reads HF_ENDPOINT once, when it is first imported.
    return os.environ.get("HF_ENDPOINT") or None


def storage(repo: str) -> Path:
    return discovery.hub_cache() / repo_folder_name(repo_id=repo, repo_type="model")


def blob_path(remote: Remote) -> Path:
    return storage(remote.repo) / "blobs" / remote.sha256


def pointer_path(remote: Remote) -> Path:
    """snapshots/<commit>/<file>, through the library's guard: a ValueError if it would leave snapshots/."""
    return Path(_get_pointer_path(str(storage(remote.repo)), remote.commit, remote.file))


def partial_path(remote: Remote, task_id: str) -> Path:
    """Beside the blob (same filesystem: the final move is a rename), named for the task."""
    return storage(remote.repo) / "blobs" / f"{remote.sha256}.{task_id}.incomplete"


def check_repo(repo: Any) -> str:
    """Our shape (owner/name), then the library's own rules for a repo id (length, no '.' at an end...)."""
    try:
        if not isinstance(repo, str) or not REPO.match(repo):
            raise HFValidationError("not owner/name")
        validate_repo_id(repo)
    except HFValidationError as exc:
        raise LmspError("invalid_request", "`repo` must be a hub repository id like owner/name.",
                        param="repo") from exc
    return repo


def check_revision(revision: Any) -> str:
    """A git ref name (`git check-ref-format`'s rules): a branch, a tag, refs/pr/1 or a commit. It
    becomes a path in the cache, so "../x", "/x", "a//b" and ".hidden" are refused, not cleaned."""
    if (not isinstance(revision, str) or not 0 < len(revision) <= 255 or REF_REFUSED.search(revision)
            or revision == "@" or revision.endswith(".")
            or not all(part and not part.startswith(".") and not part.endswith(".lock")
                       for part in revision.split("/"))):
        raise LmspError("invalid_request", "`revision` must be a branch, tag or commit (a git ref name: no "
                        "\"..\", no leading or trailing \"/\", no spaces or \\ ~ ^ : ? * [).", param="revision")
    return revision


def _hub_error(exc: Exception, what: str) -> LmspError:
    """The library's errors, as our clear ones."""
    if isinstance(exc, GatedRepoError):
        return LmspError("hub_access_denied", f"{what} is gated: accept its terms on the hub and set a hub token.",
                         status=403)
    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError)):
        return LmspError("not_found", f"The hub has no {what} (or it is private and needs a hub token).",
                         status=404)
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 502
        if status == 404:
            return LmspError("not_found", f"The hub has no {what}.", status=404)
        if status in (401, 403):
            return LmspError("hub_access_denied", f"The hub refused {what}: a hub token with access to it is "
                             "needed.", status=403)
        return LmspError("hub_unavailable", f"The hub answered {status} for {what}.", status=502)
    return LmspError("hub_unreachable", f"The hub could not be reached for {what}: {exc}", status=502)


def describe(repo: str, file: str, revision: str, token: str | None) -> Remote:
    """The file's commit, LFS sha256, size and download location (one HEAD request)."""
    url = hf_hub_url(repo, file, revision=revision, endpoint=endpoint())
    try:
        meta = get_hf_file_metadata(url, token=token, endpoint=endpoint())
    except httpx2.HTTPError as exc:
        raise _hub_error(exc, f"{repo}/{file} at {revision}") from exc
    if not meta.commit_hash or not meta.location:
        raise LmspError("hub_unavailable", f"{endpoint() or 'The hub'} did not answer like a Hugging Face hub.",
                        status=502)
    if not COMMIT.match(meta.commit_hash):  # it names a folder of the cache: never a path of the hub's choosing
        raise LmspError("hub_invalid_answer", f"{endpoint() or 'The hub'} gave {repo}/{file} a commit that is not "
                        f"40 hexadecimal characters ({meta.commit_hash[:60]!r}): nothing was downloaded.", status=502)
    if not meta.etag or not SHA256.match(meta.etag) or not meta.size:
        raise LmspError("digest_unavailable", f"{file} is not stored with Git LFS: the hub gives no sha256 to "
                        "verify it against, so it is not downloaded.", param="file")
    return Remote(repo, file, revision, meta.commit_hash, meta.etag, meta.size, meta.location)


def gguf_files(repo: str, revision: str, token: str | None) -> list[dict[str, Any]]:
    """The repository's GGUF files with their sizes, in path order."""
    try:
        tree = list(HfApi(endpoint=endpoint()).list_repo_tree(repo, recursive=True, revision=revision, token=token))
    except httpx2.HTTPError as exc:
        raise _hub_error(exc, f"repository {repo}") from exc
    return [{"file": f.path, "size_bytes": f.size, "sha256": f.lfs.sha256 if f.lfs else None}
            for f in sorted(tree, key=lambda f: f.path)
            if isinstance(f, RepoFile) and f.path.lower().endswith(".gguf")]


class Transfer:
    """One transfer's state, written by the download thread and read by the event loop."""

    def __init__(self) -> None:
        self.bytes = 0
        self.synced = 0  # of `bytes`, those fsynced: what a power cut cannot take (and progress reports)
        self.stop: str | None = None     # set from the loop: "cancel" or "shutdown"
        self.receiving: tuple[int, float] | None = None  # (bytes, monotonic time) when bytes began to arrive

    def check(self) -> None:
        if self.stop:
            raise Stopped(self.stop)

    def bar(self, **_: Any) -> _Bar:
        """The `tqdm_class` given to `http_get`: it only counts and checks for a stop."""
        return _Bar(self)


class _Bar:
    def __init__(self, transfer: Transfer) -> None:
        self.transfer = transfer

    def update(self, n: float | None = 1) -> None:
        self.transfer.check()

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _HashingWriter:
    """The file `http_get` writes to: every byte also goes to the sha256 and the byte count.

    The digest of one chunk is computed on a thread of its own while the next one arrives
    (hashlib releases the GIL): verifying costs no second pass and little transfer speed."""

    def __init__(self, fh: BinaryIO, hasher: Any, transfer: Transfer, size: int) -> None:
        self.fh, self.hasher, self.transfer, self.size = fh, hasher, transfer, size
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="lmsp-sha256")
        self._last: Future[None] | None = None
        self._synced_at = time.monotonic()

    def write(self, data: bytes) -> int:
        # Not a byte past the size the hub announced: a hostile hub or CDN could otherwise fill the
        # disk before `http_get` compares sizes at the end.
        if self.fh.tell() + len(data) > self.size:
            raise LmspError("download_failed", f"The hub sent more than the {self.size:,} bytes it announced: the "
                            "download was stopped and its partial file deleted.")
        self.fh.write(data)
        self.digest_so_far()
        self._last = self._hashing.submit(self.hasher.update, data)
        self.transfer.bytes += len(data)
        if time.monotonic() - self._synced_at >= SYNC_SECONDS:
            self.sync()
        return len(data)

    def sync(self) -> None:
        """Make the bytes so far last (a second's worth at a time: one fsync a second)."""
        self.fh.flush()
        durable.fsync(self.fh.fileno())
        self.transfer.synced = self.fh.tell()
        self._synced_at = time.monotonic()

    def digest_so_far(self) -> Any:
        """The hasher, once every byte written so far is in it."""
        if self._last is not None:
            self._last.result()
            self._last = None
        return self.hasher

    def close(self) -> None:
        self._hashing.shutdown(wait=True)

    def tell(self) -> int:
        return self.fh.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.fh.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        # `http_get` rewinds to 0 and truncates when a server ignores the Range and resends all.
        self.digest_so_far()
        done = self.fh.truncate(size)
        if done == 0:
            self.hasher = hashlib.sha256()
            self.transfer.bytes = 0
        return done


def kept(partial: Path, synced: int) -> int:
    """How many of the bytes in `partial` a download may continue from: all of them if they were
    written since the machine booted (a process killed: the page cache kept them; fsynced now),
    else only the `synced` ones, known to have been fsynced: past them a power cut may have left
    zeros."""
    try:
        found = partial.stat()
    except FileNotFoundError:
        return 0
    booted = durable.booted_at()
    if booted is None or found.st_mtime <= booted:
        return min(found.st_size, synced)
    # Perhaps only in the page cache: on the disk before the download counts them as its own (a
    # power cut after that count would otherwise leave it trusting bytes that never got there).
    with partial.open("rb+") as fh:
        durable.fsync(fh.fileno())
    return found.st_size


def fetch(remote: Remote, partial: Path, token: str | None, transfer: Transfer, keep: int = 0) -> str:
    """Continue the download into `partial` from its first `keep` bytes (`kept` says how many
    may be; none: from the start). Returns the sha256 (hex) of the whole file, for the caller to
    compare with the hub's."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    with partial.open("a+b") as fh:
        have = fh.seek(0, os.SEEK_END)
        if have > min(keep, remote.size):  # past what may be trusted, or not this file's bytes
            have = min(keep, remote.size)
            fh.truncate(have)
        if have == 0:
            durable.sync_dir(partial.parent)  # its name lasts: a restart finds the bytes it keeps
        fh.seek(0)
        while chunk := fh.read(1 << 20):  # the bytes from before, into the digest
            hasher.update(chunk)
            transfer.check()
        transfer.bytes = fh.tell()
        transfer.receiving = (transfer.bytes, time.monotonic())
        writer = _HashingWriter(fh, hasher, transfer, remote.size)
        headers = build_hf_headers(token=token)
        if urlparse(remote.url).netloc != urlparse(hf_hub_url(remote.repo, remote.file, endpoint=endpoint())).netloc:
            headers.pop("authorization", None)  # a signed CDN address: the hub token is not for it
        try:
            # `http_get` itself retries a dropped connection from where it stopped (Range), 5 times. It
            # only writes to its file and only makes a bar: what these two offer, not all of a file's and tqdm's.
            http_get(remote.url, cast(BinaryIO, writer), resume_size=have, headers=headers, expected_size=remote.size,
                     displayed_filename=remote.file, tqdm_class=cast(Any, transfer.bar))
        except HfHubHTTPError as exc:
            raise _hub_error(exc, f"{remote.repo}/{remote.file}") from exc
        except httpx2.HTTPError as exc:
            raise LmspError("download_interrupted", f"The transfer broke off: {exc}", status=502) from exc
        finally:
            hasher = writer.digest_so_far()
            writer.close()
            with contextlib.suppress(OSError):  # stopped: what was received lasts (a full disk: said above)
                writer.sync()
        writer.sync()
    return str(hasher.hexdigest())


def place(remote: Remote, partial: Path) -> Path:
    """Move a verified file into the cache as the library would; returns the blob's path."""
    check_revision(remote.revision)  # again: a download asked for before revisions were checked
    pointer = pointer_path(remote)
    blob = blob_path(remote)
    durable.replace(partial, blob)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    # The library's own writer of the relative snapshot symlink (a private name, pinned by our <3
    # requirement), or of a copy where symlinks are not allowed.
    _create_symlink(str(blob), str(pointer), new_blob=True)
    _lasting(pointer.parent, storage(remote.repo))  # the model is registered next
    if remote.revision != remote.commit:
        # refs/<revision> holds the commit, as the library writes it, but fsynced before its rename:
        # the library's writer leaves the content to the page cache, and after a power cut the name
        # could be there with nothing in it, for every tool that shares the cache to read.
        ref = storage(remote.repo) / "refs" / remote.revision
        durable.write(ref, remote.commit, 0o644)
        _lasting(ref.parent.parent, storage(remote.repo))  # its own folder: durable.write
    return blob


def _lasting(folder: Path, top: Path) -> None:
    """Make the names in `folder` and in each folder above it up to `top` last: those made on the
    way, too."""
    for each in (folder, *folder.parents):
        durable.sync_dir(each)
        if each == top:
            return
