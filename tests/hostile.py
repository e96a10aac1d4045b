"""The measuring side of tests/test_hostile_inputs.py: a lag probe in its own process, and one
hostile app's requests with a deadline, each outcome written down as a figure and, when it passes
a bound, as a broken bound.

The probe runs in a process of its own (`python -m tests.hostile URL PID OUT`), so that what the
test process does meanwhile (building an 8 MiB body, holding 300 sockets) cannot delay it: every
round trip it records is the service's. Stdlib only at the top: the probe imports nothing else.
"""

from __future__ import annotations

import http.client
import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

PROBE_INTERVAL = 0.05  # seconds between the start of two /health round trips
ENGINE_BOUND = 2.0   # s: beyond its idle time, for another app's short response while or after a case runs
MIB = 1 << 20


def exchange(url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
             within: float = 30.0) -> tuple[int, str]:
    """One request on its own connection, closed after `within` seconds (sending and waiting
    together): then the client has left, and TimeoutError says so. (status, body text)."""
    parts = urlsplit(url)
    deadline = time.monotonic() + within
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=within)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        assert conn.sock is not None
        conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    except TimeoutError:
        raise
    except (OSError, http.client.HTTPException) as exc:  # a reset, a refusal, a cut answer: dropped
        raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        conn.close()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _probe(url: str, pid: int, out: Path) -> None:
    """GET /health every PROBE_INTERVAL, forever (the test kills it): one line per round trip,
    `start end status rss_kib` (status 0: no answer, the connection refused or reset)."""
    with out.open("a", buffering=1) as lines:
        while True:
            start = time.monotonic()
            try:
                status, _ = exchange(url, "GET", "/health", within=600)
            except (TimeoutError, ConnectionError):
                status = 0
            end = time.monotonic()
            lines.write(f"{start:.6f} {end:.6f} {status} {rss_kib(pid)}\n")
            time.sleep(max(0.0, start + PROBE_INTERVAL - time.monotonic()))


