"""What one misbehaving local program can no longer do to everyone else: hold every socket the
service may open, or keep a connection forever with a request that never completes."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import resource
import select
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from app.core.service import AppService
from app.engine.request import Request
from tests.conftest import Headless, cpu_seconds, wait_until
from tests.helpers import bearer, expect_error, http, pair, poll

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

FD_LIMIT = 1024  # the usual soft limit of a desktop session
HOSTILE = 1100   # more than the service could ever hold at that limit


def _address(url: str) -> tuple[str, int]:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    return host, int(port)


def _open(url: str, first_bytes: bytes) -> socket.socket | None:
    try:
        sock = socket.create_connection(_address(url), timeout=2)
    except OSError:  # the listen backlog is full: refused before it cost the service anything
        return None
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def _held_by_server(sock: socket.socket) -> bool:
    """True while the server keeps the connection open and has not answered on it."""
    sock.setblocking(False)
    try:
        sock.recv(65536)  # an answer (408, 400) or EOF: the server let go of it
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def _lower_fd_limit() -> None:
    """Soft and hard: the app raises a low soft limit at start as far as the hard one lets it."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def test_idle_and_half_sent_connections_cannot_starve_the_service(headless: Headless) -> None:
    """Idle connections, request lines cut short and bodies that never complete, more of them than
    the service has file descriptors: a real task still completes, and new requests are answered."""
    headless.start(preexec=_lower_fd_limit)
    kinds = [b"",                                                         # says nothing at all
             b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: aaaa",  # headers never finish
             b"POST /v1/pairings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100000\r\n\r\n{\"client_name\": "]           # the body never completes
    hostile = [_open(headless.url, kinds[i % 3]) for i in range(HOSTILE)]
    opened = [s for s in hostile if s is not None]
    try:
        time.sleep(1)
        held = sum(_held_by_server(s) for s in opened)  # by the service, or still in the kernel's backlog
        assert headless.proc is not None
        descriptors = len(os.listdir(f"/proc/{headless.proc.pid}/fd"))
        started = time.monotonic()
        status, created = http(f"{headless.url}/v1/responses", "POST",
                               {"input": "Say hi", "max_output_tokens": 8, "temperature": 0, "background": True},
                               token=headless.token, timeout=30)
        first_answer = time.monotonic() - started
        assert status == 202, created
        for _ in range(20):  # new legitimate requests, each on a new connection, while the flood holds
            asked = time.monotonic()
            assert http(f"{headless.url}/health", timeout=10)[0] == 200
            assert time.monotonic() - asked < 2.0
        task_id = created["task"]["id"]
        done = wait_until(lambda: (t := http(f"{headless.url}/v1/tasks/{task_id}", token=headless.token)[1])
                          ["status"] in ("completed", "failed") and t, timeout=120)
        assert done["status"] == "completed", done
        print(f"\nfd limit {FD_LIMIT}: {len(opened)} of {HOSTILE} hostile connections opened, {held} not let go "
              f"a second later, the service using {descriptors} descriptors; a new request answered in "
              f"{first_answer:.2f} s; the task {done['status']}")
        assert descriptors < FD_LIMIT // 2
    finally:
        for sock in opened:
            sock.close()
    assert headless.terminate() == 0
    text = "".join(p.read_text() for p in (headless.data_dir / "logs").glob("lmsp-tray.log*"))
    assert len(text.splitlines()) < 200, text[-3000:]  # no error flood rotated the history away
    assert "unexpected error" not in text, text[-3000:]  # a connection closed mid-body is no server error


