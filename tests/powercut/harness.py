"""The app on the power-cut file system, under work from several clients, cut again and again.

`Harness.cycle(mode, seed)` lets the clients work for a random moment, cuts the power and SIGKILLs
the app in the same breath, remounts, checks the disk as the cut left it (`check_disk`), restarts
the app and checks it again through its API (`check_service`). Every acknowledgement the service
gave (a 2xx answer) is in the `Ledger`; what the service never acknowledged may be lost, nothing
acknowledged may be. The checks are issue 41's list; a broken one raises AssertionError.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.tasks import output
from tests.powercut import PowerCutMount

TERMINAL = ("completed", "failed", "cancelled")
POLICIES = ("fail", "retry", "resume")
# A state, and the states a task acknowledged in it may be found in later.
LATER = {"queued": {"queued", "loading", "running", "cancelling", *TERMINAL},
         "cancelling": {"cancelling", "cancelled"}, "cancelled": {"cancelled"}, "completed": {"completed"}}
RETENTIONS = (3600, 7200, 86400, 604800)
SECRET = "A secret: do not keep me."


@dataclass
class Ledger:
    """Every acknowledgement the service gave, by what it acknowledged."""
    tasks: dict[str, str] = field(default_factory=dict)              # task id -> the state acknowledged
    responses: dict[str, str] = field(default_factory=dict)          # task id -> its response id
    texts: dict[str, str] = field(default_factory=dict)              # task id -> the completed output seen
    keyed: dict[str, tuple[dict[str, Any], str]] = field(default_factory=dict)  # key -> (body, task id)
    tokens: list[str] = field(default_factory=list)                  # client tokens handed over
    retention: set[int] = field(default_factory=set)                 # what the setting may be now
    chain: list[str] = field(default_factory=list)                   # a conversation, response by response
    unstored: set[str] = field(default_factory=set)                  # `store: false` responses answered
    download: str | None = None                                      # the download's task id
    acks: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ack(self, what: str, key: Any, value: Any) -> None:
        with self.lock:
            self.acks += 1
            target = getattr(self, what)
            if isinstance(target, dict):
                target[key] = value
            elif isinstance(target, list):
                target.append(value)
            else:
                target.add(value)


class Harness:
    def __init__(self, mount: PowerCutMount, app: Any, hub: Any, model: Any, rng: random.Random) -> None:
        self.mount, self.app, self.hub, self.model, self.rng = mount, app, hub, model, rng
        self.ledger = Ledger()
        self.owner = ""
        self.settled: set[str] = set()  # ended tasks whose event log was checked once it ended
        self.tokens_seen = 0  # client tokens checked after a cut at least once
        self.figures = {"cuts": 0, "kills": 0, "tasks_checked": 0, "events_checked": 0, "retries": 0,
                        "tokens_checked": 0}

    @property
    def db(self) -> Path:
        return self.app.data_dir / "lmsp.sqlite3"

    def start(self) -> None:
        self.app.start(timeout=90)
        if not self.owner:
            self.owner = self.app.token
        assert self.app.token == self.owner, "the owner token changed across the cut"

    # -- the clients ------------------------------------------------------------------------------

    def work(self, stop: threading.Event, seed: int) -> None:
        """One client: a random action at a time until `stop`. A failed request acknowledged nothing."""
        rng = random.Random(seed)
        actions = [self.submit, self.submit, self.submit_keyed, self.cancel, self.poll, self.poll, self.pair,
                   self.converse, self.unstored]
        while not stop.is_set():
            try:
                rng.choice(actions)(rng)
            except (OSError, ValueError, urllib.error.URLError):  # the service died under us
                time.sleep(0.05)

    def body(self, rng: random.Random) -> dict[str, Any]:
        return {"input": f"Count for me, request {rng.randrange(10**9)}.", "background": True,
                "max_output_tokens": rng.randrange(4, 40), "on_restart": rng.choice(POLICIES)}

    def submit(self, rng: random.Random) -> None:
        status, created = self.app.post("/v1/responses", self.body(rng))
        if status == 202:
            self.ledger.ack("responses", created["task"]["id"], created["id"])
            self.ledger.ack("tasks", created["task"]["id"], "queued")

    def submit_keyed(self, rng: random.Random) -> None:
        key, body = f"cut-{rng.randrange(10**12)}", self.body(rng)
        status, created = self.app.request("POST", "/v1/responses", body, {"Idempotency-Key": key})
        if status == 202:
            self.ledger.ack("responses", created["task"]["id"], created["id"])
            self.ledger.ack("tasks", created["task"]["id"], "queued")
            self.ledger.ack("keyed", key, (body, created["task"]["id"]))

    def cancel(self, rng: random.Random) -> None:
        with self.ledger.lock:
            open_ = [t for t, s in self.ledger.tasks.items() if s == "queued"]
        if open_:
            task_id = rng.choice(open_)
            status, task = self.app.post(f"/v1/tasks/{task_id}/cancel", {})
            if status in (200, 202) and task.get("status") in ("cancelling", "cancelled"):
                self.ledger.ack("tasks", task_id, task["status"])

    def poll(self, rng: random.Random) -> None:
        with self.ledger.lock:
            known = list(self.ledger.responses.items())
        if known:
            task_id, response_id = rng.choice(known)
            status, response = self.app.get(f"/v1/responses/{response_id}")
            if status == 200 and response["status"] == "completed":
                self.ledger.ack("texts", task_id, response["output_text"])
                self.ledger.ack("tasks", task_id, "completed")

    def pair(self, rng: random.Random) -> None:
        status, created = self.app.request("POST", "/v1/pairings", {
            "client_name": f"App {rng.randrange(1000)}", "scopes": ["responses:read", "responses:write"]},
            {"Authorization": ""})
        if status != 202:
            return
        if self.app.post(f"/v1/pairings/{created['id']}/approve", {})[0] != 200:
            return
        status, shown = self.app.request("GET", f"/v1/pairings/{created['id']}", None, {"Authorization": ""})
        if status == 200 and "token" in shown:
            self.ledger.ack("tokens", None, shown["token"])

    def set_retention(self, rng: random.Random) -> None:
        """Settings are changed by one client only: the last value acknowledged is the one to find
        (or the one in flight when the power went)."""
        value = rng.choice(RETENTIONS)
        with self.ledger.lock:
            self.ledger.retention.add(value)
        status, _ = self.app.request("PATCH", "/v1/settings", {"retention_seconds": value})
        if status == 200:
            with self.ledger.lock:
                self.ledger.acks += 1
                self.ledger.retention = {value}

    def converse(self, rng: random.Random) -> None:
        with self.ledger.lock:
            previous = self.ledger.chain[-1] if self.ledger.chain else None
        body: dict[str, Any] = {"input": "And then?", "max_output_tokens": 6}
        if previous:
            body["previous_response_id"] = previous
        status, response = self.app.post("/v1/responses", body)
        if status == 200 and response["status"] == "completed":
            self.ledger.ack("chain", None, response["id"])

    def unstored(self, rng: random.Random) -> None:
        status, response = self.app.post("/v1/responses", {"input": SECRET, "store": False,
                                                            "max_output_tokens": 6})
        if status == 200:
            self.ledger.ack("unstored", None, response["id"])

    def download(self) -> None:
        status, task = self.app.post("/v1/models/downloads", {"repo": self.model[0], "file": self.model[1].name})
        assert status == 202, task
        self.ledger.download = task["id"]

    # -- one cut ----------------------------------------------------------------------------------

    def cycle(self, mode: str | None, seed: int, clients: int = 3, most: float = 1.5,
              kill_in_recovery: bool = False) -> dict[str, int]:
        """One round: work, then the power cut ("drop" or "torn") and a SIGKILL at once, or (None)
        the SIGKILL alone; `kill_in_recovery`: the first start after it is killed too, mid-way."""
        stop = threading.Event()
        workers = [threading.Thread(target=self.work, args=(stop, seed * 10 + i), daemon=True) for i in range(clients)]
        settings = threading.Thread(target=self._settings_loop, args=(stop, seed), daemon=True)
        for worker in [*workers, settings]:
            worker.start()
        time.sleep(self.rng.uniform(0.1, most))
        lost = self.mount.cut_power(mode, seed) if mode else {}
        self.app.kill()
        stop.set()
        for worker in [*workers, settings]:
            worker.join(60)
        if mode:
            self.mount.unmount()
            self.mount.mount()
            self.app.env["LMSP_BOOTED_AT"] = str(time.time())  # the reboot a power cut is
        self.check_disk()
        if kill_in_recovery:
            self.interrupted_start()
        self.start()
        self.check_service()
        self.figures["cuts" if mode else "kills"] += 1
        return lost

    def interrupted_start(self) -> None:
        """A start SIGKILLed within its first second or so: in its recovery (after some 0.4 s of
        imports, with the scripted engine), or just before or after."""
        app = self.app
        with app.log.open("ab") as log:
            app.proc = app.procs.popen([*app.command, "--headless", "--data-dir", str(app.data_dir), "--port", "0"],
                                       cwd=app.cwd, env=app.env, stdout=log, stderr=-2)
        time.sleep(self.rng.uniform(0.2, 1.2))
        app.kill()
        self.figures["killed_starting"] = self.figures.get("killed_starting", 0) + 1

    def _settings_loop(self, stop: threading.Event, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                self.set_retention(rng)
            except (OSError, ValueError, urllib.error.URLError):
                pass
            stop.wait(rng.uniform(0.05, 0.3))

    # -- the checks -------------------------------------------------------------------------------

    def check_disk(self) -> None:
        """The database as the cut left it, before the app touches it again."""
        assert not list(self.app.data_dir.glob("*.corrupt-*")), "the database was found corrupt"
        conn = sqlite3.connect(self.db)
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            # Nothing half there: no response without its task, no task without its opening events.
            assert conn.execute("SELECT count(*) FROM responses r LEFT JOIN tasks t ON t.response_id = r.id "
                                "WHERE t.id IS NULL").fetchone()[0] == 0, "a response without its task"
            assert conn.execute("SELECT count(*) FROM tasks WHERE kind = 'response' "
                                "AND last_sequence_number < 1").fetchone()[0] == 0, "a task without its events"
            tasks = dict(conn.execute("SELECT id, status FROM tasks").fetchall())
            with self.ledger.lock:
                acknowledged = dict(self.ledger.tasks)
                texts = dict(self.ledger.texts)
            for task_id, state in acknowledged.items():
                assert task_id in tasks, f"acknowledged task {task_id} ({state}) lost"
                assert tasks[task_id] in LATER[state], f"{task_id} acknowledged {state}, found {tasks[task_id]}"
            # An ended task's log changes no more: checked once ended, then now and then (a soak
            # builds up hundreds of thousands).
            pool = sorted(self.settled & set(tasks))
            again = self.rng.sample(pool, min(100, len(pool)))
            for task_id in [t for t in tasks if t not in self.settled] + again:
                self._check_events(conn, task_id, texts.get(task_id))
                if tasks[task_id] in TERMINAL:
                    self.settled.add(task_id)
            self.figures["tasks_checked"] += len(acknowledged)
        finally:
            conn.close()

    def _check_events(self, conn: sqlite3.Connection, task_id: str, seen: str | None) -> None:
        rows = conn.execute("SELECT sequence_number, data FROM task_events WHERE task_id = ? ORDER BY sequence_number",
                            (task_id,)).fetchall()
        assert [n for n, _ in rows] == list(range(len(rows))), f"{task_id}: events not gap-free from 0"
        status, attempt, kind = conn.execute("SELECT status, attempt, kind FROM tasks WHERE id = ?",
                                             (task_id,)).fetchone()
        self.figures["events_checked"] += len(rows)
        if kind != "response":
            return
        text = output.read(conn, task_id)[1]
        events = [json.loads(data) for _, data in rows]
        deltas = "".join(e["delta"] for e in events
                         if e["type"] == "response.output_text.delta" and e["attempt"] == attempt)
        if status == "completed":
            assert deltas == text, f"{task_id}: the deltas are not the output"
        if seen is not None:
            assert text == seen, f"{task_id}: the completed output changed"

    def check_service(self) -> None:
        """Through the restarted app: retries, tokens, settings, conversation, `store: false`."""
        before = self._count("tasks")
        with self.ledger.lock:
            keyed = list(self.ledger.keyed.items())
            tokens = list(self.ledger.tokens)
            chain = list(self.ledger.chain)
            unstored = set(self.ledger.unstored)
            retention = set(self.ledger.retention)
        for key, (body, task_id) in self.rng.sample(keyed, min(5, len(keyed))):
            status, again = self.app.request("POST", "/v1/responses", body, {"Idempotency-Key": key})
            assert status in (200, 202) and again["task"]["id"] == task_id, (key, status, again)
            self.figures["retries"] += 1
        assert self._count("tasks") == before, "a retry with an acknowledged key made a second task"
        # The tokens handed out since the last check, and a sample of the older ones (a soak's thousands).
        older, self.tokens_seen = tokens[:self.tokens_seen], len(tokens)
        for token in tokens[len(older):] + self.rng.sample(older, min(20, len(older))):
            status, _ = self.app.request("GET", "/v1/responses/resp_nothing", None,
                                         {"Authorization": f"Bearer {token}"})
            assert status == 404, f"a client's token stopped working ({status})"
            self.figures["tokens_checked"] += 1
        status, settings = self.app.get("/v1/settings")
        assert status == 200 and (not retention or settings["retention_seconds"] in retention), (settings, retention)
        for response_id in chain[-2:]:
            assert self.app.get(f"/v1/responses/{response_id}")[0] == 200, f"conversation turn {response_id} lost"
        for response_id in unstored:
            assert self.app.get(f"/v1/responses/{response_id}")[0] == 404, f"store: false {response_id} still kept"
        # ...and not in the files either (a deleted row's old copies linger in the WAL): none was
        # answered since this start.
        files = b"".join(p.read_bytes() for p in self.app.data_dir.glob("lmsp.sqlite3*"))
        assert SECRET.encode() not in files, "a store: false prompt is still on the disk after the restart"
        self.ledger.unstored -= unstored

    def _count(self, table: str) -> int:
        conn = sqlite3.connect(self.db)
        try:
            return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
        finally:
            conn.close()

    def check_download(self, timeout: float = 120.0) -> str:
        """The download ends completed once the cuts stop, and its model file is the hub's, byte for byte."""
        assert self.ledger.download is not None
        deadline = time.monotonic() + timeout
        while (task := self.app.get(f"/v1/tasks/{self.ledger.download}")[1])["status"] not in TERMINAL:
            assert time.monotonic() < deadline, f"the download did not end: {task}"
            time.sleep(0.2)
        assert task["status"] == "completed", task
        blobs = list(Path(self.app.env["HF_HOME"]).glob("hub/models--*/blobs/*"))
        assert len(blobs) == 1, blobs
        digest = hashlib.sha256(blobs[0].read_bytes()).hexdigest()
        assert digest == self.hub.repos[self.model[0]][self.model[1].name].sha256, "the model file is not the hub's"
        return digest
