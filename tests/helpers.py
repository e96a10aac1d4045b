"""Small helpers shared by the API test files: polling, requests without the owner token,
the LMSP error body, and pairing a client through the real API (no shortcuts into the DB)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from app.core.service import AppService

SAY_HI = {"input": "Say hi", "max_output_tokens": 8, "temperature": 0}
# SmolLM2 answers this at length at temperature 0: the prompt for work that must still be
# running when a test acts on it.
COUNT = "Write the numbers from 1 to 1000 separated by commas."
ALL_BUT_ADMIN = ["models:read", "models:write", "responses:read", "responses:write", "tasks:read",
                 "tasks:cancel", "metrics:read"]


@contextlib.asynccontextmanager
async def started(data_dir: Path) -> AsyncIterator[AppService]:
    """A service on `data_dir` for one block, stopped at its end: tests that restart it use one each."""
    service = AppService(data_dir)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def poll(check: Callable[[], Awaitable[Any]], timeout: float = 60.0, interval: float = 0.05,
               what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


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
