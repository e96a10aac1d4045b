"""Who is at the other end of a connection, as far as the operating system tells.

Every local app connects from 127.0.0.1, so the address alone cannot tell two of them apart. On
Linux the kernel's socket table (/proc/net/tcp, tcp6) also names the user owning the client's end
of a loopback connection: with it, another local user flooding pairing requests cannot use up the
room of the owner's own apps. Elsewhere the peer address is all there is.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def loopback_uid(client_port: int, server_port: int) -> int | None:
    """The uid owning the socket bound to `client_port` and connected to `server_port`, if any."""
    local, remote = f":{client_port:04X}", f":{server_port:04X}"
    for table in TABLES:
        try:
            with open(table, encoding="ascii") as f:
                next(f)  # the header line
                for line in f:
                    fields = line.split()  # sl local_address rem_address st ... uid ...
                    if fields[1].endswith(local) and fields[2].endswith(remote):
                        return int(fields[7])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return None


async def requester(request: web.Request) -> str:
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport else None
    sock = transport.get_extra_info("sockname") if transport else None
    if not isinstance(peer, tuple) or not isinstance(sock, tuple):
        return "unknown"
    uid = await asyncio.to_thread(loopback_uid, peer[1], sock[1])
    return f"uid:{uid}" if uid is not None else f"host:{peer[0]}"
