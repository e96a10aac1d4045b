"""Logs go to a rotating file, and no token ever appears in them."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from app import logs
from tests.conftest import Headless, proc_stat, wait_until


def test_no_token_reaches_the_log(headless: Headless) -> None:
    headless.start()
    owner = headless.token
    status, pairing = headless.request("POST", "/v1/pairings", {"client_name": "Logger", "scopes": ["models:read"]},
                                       headers={"Authorization": ""})
    assert status == 202
    assert headless.post(f"/v1/pairings/{pairing['id']}/approve", {})[0] == 200
    client_token = headless.get(f"/v1/pairings/{pairing['id']}")[1]["token"]
    for token in (client_token, "lmsp_" + "x" * 43):  # a good one, and a wrong one that gets refused
        req = urllib.request.Request(headless.url + "/v1/models", headers={"Authorization": f"Bearer {token}"})
        try:
            urllib.request.urlopen(req, timeout=10).read()
        except urllib.error.HTTPError:
            pass
    headless.post("/v1/responses", {"input": f"my token is {owner}", "max_output_tokens": 2})
    assert headless.terminate() == 0
    log_files = list((headless.data_dir / "logs").glob("lmsp-tray.log*"))
    text = "".join(p.read_text() for p in log_files) + headless.log.read_text()
    assert "serving LMSP on" in text  # the log is really written
    assert owner not in text and client_token not in text


def raw_request(url: str, head: bytes) -> bytes:
    """Send `head` as is (no client library would send a malformed header) and read the answer."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_a_malformed_authorization_header_leaves_no_token_in_the_log(headless: Headless) -> None:
    """aiohttp's parser puts the raw header line of a malformed request in its exception, and the
    formatter appends that traceback after any filter ran: the token must not survive either."""
    headless.start()
    owner = headless.token
    for header in (f"Bearer {owner}\x7f", f"Bearer {owner[:20]}\x00{owner[20:]}", f"Bearer {owner}{'A' * 9000}",
                   f"Bearer {owner[:20]}\x7f{owner[20:]}"):
        answer = raw_request(headless.url, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                             b"Authorization: " + header.encode("latin-1") + b"\r\n\r\n")
        assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), answer[:200]
    assert headless.terminate() == 0
    logs = (headless.data_dir / "logs").glob("lmsp-tray.log*")
    text = "".join(p.read_text() for p in logs) + headless.log.read_text()
    assert "serving LMSP on" in text
    assert owner[5:25] not in text and owner[25:] not in text, text[-3000:]


def test_anything_shaped_like_a_token_is_redacted(tmp_path: Path) -> None:
    file = logs.setup(tmp_path / "logs")
    try:
        logging.getLogger("somewhere").warning("oops %s", "lmsp_abcdefghijklmnopqrstuvwxyz0123456789")
        for handler in logging.getLogger().handlers:
            handler.flush()
        text = wait_until(lambda: file.read_text())
        assert "lmsp_[redacted]" in text and "abcdefghijklmnop" not in text
    finally:
        logging.basicConfig(force=True)


