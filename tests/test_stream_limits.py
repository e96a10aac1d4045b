"""What one app's event streams can no longer do to everyone else: hold every connection, store
its request again with each event, or make the service hold megabytes for each stream it does
not read."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
import pytest

from app import events as bus
from app.core import follow
from app.core.service import AppService
from app.server.app import Server
from tests.conftest import Headless, wait_until
from tests.helpers import COUNT, SAY_HI, bearer, http, pair, pair_sync, poll

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

INSTRUCTIONS = "Be brief. " * (200 << 10)  # 2 MiB: far more than the model's context


def _sse_request(task_id: str, token: str) -> bytes:
    return (f"GET /v1/tasks/{task_id}/events?stream=true HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: Bearer {token}\r\n\r\n").encode()


async def _status_line(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.readline(), 10)
    except (ConnectionError, TimeoutError):
        return b""


async def test_one_app_holding_all_the_streams_it_may_leaves_room_for_everyone_else(
        api: Any, service: AppService) -> None:
    """One paired app opens as many event streams as it can: past its share it is answered 429
    with a Retry-After, and /health, the owner and a new pairing are still answered at once."""
    assert (await api.patch("/v1/settings", json={"max_connections": 64})).status == 200  # a share of 8
    service.tasks.set_paused(True)  # its task stays queued: the streams stay open
    _, token = await pair(api, ["responses:write", "tasks:read"], name="Greedy app")
    _, other = await pair(api, ["tasks:read"], name="Other app")
    created = await (await api.post("/v1/responses", json={**SAY_HI, "background": True},
                                    headers=bearer(token))).json()
    server = Server(service)
    url = await server.start("127.0.0.1", 0)
    port = int(url.rsplit(":", 1)[1])
    streams = []
    try:
        for _ in range(80):  # more than the whole cap
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_sse_request(created["task"]["id"], token))
            streams.append((reader, writer))
        answers = [await _status_line(reader) for reader, _ in streams]
        assert sum(a.startswith(b"HTTP/1.1 200") for a in answers) == 8, answers
        refused = [i for i, a in enumerate(answers) if a.startswith(b"HTTP/1.1 429")]
        assert refused and all(a.startswith((b"HTTP/1.1 200", b"HTTP/1.1 429")) or a == b"" for a in answers)
        head = (await asyncio.wait_for(streams[refused[-1]][0].readuntil(b"\r\n\r\n"), 10)).lower()
        assert b"retry-after: 10" in head
        async with aiohttp.ClientSession() as session:
            for method, path, headers, body, want in (
                    ("GET", "/health", {}, None, 200),
                    ("GET", "/v1/models", bearer(api.token), None, 200),
                    ("POST", "/v1/pairings", {}, {"client_name": "New app", "scopes": ["models:read"]}, 202),
                    ("GET", f"/v1/tasks/{created['task']['id']}", bearer(token), None, 429),  # it holds its share
                    ("GET", "/v1/tasks", bearer(other), None, 200)):
                asked = time.monotonic()
                async with session.request(method, url + path, headers=headers, json=body) as resp:
                    assert resp.status == want, (path, resp.status, await resp.text())
                assert time.monotonic() - asked < 2.0, path
    finally:
        for _, writer in streams:
            writer.close()
        await server.stop()


async def test_a_task_stores_about_the_bytes_its_request_counts(api: Any, service: AppService) -> None:
    """Events say what changed, not the request again: a task with 2 MiB of instructions stores
    little more than the request bytes the limits count (it stored 3.4 times as much)."""
    client_id, token = await pair(api, ["responses:write", "responses:read", "tasks:read"], name="Long prompts")
    resp = await api.post("/v1/responses", json={**SAY_HI, "instructions": INSTRUCTIONS}, headers=bearer(token))
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "context_length_exceeded"
    counted, requests, events = await service.store.read(lambda conn: (
        conn.execute("SELECT request_bytes FROM client_usage WHERE client_id = ?", (client_id,)).fetchone()[0],
        *conn.execute("SELECT SUM(LENGTH(CAST(r.request AS BLOB))), (SELECT SUM(LENGTH(CAST(e.data AS BLOB))) "
                      "FROM task_events e JOIN tasks t ON t.id = e.task_id WHERE t.response_id = r.id) "
                      "FROM responses r WHERE r.client_id = ?", (client_id,)).fetchone()))
    assert counted >= len(INSTRUCTIONS)
    assert requests + events < 1.05 * counted, (counted, requests, events)
    # The response itself still shows them, as OpenAI's does.
    task = (await (await api.get("/v1/tasks?limit=1", headers=bearer(token))).json())["data"][0]
    got = await (await api.get(f"/v1/responses/{task['response_id']}", headers=bearer(token))).json()
    assert got["instructions"] == INSTRUCTIONS and got["tools"] == [] and got["text"] == {"format": {"type": "text"}}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_streams_that_do_not_read_hold_little_memory(headless: Headless) -> None:
    """16 event streams that never read, on a task with 2 MiB of instructions: the service holds
    less than a megabyte more, not 16 copies of its events (nor of its request)."""
    headless.start()
    assert headless.proc is not None
    _, token = pair_sync(headless.url, headless.token, ["responses:write", "tasks:read"], "Slow reader")
    status, created = http(f"{headless.url}/v1/responses", "POST",
                           {**SAY_HI, "instructions": INSTRUCTIONS, "background": True}, token=token)
    assert status == 202, created
    task_id = created["task"]["id"]
    wait_until(lambda: http(f"{headless.url}/v1/tasks/{task_id}", token=token)[1]["status"] == "failed")
    base = _rss_mib(headless.proc.pid)
    host, port = headless.url.rsplit("/", 1)[-1].rsplit(":", 1)
    socks = []
    for _ in range(16):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
        sock.connect((host, int(port)))
        sock.sendall(_sse_request(task_id, token))
        socks.append(sock)
    peak = base
    for _ in range(12):
        time.sleep(0.25)
        peak = max(peak, _rss_mib(headless.proc.pid))
    for sock in socks:
        sock.close()
    time.sleep(1)
    after = _rss_mib(headless.proc.pid)
    assert peak - base < 8, (base, peak)  # it was 296 MiB more (18 MiB a stream), and stayed
    assert after - base < 8, (base, peak, after)


async def test_a_reader_far_behind_its_feed_still_gets_every_event_once(
        api: Any, service: AppService, monkeypatch: Any) -> None:
    """A stream that stops reading while its task runs keeps only FEED_BYTES of live events; when it
    reads again, what it missed comes from the log, page by page: no gap, no duplicate."""
    monkeypatch.setattr(bus, "FEED_BYTES", 1024)  # a few deltas
    monkeypatch.setattr(follow, "PAGE_BYTES", 2048)
    service.tasks.set_paused(True)
    created = await (await api.post("/v1/responses", json={"input": COUNT, "max_output_tokens": 120,
                                                           "temperature": 0, "background": True})).json()
    task_id = created["task"]["id"]
    events = follow.follow(service.tasks, task_id, -1)
    seen = [await anext(events), await anext(events)]  # created, queued: the replay
    first_live = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.2)  # it waits on the feed
    service.tasks.set_paused(False)
    seen.append(await first_live)
    # ... and reads nothing more until the task has ended.
    async def ended() -> Any:
        task = await (await api.get(f"/v1/tasks/{task_id}")).json()
        return task if task["status"] in ("completed", "failed", "cancelled") else None

    task = await poll(ended, timeout=180, what="the task's end")
    seen += [event async for event in events]
    assert [e["sequence_number"] for e in seen] == list(range(task["last_sequence_number"] + 1))
    assert seen[-1]["type"] in ("response.completed", "response.incomplete")
