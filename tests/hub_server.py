"""A Hugging Face hub on loopback, for tests that must not reach the internet.

It answers what `huggingface_hub` asks for a download: `HEAD`/`GET /{repo}/resolve/{revision}/{file}`
with the hub's headers (`X-Repo-Commit`, `X-Linked-Etag`: the LFS sha256, `X-Linked-Size`,
`ETag`) and `Range` support (206 with `Content-Range`), and the tree listing
`/api/models/{repo}/tree/{revision}`. It serves real files (the default model) and counts the
body bytes it sends. Faults on demand: a speed limit, a connection cut after some bytes, bytes
that do not match the digest it announces, more bytes than it announces, a commit that is a path.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 64 * 1024


@dataclass
class HubFile:
    path: Path
    sha256: str = ""

    def __post_init__(self) -> None:
        h = hashlib.sha256()
        with self.path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        self.sha256 = h.hexdigest()

    @property
    def size(self) -> int:
        return self.path.stat().st_size


@dataclass
class FakeHub:
    repos: dict[str, dict[str, HubFile]]
    bytes_sent: int = 0
    requests: list[str] = field(default_factory=list)
    authorizations: set[str] = field(default_factory=set)  # the Authorization headers it was sent
    bytes_per_second: float | None = None    # a speed limit, like a real line
    cut_after: int | None = None             # close the connection after this many body bytes, once
    corrupt: bool = False                    # flip a byte: the body no longer matches X-Linked-Etag
    commit: str = COMMIT                     # the X-Repo-Commit it answers (a hostile hub's: a path)
    extra: int = 0                           # zero bytes sent after the file, past the size it announced
    url: str = ""

    def __post_init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-hub", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle (from the test's thread) --------------------------------------------------

    def start(self) -> FakeHub:
        self._thread.start()
        assert self._ready.wait(10), "the fake hub did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", r"/api/models/{owner}/{name}/tree/{revision}", self._tree)
        app.router.add_route("*", r"/{owner}/{name}/resolve/{revision}/{file:.+}", self._resolve)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    # -- the hub -----------------------------------------------------------------------------

    def _find(self, request: web.Request) -> HubFile:
        repo = f"{request.match_info['owner']}/{request.match_info['name']}"
        if repo not in self.repos:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text="Repository not found")
        found = self.repos[repo].get(request.match_info["file"])
        if found is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT},
                                   text="Entry not found")
        return found

    def _note(self, request: web.Request) -> None:
        self.requests.append(f"{request.method} {request.path} {request.headers.get('Range', '')}".strip())
        self.authorizations.add(request.headers.get("Authorization", ""))

    async def _tree(self, request: web.Request) -> web.Response:
        self._note(request)
        repo = f"{request.match_info['owner']}/{request.match_info['name']}"
        if repo not in self.repos:
            return web.json_response({"error": "Repository not found"}, status=404,
                                     headers={"X-Error-Code": "RepoNotFound"})
        return web.json_response([
            {"type": "file", "path": name, "size": f.size, "oid": "0" * 40,
             "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}}
            for name, f in self.repos[repo].items()] + [
            {"type": "file", "path": "README.md", "size": 12, "oid": "1" * 40}])

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        self._note(request)
        found = self._find(request)
        start, end = 0, found.size - 1
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("Range", ""))
        if ranged:
            start = int(ranged.group(1))
            end = int(ranged.group(2)) if ranged.group(2) else end
        headers = {"X-Repo-Commit": self.commit, "X-Linked-Etag": f'"{found.sha256}"', "X-Linked-Size": str(found.size),
                   "ETag": f'"{found.sha256}"', "Accept-Ranges": "bytes",
                   "Content-Length": str(end - start + 1 + (self.extra if request.method == "GET" else 0)),
                   "Content-Type": "application/octet-stream"}
        if ranged:
            headers["Content-Range"] = f"bytes {start}-{end}/{found.size}"
        response = web.StreamResponse(status=206 if ranged else 200, headers=headers)
        if request.method == "HEAD":
            return response
        await response.prepare(request)
        with found.path.open("rb") as fh:
            fh.seek(start)
            position = start
            sent_here = 0
            while position <= end:
                chunk = fh.read(min(CHUNK, end - position + 1))
                if self.corrupt and position <= found.size // 2 < position + len(chunk):
                    flip = found.size // 2 - position
                    chunk = chunk[:flip] + bytes([chunk[flip] ^ 0xFF]) + chunk[flip + 1:]
                if self.cut_after is not None and sent_here + len(chunk) > self.cut_after:
                    self.cut_after = None
                    assert request.transport is not None
                    request.transport.abort()  # the line drops mid-body
                    return response
                await response.write(chunk)
                self.bytes_sent += len(chunk)
                sent_here += len(chunk)
                position += len(chunk)
                if self.bytes_per_second:
                    await asyncio.sleep(len(chunk) / self.bytes_per_second)
        for at in range(0, self.extra, CHUNK):
            await response.write(bytes(min(CHUNK, self.extra - at)))
            if self.bytes_per_second:
                await asyncio.sleep(CHUNK / self.bytes_per_second)
        await response.write_eof()
        return response
