"""Who is at the other end of a connection, as far as the operating system tells.

Every local app connects from 127.0.0.1, so the address alone cannot tell two of them apart. On
Linux the kernel's socket table (/proc/net/tcp, tcp6) also names the user owning the client's end
of a loopback connection, and the socket's inode, which /proc/<pid>/fd names for the process that
holds it: with them, another local user flooding pairing requests cannot use up the room of the
owner's own apps, and one app without a token cannot use up the others' (`party`). Elsewhere the
peer address is all there is.
"""

from __future__ import annotations

import asyncio
import os
import time

from aiohttp import web

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
RESCAN_SECONDS = 0.1  # at most this often a scan of every process's sockets, however many connections open


def loopback_socket(client_port: int, server_port: int) -> tuple[int, int] | None:
    """(the uid owning the socket bound to `client_port` and connected to `server_port`, its inode), if any."""
    local, remote = f":{client_port:04X}", f":{server_port:04X}"
    for table in TABLES:
        try:
            with open(table, encoding="ascii") as f:
                next(f)  # the header line
                for line in f:
                    fields = line.split()  # sl local_address rem_address st ... uid timeout inode ...
                    if fields[1].endswith(local) and fields[2].endswith(remote):
                        return int(fields[7]), int(fields[9])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return None


def loopback_uid(client_port: int, server_port: int) -> int | None:
    """The uid owning the socket bound to `client_port` and connected to `server_port`, if any."""
    found = loopback_socket(client_port, server_port)
    return found[0] if found else None


def _socket_holders() -> dict[int, int]:
    """socket inode -> pid, for every process whose descriptors this user may read (its own)."""
    holders: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    holders[int(target[8:-1])] = int(entry.name)
        except (OSError, ValueError):  # another user's process, or one that just ended
            continue
    return holders


class Holders:
    """Which process holds a socket: one scan of /proc maps every socket to its process, and the
    lookups that miss wait for the next scan together, so an app opening connections by the
    thousand costs one scan every RESCAN_SECONDS, on one thread, not one per connection."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._scanned = -RESCAN_SECONDS
        self._scan: asyncio.Future[None] | None = None

    async def pid(self, inode: int) -> int | None:
        if inode not in self._holders:
            if self._scan is None or self._scan.get_loop() is not asyncio.get_running_loop():
                self._scan = asyncio.ensure_future(self._rescan())
            await asyncio.shield(self._scan)
        return self._holders.get(inode)

    async def _rescan(self) -> None:
        try:
            await asyncio.sleep(self._scanned + RESCAN_SECONDS - time.monotonic())
            self._holders = await asyncio.to_thread(_socket_holders)
            self._scanned = time.monotonic()
        finally:
            self._scan = None


HOLDERS = Holders()


def _ports(request: web.Request) -> tuple[str, int, int] | None:
    """(the peer's address, its port, ours)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport else None
    sock = transport.get_extra_info("sockname") if transport else None
    if not isinstance(peer, tuple) or not isinstance(sock, tuple):
        return None
    return peer[0], peer[1], sock[1]


async def requester(request: web.Request) -> str:
    ports = _ports(request)
    if ports is None:
        return "unknown"
    uid = await asyncio.to_thread(loopback_uid, ports[1], ports[2])
    return f"uid:{uid}" if uid is not None else f"host:{ports[0]}"


async def party(request: web.Request) -> str:
    """Which app, among those that share one client (the Ollama listener's apps without a token),
    sent `request`: the page its Origin names (a browser is one process for all its pages), else
    the process holding the client's end of the connection, else the user owning it (another
    user's process, whose descriptors this one cannot read), else the peer's address."""
    origin = request.headers.get("Origin")
    if origin is not None:
        return f"page {origin}"
    ports = _ports(request)
    if ports is None:
        return "unknown"
    found = await asyncio.to_thread(loopback_socket, ports[1], ports[2])
    if found is None:
        return f"host {ports[0]}"
    pid = await HOLDERS.pid(found[1])
    return f"process {pid}" if pid is not None else f"user {found[0]}"
