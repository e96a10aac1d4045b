"""Small helpers shared by the API test files: polling, requests without the owner token,
the LMSP error body, pairing a client through the real API (no shortcuts into the DB), and an
upstream that refuses every request with the message a test chooses."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp

from app.core.service import AppService
from app.engine.parent.engine import Engine

SAY_HI = {"input": "Say hi", "max_output_tokens": 8, "temperature": 0}
# SmolLM2 answers this at length at temperature 0: the prompt for work that must still be
# running when a test acts on it.
COUNT = "Write the numbers from 1 to 1000 separated by commas."
TERMINAL = {"completed", "failed", "cancelled"}  # a task's statuses once it has ended
ALL_BUT_ADMIN = ["models:read", "models:write", "responses:read", "responses:write", "tasks:read",
                 "tasks:cancel", "metrics:read"]


@contextlib.asynccontextmanager
async def started(data_dir: Path, engine_factory: Any = Engine) -> AsyncIterator[AppService]:
    """A service on `data_dir` for one block, stopped at its end: tests that restart it use one each
    (with the test's `engine_factory` fixture where it may be scripted)."""
    service = AppService(data_dir, engine_factory)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


def _tries(timeout: float, what: str) -> Iterator[None]:
    """The one polling loop of the tests: a try now, then again until `timeout` seconds are over."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def wait_until(predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.05,
               what: str = "condition") -> Any:
    """`predicate()`'s first true value, tried every `interval` seconds (for a test that is not async)."""
    for _ in _tries(timeout, what):
        if value := predicate():
            return value
        time.sleep(interval)


async def poll(check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.05,
               what: str = "condition") -> Any:
    """`check()`'s first true value (awaited if it is awaitable), tried every `interval` seconds
    without holding the loop."""
    for _ in _tries(timeout, what):
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)


async def wait_status(api: Any, task_id: str, statuses: set[str] = TERMINAL, timeout: float = 60.0) -> dict[str, Any]:
    """The task once its status is one of `statuses` (by default: once it has ended)."""
    async def check() -> dict[str, Any] | None:
        resp = await api.get(f"/v1/tasks/{task_id}")
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body if body["status"] in statuses else None
    return await poll(check, timeout, what=f"task {task_id} to reach {sorted(statuses)}")


async def raw(api: Any, method: str, path: str, headers: dict[str, str] | None = None,
              **kwargs: Any) -> tuple[aiohttp.ClientResponse, str]:
    """A request without the owner token the `api` fixture sends by default."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, api.make_url(path), headers=headers or {}, **kwargs) as resp:
            return resp, await resp.text()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def check_error(status: int, text: str, want_status: int, code: str, param: Any = ...) -> dict[str, Any]:
    """The LMSP error body, exactly, with the expected status, code and (optionally) param."""
    assert status == want_status, (status, text)
    body = json.loads(text)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"type", "code", "message", "param"}, err
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"], err
    if param is not ...:
        assert err["param"] == param, err
    return err


async def expect_error(resp: aiohttp.ClientResponse, status: int, code: str, param: Any = ...) -> dict[str, Any]:
    text = await resp.text()
    assert resp.content_type == "application/json", (resp.status, resp.content_type, text)
    return check_error(resp.status, text, status, code, param)


async def pair(api: Any, scopes: list[str], name: str = "Test App") -> tuple[str, str]:
    """Pair a client through the API as a local app would: request (no token), the owner
    approves, the app collects its token. Returns (client_id, token)."""
    resp, text = await raw(api, "POST", "/v1/pairings", json={"client_name": name, "scopes": scopes})
    assert resp.status == 202, text
    pairing_id = json.loads(text)["id"]
    resp = await api.post(f"/v1/pairings/{pairing_id}/approve")
    assert resp.status == 200, await resp.text()
    resp, text = await raw(api, "GET", f"/v1/pairings/{pairing_id}")
    assert resp.status == 200, text
    body = json.loads(text)
    assert body["status"] == "approved" and body["token"].startswith("lmsp_"), body
    return body["client_id"], body["token"]


# -- synchronous, for a real `headless` process -----------------------------------------------

def http(url: str, method: str = "GET", body: Any = None, token: str | None = None,
         headers: dict[str, str] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(bearer(token) if token else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def pair_sync(base_url: str, owner_token: str, scopes: list[str], name: str = "Test App") -> tuple[str, str]:
    status, created = http(f"{base_url}/v1/pairings", "POST", {"client_name": name, "scopes": scopes})
    assert status == 202, created
    status, body = http(f"{base_url}/v1/pairings/{created['id']}/approve", "POST", token=owner_token)
    assert status == 200, body
    status, body = http(f"{base_url}/v1/pairings/{created['id']}")
    assert status == 200 and body["token"].startswith("lmsp_"), body
    return body["client_id"], body["token"]


@contextlib.contextmanager
def refusing_upstream(message: str) -> Iterator[str]:
    """The base URL of an OpenAI-compatible upstream on loopback that serves the model `m` and
    answers every request 400 with `message` (whatever an upstream may say: escapes, HTML)."""

    class Refusing(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._answer(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer(400, {"error": {"message": message}})

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    with upstream(Refusing) as url:
        yield url


@contextlib.contextmanager
def upstream(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """The base URL (`…/v1`) of a server on loopback answering with `handler`, for as long as the block runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