def test_requests_that_never_complete_are_cut_off(headless: Headless) -> None:
    """Headers that never end are dropped after 10 s. A body must come at 64 KiB/s after a grace of
    2 s: one that stops, or trickles (it held its connection, and its app's share of requests in
    progress, for 10 s), gets 408 after about 2 s; one that pauses within the grace is read."""
    headless.start()
    head = (b"POST /v1/pairings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n")
    slow_headers = _open(headless.url, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: a")
    slow_body = _open(headless.url, head % 50 + b"{")
    trickle = _open(headless.url, head % 1000 + b"{")
    paused = json.dumps({"client_name": "Paused App", "scopes": ["models:read"]}).encode()
    pausing = _open(headless.url, head % len(paused) + paused[:5])
    assert slow_headers is not None and slow_body is not None and trickle is not None and pausing is not None
    started = time.monotonic()
    for sock in (slow_headers, slow_body, trickle, pausing):
        sock.settimeout(30)
    dripping = threading.Thread(target=_drip, args=(trickle,))
    dripping.start()
    time.sleep(1.5)
    pausing.sendall(paused[5:])
    assert pausing.recv(65536).startswith(b"HTTP/1.1 202"), "a body that paused 1.5 s was read"
    answer = slow_body.recv(65536)
    body_seconds = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    dripped = trickle.recv(65536)
    trickle_seconds = time.monotonic() - started
    assert dripped.startswith(b"HTTP/1.1 408"), dripped
    dripping.join()
    assert slow_headers.recv(65536) == b""  # closed without an answer: nothing was asked
    header_seconds = time.monotonic() - started
    print(f"\nunfinished headers dropped after {header_seconds:.1f} s, unfinished body answered 408 after "
          f"{body_seconds:.1f} s, a body of 10 bytes a second after {trickle_seconds:.1f} s")
    assert 1.5 < body_seconds < 4 and 1.5 < trickle_seconds < 4 and 9 < header_seconds < 15
    for sock in (slow_headers, slow_body, trickle, pausing):
        sock.close()


def _drip(sock: socket.socket) -> None:
    """A byte every 0.1 s until the service answers (or closes), for 4 s at most."""
    for _ in range(40):
        if select.select([sock], [], [], 0.1)[0]:
            return
        sock.send(b" ")


def test_malformed_requests_get_the_lmsp_error_and_no_traceback(headless: Headless) -> None:
    headless.start()
    sock = _open(headless.url, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Bad: a\x7fb\r\n\r\n")
    assert sock is not None
    sock.settimeout(10)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    head, body = answer.split(b"\r\n\r\n", 1)
    assert b" 400 " in head.split(b"\r\n")[0] and b"application/json" in head, answer
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error", error
    assert headless.terminate() == 0
    text = "".join(p.read_text() for p in (headless.data_dir / "logs").glob("lmsp-tray.log*"))
    assert "refused a malformed request" in text and "Traceback" not in text and " ERROR " not in text, text


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(field)


async def test_listing_large_tasks_costs_little_and_starves_no_one(service: Any, api: Any) -> None:
    """100 queued tasks with 2 MiB prompts: two listings of them at once neither load the prompts
    (memory) nor hold up another client's requests."""
    service.tasks.set_paused(True)  # they stay queued, as behind a long task
    _, other = await pair(api, ["models:read"], name="Other app")
    prompt = "word " * (2 * 1024 * 1024 // 5)
    for _ in range(100):
        resp = await api.post("/v1/responses", json={"input": prompt, "background": True, "max_output_tokens": 4})
        assert resp.status == 202, await resp.text()
    assert (await api.get("/v1/models", headers=bearer(other))).status == 200  # the other app, seen before
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS count from here
    before = _rss_mib("VmRSS")

    async def listing() -> float:
        started = time.monotonic()
        resp = await api.get("/v1/tasks?limit=100")
        assert resp.status == 200 and len((await resp.json())["data"]) == 100
        return time.monotonic() - started

    async def other_app() -> list[float]:
        waits = []
        for _ in range(10):
            started = time.monotonic()
            resp = await api.get("/v1/models", headers=bearer(other))
            assert resp.status == 200, await resp.text()
            waits.append(time.monotonic() - started)
            await asyncio.sleep(0.02)
        return waits

    lists = asyncio.gather(listing(), listing())
    waits = await other_app()
    took = await lists
    grew = _rss_mib("VmHWM") - before
    print(f"\ntwo listings of 100 tasks with 2 MiB prompts: {max(took):.2f} s, peak RSS +{grew:.0f} MiB; "
          f"the other app's slowest request meanwhile {max(waits) * 1000:.0f} ms")
    assert grew < 50 and max(waits) < 0.5


async def test_a_revoked_token_is_refused_at_once_though_it_was_just_verified(api: Any) -> None:
    client_id, token = await pair(api, ["models:read"], name="Soon revoked")
    assert (await api.get("/v1/models", headers=bearer(token))).status == 200
    assert (await api.delete(f"/v1/clients/{client_id}")).status == 200
    resp = await api.get("/v1/models", headers=bearer(token))
    assert resp.status == 401, await resp.text()


def test_registering_a_slow_file_stops_when_the_client_leaves_and_never_delays_exit(headless: Headless,
                                                                                   tmp_path: Path) -> None:
    """A 1 TiB sparse file with 2^21 strings: valid enough to walk (the most a header may hold)
    and then to hash (1 TiB). The work stops when its client leaves, and a SIGTERM exits at once."""
    bomb = tmp_path / "bomb.gguf"
    key = b"tokenizer.ggml.tokens"
    bomb.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(key)) + key + struct.pack("<IIQ", 9, 8, 2**21))
    os.truncate(bomb, 1 << 40)
    headless.start()
    assert headless.proc is not None
    pid = headless.proc.pid
    try:
        http(f"{headless.url}/v1/models", "POST", {"path": str(bomb)}, token=headless.token, timeout=1)
        raise AssertionError("a 1 TiB file cannot be registered within a second")
    except TimeoutError:
        pass  # the client gives up and leaves
    time.sleep(1.5)  # the connection is watched every 0.25 s
    burnt = cpu_seconds(pid)
    time.sleep(3)
    after_leaving = cpu_seconds(pid) - burnt
    waiting = threading.Thread(target=http, args=(f"{headless.url}/v1/models", "POST", {"path": str(bomb)}),
                               kwargs={"token": headless.token, "timeout": 60}, daemon=True)
    waiting.start()  # this one is still waited for when the service is told to stop
    time.sleep(1)
    started = time.monotonic()
    assert headless.terminate() == 0
    exit_seconds = time.monotonic() - started
    print(f"\nafter the client left: {after_leaving:.2f} s of CPU in 3 s; SIGTERM during a registration: "
          f"exited in {exit_seconds:.2f} s")
    assert after_leaving < 0.5 and exit_seconds < 5


# -- limits on queued work and stored bytes, and fair turns -------------------------------------

async def _queue(api: Any, token: str | None = None, prompt: str = "Say hi", **extra: Any) -> Any:
    """One background task (the service is paused: it stays queued); the raw answer."""
    return await api.post("/v1/responses", headers=bearer(token) if token else None,
                          json={"input": prompt, "background": True, "max_output_tokens": 2, **extra})


async def _task_count(service: Any) -> int:
    return await service.store.read(lambda c: c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])


