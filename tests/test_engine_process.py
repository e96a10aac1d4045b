"""The engine's process (LMSP §18): each loaded model runs in llama.cpp's own llama-server, started
with every option that decides memory and behaviour, reachable only through a private socket and
a key that is on no command line, and never outliving the app, even when the app is killed; a
server that stops making progress is killed and its tasks move on."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from app.core.service import AppService
from app.engine.parent import engine as engine_module
from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.conftest import Headless
from tests.helpers import SAY_HI, wait_until
from tests.test_api import start_background, wait_status

# Every option of llama-server that would otherwise let its defaults decide memory or behaviour.
EXPLICIT = ("--ctx-size", "--parallel", "--no-kv-unified", "--cache-ram", "--poll", "--threads", "--threads-batch",
            "--n-gpu-layers", "--fit", "--no-webui", "--batch-size", "--ubatch-size", "--repack", "--port", "--host")


def command_line(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def servers_of(pid: int) -> list[int]:
    """The llama-server processes started by the process `pid`."""
    out = subprocess.run(["pgrep", "-P", str(pid), "-x", "llama-server"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


async def test_the_server_is_reached_through_a_private_socket_and_a_key_on_no_command_line(
        api: Any, service: AppService) -> None:
    assert (await api.post("/v1/responses", json=SAY_HI)).status == 200
    engine = service.pool.engines[0]
    assert engine.pid is not None and engine._server is not None
    args = command_line(engine.pid)
    assert Path(args[0]).name == "llama-server"
    assert all(option in args for option in EXPLICIT), set(EXPLICIT) - set(args)
    key = engine._server.key
    assert key not in " ".join(args)
    socket = args[args.index("--host") + 1]
    assert socket.endswith(".sock") and stat.S_IMODE(os.stat(Path(socket).parent).st_mode) == 0o700
    # No TCP port: the socket is the only way in, and without the key it answers 401.
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as session:
        async with session.post("http://llama/completion", json={"prompt": "Hi", "n_predict": 1}) as resp:
            assert resp.status == 401
        async with session.post("http://llama/completion", json={"prompt": "Hi", "n_predict": 1},
                                headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200


# `alone`: another app's start, in a test beside it, would sweep the killed app's socket folder first.
@pytest.mark.alone
def test_no_server_outlives_the_app_when_the_app_is_killed(headless: Headless) -> None:
    headless.start()
    headless.complete(SAY_HI)
    assert headless.proc is not None
    servers = servers_of(headless.proc.pid)
    assert len(servers) == 1
    os.kill(headless.proc.pid, signal.SIGKILL)
    headless.proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in servers):
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in servers), "llama-server outlived the app"
    # Its server's socket folder: a killed app cannot remove it; the next start does.
    left = list(Path(tempfile.gettempdir()).glob(f"lmsp-{headless.proc.pid}-*"))
    assert left and all((folder / "llama.sock").exists() for folder in left), left
    headless.start()
    headless.complete(SAY_HI)
    wait_until(lambda: not any(folder.exists() for folder in left), timeout=10, what="the folders swept")
    assert headless.proc is not None and list(Path(tempfile.gettempdir()).glob(f"lmsp-{headless.proc.pid}-*"))


async def test_a_server_that_makes_no_progress_is_killed_and_its_task_carries_on(
        api: Any, service: AppService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(engine_module, "STALL_SECONDS", 2.0)
    monkeypatch.setattr(engine_module, "WATCH_SECONDS", 0.5)
    caplog.set_level(logging.INFO)
    created = await start_background(api, {"input": "Write the numbers from 1 to 1000 separated by commas.",
                                           "max_output_tokens": 60, "temperature": 0,
                                           "on_restart": "resume"})
    task_id = created["task"]["id"]
    await wait_status(api, task_id, {"running"}, timeout=120)
    engine = service.pool.engines[0]
    while engine.pid is None:
        await asyncio.sleep(0.05)
    stuck = engine.pid
    os.kill(stuck, signal.SIGSTOP)  # alive, answering nothing: as a server hung in a driver would be
    done = await wait_status(api, task_id, {"completed", "failed", "cancelled"}, timeout=300)
    assert done["status"] == "completed", done
    assert done["progress"]["output_tokens"] == 60
    assert any("made no progress" in r.getMessage() for r in caplog.records)
    assert engine.pid != stuck and not Path(f"/proc/{stuck}").exists()
    assert (await api.get(f"/v1/models/{DEFAULT_MODEL_ID}")).status == 200