def test_a_repeated_error_is_logged_a_few_times_not_ten_thousand(tmp_path: Path) -> None:
    """asyncio logs every failed accept() when descriptors run out: such a flood must not rotate
    the whole history away. Other messages still get through meanwhile."""
    file = logs.setup(tmp_path / "logs")
    try:
        flood = logging.getLogger("asyncio")
        for _ in range(10_000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                flood.exception("socket.accept() out of system resource\nsocket: <socket fd=7>")
        logging.getLogger("app").warning("something else happened")
        for handler in logging.getLogger().handlers:
            handler.flush()
        text = file.read_text()
        assert text.count("socket.accept() out of system resource") == 20
        assert "something else happened" in text
        assert len(list((tmp_path / "logs").glob("lmsp-tray.log.*"))) == 0  # nothing rotated away
    finally:
        logging.basicConfig(force=True)


def test_routine_lines_of_a_busy_service_are_never_dropped(tmp_path: Path) -> None:
    file = logs.setup(tmp_path / "logs")
    try:
        for n in range(500):
            logging.getLogger("app.tasks.kinds.generation").info("task %s: starting", f"task_{n}")
        for handler in logging.getLogger().handlers:
            handler.flush()
        assert file.read_text().count(": starting") == 500
    finally:
        logging.basicConfig(force=True)


def gone(pid: int) -> bool:
    """Dead: a zombie its parent can reap (its other threads ended too), or no process at all."""
    try:
        return proc_stat(pid)[0] in ("Z", "X") and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def test_a_stderr_nobody_reads_stops_nothing(headless: Headless) -> None:
    """Started with its output on a pipe its parent never reads (as some launchers and scripts
    do): once the pipe's 64 KiB are full, the service must still answer, the log file must still
    get every line, and it must still stop when told."""
    headless.start(output=subprocess.PIPE)
    tasks = 400  # each logs two lines, some 240 bytes: the pipe fills after about 270
    for n in range(tasks):
        started = time.monotonic()
        status, _ = headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 1})
        # A service held by its full pipe never answers; the first answer waits for the model's
        # load too (14 s with fast mode's crash and the safe reload, on a loaded machine).
        assert status == 200 and time.monotonic() - started < (60 if n == 0 else 10), f"request {n} took too long"
    file = headless.data_dir / "logs" / "lmsp-tray.log"
    wait_until(lambda: file.read_text().count(": left the engine") == tasks, timeout=10)
    # A fresh engine: what llama-server prints as it loads goes to the log, not into the full
    # pipe, where it would wait for room that never comes.
    # Two loads so far where fast mode crashes on this CPU (AMX) and the engine went on in safe mode.
    loads = file.read_text().count("llama_server: model loaded")
    killed = headless.engine_pids()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: all(gone(pid) for pid in killed))  # else the request finds it dying: engine_crashed
    status, answer = headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 1})
    assert status == 200, answer
    assert loads and file.read_text().count("llama_server: model loaded") == loads + 1
    started = time.monotonic()
    assert headless.terminate() == 0
    assert time.monotonic() - started < 10


@pytest.mark.scripted  # about descriptor 2, not llama.cpp: scripted engines (tests/scripted.py)
def test_started_with_stderr_closed_no_file_takes_its_place(headless: Headless) -> None:
    """Else the next file opened gets descriptor 2 and everything written to stderr."""
    headless.start(preexec=lambda: os.close(2))
    assert headless.proc is not None
    assert os.readlink(f"/proc/{headless.proc.pid}/fd/2") == os.devnull
    assert headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 1})[0] == 200
    assert headless.terminate() == 0
    assert (headless.data_dir / "logs" / "lmsp-tray.log").read_text().count("serving LMSP on") == 1


def test_lines_that_outrun_the_log_are_counted_not_lost_silently(tmp_path: Path) -> None:
    file = tmp_path / "lines.log"
    slow = logging.FileHandler(file)
    handler = logs.Detached(slow, limit=5)
    gate = threading.Lock()
    gate.acquire()  # the writing thread waits, as on a full pipe, until released
    emit = slow.emit
    slow.emit = lambda record: (gate.acquire(), gate.release(), emit(record))  # type: ignore[method-assign]
    log = logging.getLogger("tests.outrun")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(handler)
    try:
        log.info("line 0")
        wait_until(lambda: handler.queue.empty())  # the thread holds it, waiting at the gate
        for n in range(1, 20):
            log.info("line %d", n)
        gate.release()
        handler.flush()
        log.info("after")
        handler.flush()
        lines = file.read_text().splitlines()
        assert sum("line " in x for x in lines) == 6  # one taken by the thread, five queued
        assert "14 log lines were not written here" in lines[-2] and lines[-1].endswith("after")
    finally:
        log.removeHandler(handler)
        handler.close()
