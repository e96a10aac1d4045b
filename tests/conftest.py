"""Shared fixtures: a real service on a real SQLite file, a real HTTP client, a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest

# Never touch a real keychain: the "fail" backend makes the app use its user-only token file.
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.fail.Keyring"
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from app.core.service import AppService  # noqa: E402
from app.server.app import make_app  # noqa: E402
from app.store.store import Store  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    """The store alone, on a fresh database file."""
    opened = Store(tmp_path / "lmsp.sqlite3")
    await opened.open()
    yield opened
    await opened.close()


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[AppService]:
    svc = AppService(tmp_path / "data")
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture
async def api(service: AppService, aiohttp_client: Any) -> Any:
    """An aiohttp test client on a real loopback port, authorised as the owner."""
    client = await aiohttp_client(make_app(service))
    token = await service.owner_token()
    client.session.headers["Authorization"] = f"Bearer {token}"
    client.token = token
    return client


class Headless:
    """`lmsp-tray --headless` as a real child process, to be stopped or SIGKILLed."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.token = ""
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def start(self, timeout: float = 60.0, preexec: Any = None) -> "Headless":
        """`preexec`: run in the child before it starts (e.g. to lower its resource limits)."""
        (self.data_dir / "service.json").unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "app", "--headless", "--data-dir", str(self.data_dir),
                                      "--port", "0"], cwd=ROOT, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                     preexec_fn=preexec)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"service exited: {self.log.read_text()[-2000:]}"
            try:
                self.url = json.loads((self.data_dir / "service.json").read_text())["url"]
                if self.get("/health")[0] == 200:
                    self.token = (self.data_dir / "owner_token").read_text().strip()
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise TimeoutError("service did not become healthy")

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
                ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Content-Type": "application/json", **({"Authorization": f"Bearer {self.token}"} if self.token else {}),
            **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return self.request("POST", path, body)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def engine_pids(self) -> list[int]:
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


@pytest.fixture
def headless(tmp_path: Path) -> Iterator[Headless]:
    proc = Headless(tmp_path / "data")
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.kill()


def wait_until(predicate: Any, timeout: float = 60.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")