async def _refused(resp: Any, code: str, setting: str) -> int:
    """The 429 of a limit: LMSP error, the setting named, a Retry-After in seconds. Returns it."""
    err = await expect_error(resp, 429, code)
    assert err["type"] == "rate_limit_error" and f"setting {setting} =" in err["message"], err
    assert resp.headers["Retry-After"].isdigit(), resp.headers
    return int(resp.headers["Retry-After"])


async def test_queued_tasks_are_limited_per_client_and_in_all(api: Any, service: Any) -> None:
    settings = await (await api.get("/v1/settings")).json()
    assert (settings["max_queued_tasks_per_client"], settings["max_queued_tasks"]) == (100, 1000)
    service.tasks.set_paused(True)
    limits = {"max_queued_tasks_per_client": 3, "max_queued_tasks": 5}
    assert (await api.patch("/v1/settings", json=limits)).status == 200
    _, other = await pair(api, ["responses:write", "tasks:read"], name="Other app")
    for _ in range(3):
        assert (await _queue(api)).status == 202
    before = await _task_count(service)
    assert await _refused(await _queue(api), "too_many_queued_tasks", "max_queued_tasks_per_client") > 0
    assert await _task_count(service) == before  # nothing stored
    for _ in range(2):  # the other app has its own share...
        resp = await _queue(api, other)
        assert resp.status == 202, await resp.text()
    await _refused(await _queue(api, other), "too_many_queued_tasks", "max_queued_tasks")  # ...of the total
    first = (await (await api.get("/v1/tasks?limit=100")).json())["data"][-1]
    assert (await api.post(f"/v1/tasks/{first['id']}/cancel")).status == 200  # a finished task frees its place
    assert (await _queue(api)).status == 202


