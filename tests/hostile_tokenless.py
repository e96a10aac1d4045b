"""The red team's P3 as cases of tests/test_hostile_inputs.py: one app without a token on the open
Ollama listener tries to spend the limits every such app shares (it is one client), while
another one, a process of its own, asks for a token: it must be answered within its own idle
time + ENGINE_BOUND, as the harness then checks for a paired /v1 app.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.conftest import Headless, free_port
from tests.hostile import ENGINE_BOUND, Attack, exchange

ONE_TOKEN = {"model": DEFAULT_MODEL_ID, "prompt": "Say hi", "stream": False,
             "options": {"num_predict": 1, "temperature": 0}}
HOLD = 32  # half-sent bodies: an eighth of max_connections, the share of one client
ROOT = Path(__file__).resolve().parent.parent
# Another app: one request from a process of its own, timed there; prints status, seconds, body.
ANOTHER_APP = ("import json, sys, time\nfrom tests.hostile import exchange\nstarted = time.monotonic()\n"
               "status, text = exchange(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].encode() or None)\n"
               "print(json.dumps([status, time.monotonic() - started, text[:200]]))")


def _open_listener(attack: Attack) -> str:
    """The Ollama listener opened to apps without a token (the owner's setting): its URL."""
    port = free_port()
    status, text = exchange(attack.url, "PATCH", "/v1/settings", json.dumps({"ollama_api": "open",
                                                                             "ollama_port": port}).encode(),
                            headers={"Authorization": f"Bearer {attack.owner}"})
    assert status == 200, text
    return f"http://127.0.0.1:{port}"


def _another_app(attack: Attack, url: str, method: str, path: str, body: Any, within: float, what: str) -> float:
    """`body` sent to `path` by another app without a token, a process of its own: answered 200
    within `within` seconds (a broken bound if not). The seconds it took."""
    args = [sys.executable, "-c", ANOTHER_APP, url, method, path, json.dumps(body) if body is not None else ""]
    try:
        done = subprocess.run(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              timeout=within + 10, check=False)
        status, took, text = json.loads(done.stdout) if done.returncode == 0 else (0, within + 10, done.stderr[-200:])
    except subprocess.TimeoutExpired:
        status, took, text = 0, within + 10, "no answer"
    attack.note(f"{what}: {status} in {took:.2f} s ({text if status != 200 else 'ok'})")
    attack.bound(status == 200 and took <= within, f"{what} answered 200 within {within:.1f} s "
                 f"(got {status} in {took:.1f} s: {text})")
    return float(took)


def _hold(url: str, stop: threading.Event) -> None:
    """HOLD connections that each send the headers of a 1 000-byte body and 9 bytes of it, all
    replaced every 9 s (the red team's p_shared_client.py)."""
    parts = urlsplit(url)
    head = (f"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1:{parts.port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{\"model\":").encode()
    while not stop.is_set():
        held = []
        for _ in range(HOLD):
            try:
                sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), timeout=5)
                sock.sendall(head)
                held.append(sock)
            except OSError:
                break
        stop.wait(9)
        for sock in held:
            sock.close()


def half_sent_bodies(attack: Attack, _: Headless) -> None:
    """Every other Ollama app got 429 for as long as one process held 32 half-sent bodies."""
    url = _open_listener(attack)
    idle = _another_app(attack, url, "POST", "/api/generate", ONE_TOKEN, 60, "another tokenless app, idle, 1 token")
    stop = threading.Event()
    holder = threading.Thread(target=_hold, args=(url, stop))
    holder.start()
    try:
        time.sleep(1)
        for i in range(3):
            _another_app(attack, url, "GET", "/api/tags", None, 2, f"beside {HOLD} half-sent bodies, "
                         f"another tokenless app's /api/tags {i + 1}/3")
            _another_app(attack, url, "POST", "/api/generate", ONE_TOKEN, idle + ENGINE_BOUND,
                         f"beside {HOLD} half-sent bodies, another tokenless app's 1 token {i + 1}/3")
            attack.send("/v1/responses", {"input": "Say hi", "max_output_tokens": 1, "temperature": 0},
                        within=idle + ENGINE_BOUND, what=f"beside them, a paired app's 1 token on /v1 {i + 1}/3")
            time.sleep(3)  # across the holder's 408s and its reconnections
    finally:
        stop.set()
        holder.join()


def stored_bytes(attack: Attack, _: Headless) -> None:
    """Prompts of 8 MB that an app without a token sent filled the shared 256 MiB, kept for the
    retention period: every Ollama app got 429 with Retry-After 7 days (red team P3,
    p_storage_lockout.py). Now that app fills its own part, which leaves the disk a minute after.
    Here prompts of 4 MB fill it: the same bytes, and each request's passing copies of its body
    (some 40 MiB for 8 MB, which the allocator keeps) stay within the case's RSS budget."""
    url = _open_listener(attack)
    idle = _another_app(attack, url, "POST", "/api/generate", ONE_TOKEN, 60, "another tokenless app, idle, 1 token")
    codes: dict[int, int] = {}
    refused = ""
    started = time.monotonic()
    size = 4_000_000
    while size >= 1:  # 4 MB prompts until one is refused, then smaller ones, halving, to fill it to the brim
        body = json.dumps({**ONE_TOKEN, "prompt": "a" * size}).encode()
        status, text = exchange(url, "POST", "/api/generate", body, within=60)
        codes[status] = codes.get(status, 0) + 1
        if status == 429:
            refused, size = text, size // 2
        if sum(codes.values()) >= 150:
            break
    attack.note(f"prompts of up to 4 MB from one tokenless app for {time.monotonic() - started:.1f} s: {codes}; "
                f"refused with {refused[:160]}")
    attack.bound(set(codes) <= {200, 400, 429}, f"every prompt answered 200, 400 (too long for the context) or "
                 f"429 (got {codes})")
    _another_app(attack, url, "POST", "/api/generate", ONE_TOKEN, idle + ENGINE_BOUND,
                 "beside it, another tokenless app's 1 token")
    chat = {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": ONE_TOKEN["options"]}
    _another_app(attack, url, "POST", "/api/chat", chat, idle + ENGINE_BOUND, "beside it, another tokenless app's "
                 "chat 'hi'")


CASES: dict[str, Callable[[Attack, Headless], None]] = {
    "P3-a-tokenless-app-holds-32-half-sent-bodies": half_sent_bodies,
    "P3-a-tokenless-app-fills-the-stored-bytes": stored_bytes,
}