@dataclass
class Lag:
    """What the probe saw over one window: round trips (seconds), failures, peak RSS."""
    trips: list[float]
    failures: int
    peak_rss_mib: float

    @property
    def p100(self) -> float:
        return max(self.trips, default=0.0)

    def __str__(self) -> str:
        trips = sorted(self.trips)
        p50 = trips[len(trips) // 2] if trips else 0.0
        return (f"/health p100 {self.p100 * 1000:.0f} ms (p50 {p50 * 1000:.0f} ms, {len(trips)} round trips, "
                f"{self.failures} unanswered)")


class Probe:
    """The lag probe's process, started by `start` and read (and ended) by `stop`."""

    def __init__(self, procs: Any, url: str, pid: int, out: Path) -> None:
        self.procs, self.url, self.pid, self.out = procs, url, pid, out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Probe:
        self.out.write_text("")
        root = Path(__file__).resolve().parent.parent
        self.proc = self.procs.popen([sys.executable, "-m", "tests.hostile", self.url, str(self.pid), str(self.out)],
                                     cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
        while not self.out.read_text():  # its first round trip: it is measuring
            assert self.proc.poll() is None, "the lag probe exited"
            time.sleep(0.01)
        return self

    def stop(self, since: float) -> tuple[Lag, Lag]:
        """What it saw before `since` (the idle service) and from `since` on (the attack)."""
        assert self.proc is not None
        stopped = time.monotonic()
        self.proc.kill()
        self.proc.wait()
        rows = [(float(start), float(end), status, int(kib)) for start, end, status, kib in
                (line.split() for line in self.out.read_text().splitlines() if line.count(" ") == 3)]
        idle, attack = ([row for row in rows if (row[0] >= since) == later] for later in (False, True))
        # A round trip still waiting when the window closed counts for as long as it has waited.
        last_end = max((end for _, end, _, _ in rows), default=stopped)
        waiting = [stopped - last_end - PROBE_INTERVAL] if stopped - last_end > PROBE_INTERVAL else []
        return _lag(idle, []), _lag(attack, waiting)


def _lag(rows: list[tuple[float, float, str, int]], waiting: list[float]) -> Lag:
    return Lag([end - start for start, end, _, _ in rows] + waiting, sum(status != "200" for _, _, status, _ in rows),
               max((kib for *_, kib in rows), default=0) / 1024)


@dataclass
class Answer:
    status: int
    body: Any
    seconds: float


@dataclass
class Attack:
    """One hostile app on a running service (`url`, the owner's `owner` token): the requests it
    sends, and what they measured (`figures`) and broke (`broken`)."""
    url: str
    owner: str
    token: str
    tmp: Path
    figures: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)

    def note(self, figure: str) -> None:
        self.figures.append(figure)

    def bound(self, held: bool, what: str) -> None:
        """`what` (a bound and the figure that passed it) is broken unless `held`."""
        if not held:
            self.broken.append(what)

    def send(self, path: str, body: Any, within: float, what: str, patience: float | None = None,
             token: str | None = None, headers: dict[str, str] | None = None, method: str = "POST",
             expect: int | None = None, code: str | None = None, may_leave: bool = False) -> Answer | None:
        """Send `body` (JSON, or bytes as they are) as this app (`token`: another one; "": none),
        and hold the answer to the bound: within `within` seconds, a clear LMSP 4xx error (Ollama's
        on its routes; `expect`, `code`: that status and code) or a success. The client waits `patience`
        seconds (default `within`), then leaves: None (a broken bound unless `may_leave`)."""
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        auth = {"Authorization": f"Bearer {token if token is not None else self.token}"} if token != "" else {}
        started = time.monotonic()
        try:
            status, text = exchange(self.url, method, path, raw, {**auth, **(headers or {})}, patience or within)
        except (TimeoutError, ConnectionError) as exc:
            took = time.monotonic() - started
            left = "the client left" if isinstance(exc, TimeoutError) else f"dropped ({exc})"
            self.note(f"{what}: no answer in {took:.1f} s, {left}")
            self.bound(may_leave, f"{what} answered within {within:.1f} s (it was not: {left} after {took:.1f} s)")
            return None
        took = time.monotonic() - started
        try:
            payload = json.loads(text)
        except ValueError:
            payload = text
        error = payload.get("error") if isinstance(payload, dict) else None
        summary = f"{error.get('code')}: {str(error.get('message'))[:90]}" if isinstance(error, dict) else \
            error[:90] if isinstance(error, str) else "ok"
        self.note(f"{what}: {status} in {took:.2f} s ({summary})")
        self.bound(took <= within, f"{what} answered within {within:.1f} s (took {took:.1f} s)")
        if expect is not None:
            self.bound(status == expect, f"{what} answered {expect} (got {status}: {summary})")
        if code is not None:
            self.bound(isinstance(error, dict) and error.get("code") == code, f"{what} answered {code} (got {summary})")
        elif status >= 500:
            self.bound(False, f"{what} answered a clear 4xx error or a success (got {status}: {summary})")
        if 400 <= status < 500:
            shape, named = (ollama_error, "Ollama's") if path.startswith("/api/") else (lmsp_error, "an LMSP")
            self.bound(shape(payload), f"{what}'s {status} is {named} error body (got {text[:120]!r})")
        return Answer(status, payload, took)


def lmsp_error(payload: Any) -> bool:
    """`{"error": {type, code, message, param}}` with a code and a message, and nothing else."""
    if not (isinstance(payload, dict) and set(payload) == {"error"} and isinstance(payload["error"], dict)):
        return False
    error = payload["error"]
    return set(error) == {"type", "code", "message", "param"} and bool(error["code"]) and bool(error["message"])


def ollama_error(payload: Any) -> bool:
    """Ollama's `{"error": "message"}`, what its routes answer (LMSP §15)."""
    return isinstance(payload, dict) and set(payload) == {"error"} and isinstance(payload["error"], str) \
        and bool(payload["error"])


def stored_mib(data_dir: Path) -> float:
    """The database and its WAL on disk."""
    db = data_dir / "lmsp.sqlite3"
    return sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal")) if p.exists()) / MIB


def counted_mib(data_dir: Path) -> float:
    """The stored bytes the limits count, for all clients (read-only, beside the service's writer)."""
    conn = sqlite3.connect(f"file:{data_dir / 'lmsp.sqlite3'}?mode=ro", uri=True, timeout=30)
    try:
        return float(conn.execute("SELECT COALESCE(SUM(request_bytes), 0) FROM client_usage").fetchone()[0]) / MIB
    finally:
        conn.close()


if __name__ == "__main__":
    _probe(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