async def test_stored_request_bytes_are_limited_per_client_and_in_all(api: Any, service: Any) -> None:
    settings = await (await api.get("/v1/settings")).json()
    assert (settings["max_request_bytes_per_client"], settings["max_request_bytes"]) == (256 << 20, 1 << 30)
    service.tasks.set_paused(True)
    assert (await api.patch("/v1/settings", json={"max_request_bytes_per_client": 2 << 20,
                                                   "max_request_bytes": 3 << 20})).status == 200
    _, other = await pair(api, ["responses:write", "tasks:read"], name="Other app")
    prompt = "x" * (600 << 10)
    for _ in range(3):  # 1.8 MiB of 2
        assert (await _queue(api, prompt=prompt)).status == 202
    await _refused(await _queue(api, prompt=prompt), "storage_limit_reached", "max_request_bytes_per_client")
    assert (await _queue(api, prompt="short")).status == 202  # what still fits is taken
    for task in (await (await api.get("/v1/tasks?limit=100")).json())["data"]:
        assert (await api.post(f"/v1/tasks/{task['id']}/cancel")).status == 200
    # Finished requests still take their space until retention removes them: Retry-After says when.
    wait = await _refused(await _queue(api, prompt=prompt), "storage_limit_reached", "max_request_bytes_per_client")
    assert service.settings["retention_seconds"] <= wait <= service.settings["retention_seconds"] + 700
    assert (await _queue(api, other, prompt=prompt)).status == 202  # 2.4 MiB of everyone's 3
    await _refused(await _queue(api, other, prompt="x" * (700 << 10)), "storage_limit_reached", "max_request_bytes")
    await service.housekeeping.purge(now=time.time() + service.settings["retention_seconds"] + 1)
    assert (await _queue(api, prompt=prompt)).status == 202


async def test_one_clients_queue_does_not_delay_anothers_single_task(api: Any, service: Any) -> None:
    """Round-robin by client: the other app's one task runs after at most one of the 6 queued before it."""
    service.tasks.set_paused(True)
    _, other = await pair(api, ["responses:write", "tasks:read"], name="Other app")
    for _ in range(6):
        assert (await _queue(api, max_output_tokens=1)).status == 202
    resp = await _queue(api, other, max_output_tokens=1)
    assert resp.status == 202
    theirs = (await resp.json())["task"]["id"]
    service.tasks.set_paused(False)

    async def all_done() -> list[dict[str, Any]] | None:
        tasks = (await (await api.get("/v1/tasks?limit=100")).json())["data"]
        return tasks if all(t["status"] in ("completed", "failed", "cancelled") for t in tasks) else None

    tasks = await poll(all_done, timeout=120, what="every task to end")
    assert all(t["status"] == "completed" for t in tasks), tasks
    started = {t["id"]: t["started_at"] for t in tasks}
    before_theirs = sorted(t for tid, t in started.items() if tid != theirs and t < started[theirs])
    print(f"\nthe other app's one task started after {len(before_theirs)} of the 6 queued before it")
    assert len(before_theirs) <= 1


async def test_space_that_retention_frees_goes_back_to_the_disk(tmp_path: Path) -> None:
    svc = AppService(tmp_path / "data")
    db_file = tmp_path / "data" / "lmsp.sqlite3"
    await svc.start()
    svc.tasks.set_paused(True)
    client = await svc.access.authenticate(await svc.access.owner_token())
    assert client is not None
    for _ in range(40):
        created = await svc.responses.create_response(client, {"input": "y" * (1 << 20), "background": True})
        await svc.tasks.cancel(client, "task", created.body["task"]["id"])
    await svc.stop()
    full = db_file.stat().st_size
    svc = AppService(tmp_path / "data")
    await svc.start()
    counts = await svc.housekeeping.purge(now=time.time() + svc.settings["retention_seconds"] + 1)
    await svc.stop()
    after = db_file.stat().st_size
    print(f"\n40 MiB of requests purged: the database went from {full / 2**20:.1f} MiB to {after / 2**20:.2f} MiB")
    assert counts["responses"] == 40 and after < full / 10


