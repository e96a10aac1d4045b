"""Headless Chromium (the Debian package), driven over the Chrome DevTools Protocol, for the tests
of web pages (tests/test_browser.py).

The protocol is a websocket carrying JSON: aiohttp's client speaks it, so nothing is installed for
it (playwright-core would bring Node.js into the test and its own idea of which browser build it
drives). Few commands are needed: open a tab, navigate, evaluate an expression in the page; and
the page's console messages, uncaught exceptions, the browser's own log (where a CORS refusal is
written) and failed network requests, kept as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import Processes

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# No sandbox (tests may run as root, in a container), no GPU, nothing fetched from Google's servers.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-port=0"]


@dataclass
class Failed:
    """A network request that did not complete: what the page's script saw as a network error."""
    url: str
    method: str
    error: str                   # Chromium's errorText, e.g. net::ERR_FAILED
    cors: str | None             # the CORS check that refused it (corsErrorStatus.corsError), if one did


@dataclass
class Page:
    """One tab, and what it reported so far."""
    ws: aiohttp.ClientWebSocketResponse
    console: list[str] = field(default_factory=list)     # "error: ..." - every console message, by level
    exceptions: list[str] = field(default_factory=list)  # uncaught, in the page's scripts
    log: list[str] = field(default_factory=list)         # the browser's own messages (CORS refusals)
    failed: list[Failed] = field(default_factory=list)
    sent: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id -> the request (method, url, headers)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _waiting: dict[int, asyncio.Future[Any]] = field(default_factory=dict)

    async def send(self, method: str, **params: Any) -> Any:
        call_id = next(self._ids)
        answer = self._waiting[call_id] = asyncio.get_running_loop().create_future()
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        return await asyncio.wait_for(answer, 30)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """The value of `expression` once it is truthy (checked every 50 ms)."""
        deadline = time.monotonic() + timeout
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} stayed {value!r}; console: {self.console}, exceptions: "
                                   f"{self.exceptions}, log: {self.log}, failed: {self.failed}")
            await asyncio.sleep(0.05)
        return value

    async def read(self) -> None:
        """Until the tab's websocket closes: answers to their callers, events into the lists."""
        async for message in self.ws:
            data = json.loads(message.data)
            if "id" in data:
                answer = self._waiting.pop(data["id"])
                if "error" in data:
                    answer.set_exception(RuntimeError(f"DevTools: {data['error']}"))
                else:
                    answer.set_result(data["result"])
            else:
                self._event(data["method"], data["params"])

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled":
            words = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.console.append(f"{params['type']}: {words}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.exceptions.append(details.get("exception", {}).get("description") or details["text"])
        elif method == "Log.entryAdded":
            entry = params["entry"]
            self.log.append(f"{entry['level']}: {entry['text']}" + (f" ({entry['url']})" if entry.get("url") else ""))
        elif method == "Network.requestWillBeSent":
            self.sent[params["requestId"]] = params["request"]
        elif method == "Network.loadingFailed":
            request = self.sent.get(params["requestId"], {})
            cors = params.get("corsErrorStatus", {}).get("corsError")
            self.failed.append(Failed(request.get("url", "?"), request.get("method", "?"), params["errorText"], cors))


class Browser:
    """A headless Chromium with a fresh profile; its tabs are `Page`s."""

    def __init__(self, procs: Processes, profile: Path) -> None:
        self.profile = profile
        log = (profile.parent / f"{profile.name}.log").open("ab")
        self.proc = procs.popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                stdout=log, stderr=log)
        log.close()
        self.http = aiohttp.ClientSession()
        self.base = ""
        self._readers: list[asyncio.Task[None]] = []

    async def started(self, timeout: float = 60.0) -> Browser:
        """Once its DevTools port (written in the profile when it listens) answers."""
        deadline = time.monotonic() + timeout
        active = self.profile / "DevToolsActivePort"
        while not active.exists() or not active.read_text().strip():
            assert self.proc.poll() is None, "chromium exited; see its log beside the profile"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            await asyncio.sleep(0.05)
        self.base = f"http://127.0.0.1:{active.read_text().split()[0]}"
        return self

    async def open(self, url: str) -> Page:
        """A new tab, listened to from before it loads `url`."""
        async with self.http.put(f"{self.base}/json/new?about:blank") as resp:
            target = await resp.json()
        page = Page(await self.http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0))
        self._readers.append(asyncio.create_task(page.read()))
        for domain in ("Runtime", "Log", "Network", "Page"):
            await page.send(f"{domain}.enable")
        await page.send("Page.navigate", url=url)
        return page

    async def close(self) -> None:
        """Asks Chromium to quit, so that it ends its renderers itself (`procs` kills what is left)."""
        for reader in self._readers:
            reader.cancel()
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with self.http.get(f"{self.base}/json/version") as resp:
                address = (await resp.json())["webSocketDebuggerUrl"]
            async with self.http.ws_connect(address) as ws:
                await ws.send_json({"id": 1, "method": "Browser.close"})
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 10)
        await self.http.close()


@contextlib.asynccontextmanager
async def chromium(procs: Processes, profile: Path) -> AsyncIterator[Browser]:
    """Chromium for the block; `procs` ends its process group (and so its renderers) with the test."""
    browser = Browser(procs, profile)
    try:
        yield await browser.started()
    finally:
        await browser.close()