def _recount(conn: Any) -> dict[str, tuple[int, int]]:
    """Each client's unfinished tasks and stored request bytes, counted from every row."""
    rows = conn.execute("SELECT r.client_id, COALESCE(SUM(t.status IN ('queued', 'loading', 'running', "
                        "'cancelling')), 0), SUM(r.request_bytes) FROM responses r "
                        "LEFT JOIN tasks t ON t.response_id = r.id GROUP BY r.client_id").fetchall()
    return {row[0]: (row[1], row[2]) for row in rows}


def _kept(conn: Any) -> dict[str, tuple[int, int]]:
    """What the limits read: the counters, leaving out clients with nothing left."""
    return {row[0]: (row[1], row[2]) for row in conn.execute(
        "SELECT client_id, unfinished, request_bytes FROM client_usage WHERE unfinished OR request_bytes")}


def test_what_the_limits_count_stays_exact_through_every_change_of_a_task(tmp_path: Path) -> None:
    """The limits read per-client counters (one row each, not a count over every task: request ->
    202 stays fast with thousands queued). Through creation, every move of the state machine,
    recovery's re-queue, and deletion, they equal a recount; a file from before them is counted
    when it is migrated."""
    from app.store import config, db
    from app.tasks import limits, machine
    from app.tasks.kinds import generation_writes
    from tests.test_store import plain

    old = tmp_path / "old.sqlite3"
    with plain(old) as conn:  # schema 8, with requests of two clients, one of them finished
        for version, sql in db.migrations()[:8]:
            for statement in db._statements(sql):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
        for n, (client, status) in enumerate([("a", "queued"), ("a", "completed"), ("b", "running")]):
            conn.execute("INSERT INTO responses(id, client_id, model_id, request, background, created_at, "
                         "request_bytes) VALUES (?, ?, 'm', '{}', 1, 0, ?)", (f"resp_{n}", client, 10 * (n + 1)))
            conn.execute("INSERT INTO tasks(id, response_id, status, on_restart, created_at) "
                         "VALUES (?, ?, ?, 'fail', 0)", (f"task_{n}", f"resp_{n}", status))
    conn = db.open_database(old).conn
    assert _kept(conn) == _recount(conn) == {"a": (1, 30), "b": (1, 30)}

    settings, made, sent = dict(config.DEFAULTS), itertools.count(), []

    def create(client: str, size: int) -> str:
        n = next(made)
        request = Request([{"role": "user", "content": "y" * size}]).to_json()
        sent.append(request)
        limits.store_request(conn, settings, f"resp_new{n}", client, "m", request, True, "{}", time.time())
        machine.create(conn, f"task_new{n}", f"resp_new{n}", "fail", None)
        return f"task_new{n}"

    steps = [
        lambda: create("c", 100),
        lambda: machine.transition(conn, "task_new0", "loading"),
        lambda: machine.transition(conn, "task_new0", "running"),
        lambda: machine.record(conn, "task_new0", ("running",), [], output_tokens=3),  # a token: no move
        lambda: generation_writes.request_cancel(conn, "task_new0"),  # running -> cancelling, still unfinished
        lambda: machine.transition(conn, "task_new0", "cancelled"),
        lambda: machine.transition(conn, "task_2", "queued"),  # recovery re-queues: unfinished to unfinished
        lambda: machine.transition(conn, "task_2", "failed"),
        lambda: generation_writes.request_cancel(conn, "task_0"),  # queued -> cancelled at once
        lambda: create("a", 7),
        lambda: conn.execute("DELETE FROM responses WHERE id = 'resp_new1'"),  # an unfinished one, cascading
        lambda: conn.execute("DELETE FROM responses WHERE id = 'resp_1'"),
    ]
    for step in steps:
        conn.execute("BEGIN")
        step()
        conn.execute("COMMIT")
        assert _kept(conn) == _recount(conn), step
    assert _kept(conn) == {"a": (0, 10), "b": (0, 30), "c": (0, len(sent[0]))}  # c's 100 "y"s, stored
    conn.close()
