"""The runner: takes queued (and resumed) tasks to the engines and writes what they produce.

Output is written as it comes: each token's text is committed as a delta event (with the
token ids, appended to the task's output), then published. While someone follows the task live
(an SSE stream, the dashboard showing it), a token is committed as soon as the previous write
of the task has committed: a reader sees each token within milliseconds of its decoding, and
when commits are slower than decoding, the tokens that came during one commit share the next
delta, so the write rate is bounded by the commit pipeline itself. While nobody does, a task's
writes are at least QUIET_SPACING apart: every commit costs the service CPU, which on a small
machine is taken from llama.cpp's threads, and nobody would see the difference. A reader that
arrives gets what is held back at once; a cancel writes it before it. A local engine's last
token (it says so) is committed with the task's end, in the same transaction, and so is what
is held back when a task ends. Whatever a crash loses after the last commit, `resume` regenerates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from app.engine.registry import models
from app.engine.parent.engine import Engine, EngineError, Generation, Runs
from app.engine.parent.modes import EngineModes
from app.engine.net.remote import RemoteEngine, Upstreams
from app.errors import LmspError, StoreError
from app.store.store import Store
from app.tasks import calls, machine, output, records
from app.events import EventBus
from app.tasks.machine import RESPONSE
from app.tasks.states import CANCELLED, CANCELLING, COMPLETED, FAILED, LOADING, QUEUED, RUNNING

log = logging.getLogger(__name__)
BACKOFF_FIRST, BACKOFF_LAST = 0.5, 30.0  # seconds between tries of a write the database refuses
WRITE_ERRORS = (StoreError, sqlite3.Error)  # what a write may raise when the disk refuses it
# Engine errors a task fails with as they are; any other failure to open an engine is a failed load.
OWN_CODES = ("engine_crashed", "upstream_unavailable", "upstream_error")
# The least time between two writes of an unwatched task's output (seconds): at 100 tokens/s
# about ten tokens a commit instead of one (tests/bench/test_throughput.py has the figures).
QUIET_SPACING = 0.1


@dataclass(frozen=True)
class Chunk:
    """Output produced since the last write, with the progress it brings the task to."""
    ids: list[int]
    text: str
    output_tokens: int
    tokens_per_second: float | None
    events: list[calls.Event]  # what the text adds to the stream


@dataclass(frozen=True)
class Prepared:
    """What a task needs to start, read in one go: its row and request, its output so far, and its
    model's row (or why the model cannot be used)."""
    row: dict[str, Any]
    request: dict[str, Any]  # parsed once, here: a start in the claim's commit needs it too
    ids: list[int]
    text: str
    model: sqlite3.Row | None
    refused: LmspError | None
    running: bool  # already `running`: resumed, or started by its claim (on an engine that holds its model)


@dataclass(frozen=True)
class Claimed:
    """A task the runner took, whose client it was, its model's format (`gguf` runs on a local
    engine, `remote` on its endpoints), the events taking it wrote, and what it needs to start."""
    task_id: str
    client_id: str
    format: str
    events: list[machine.Event]
    task: Prepared


@dataclass
class Offer:
    """Room for one more task, held by the claims (`claim`) in flight: a free engine if there is
    one, the formats it allows, and what a claim must know of the runner at that moment. The
    claims run one after another on the writer; the first that finds a task takes the room."""
    engine: Engine | None
    ready: models.Registered | None  # the model file that engine holds ready, if any
    formats: list[str]
    busy: list[str]    # tasks with a job: a resumed one among them is not taken again
    last_client: str   # whose task was taken last
    holders: int = 1     # claims yet to settle (counted on the loop)
    taken: bool = False  # a claim took a task with it (set on the writer)


@dataclass
class Job:
    """A task on an engine, with its output so far."""
    task_id: str
    engine: Runs
    text: str = ""          # all the output text, for the final `output_text.done`
    tokens: int = 0         # output tokens produced, a resumed snapshot's included
    ids: list[int] = field(default_factory=list)  # produced, not yet written
    pending: str = ""       # text produced, not yet written
    started: float = field(default_factory=time.monotonic)
    new_tokens: int = 0
    item_id: str = ""       # the id of the response's one output message
    call: calls.CallStream | None = None  # a forced function call's output, instead of a message
    saving: asyncio.Task[bool] | None = None  # the write in flight, if any
    error: Exception | None = None  # a write of the task that failed (its output, `running`): it stops
    starting: asyncio.Future[list[machine.Event] | None] | None = None  # the write to `running`, in flight
    live: bool = True  # False once that write found a cancel first: nothing more is written
    # The engine sent its last output, or the task is ending: no more writes in the background,
    # what is left is written in the transaction that ends (or fails, or restarts) the task.
    ending: bool = False
    written_at: float = 0.0  # when the last write of its output began
    hurry: asyncio.Event = field(default_factory=asyncio.Event)  # the next write goes at once

    def add(self, ids: list[int], text: str, tokens: int) -> None:
        self.ids += ids
        self.tokens += tokens
        self.new_tokens += tokens
        self.text += text
        self.pending += text

    def reset(self) -> None:
        """The output starts again from nothing (a remote task moved to another endpoint)."""
        self.text, self.tokens, self.ids, self.pending, self.ending = "", 0, [], "", False
        if self.call is not None:
            self.call = calls.CallStream(self.call.response_id, "")

    def unwritten(self) -> bool:
        return bool(self.ids or self.pending)

    async def stop_saving(self) -> None:
        """End the writes in the background, once the one in flight is done: the caller writes
        what is left, in its own transaction."""
        self.ending = True
        self.hurry.set()  # a write held back ends its wait
        if self.saving is not None:
            await self.saving

    def take(self) -> Chunk:
        if self.call is not None:
            events = self.call.feed(self.pending)
        else:
            events = [("response.output_text.delta", {"delta": self.pending, "output_index": 0, "content_index": 0,
                                                      "item_id": self.item_id})] if self.pending else []
        chunk = Chunk(self.ids, self.pending, self.tokens, _tokens_per_second(self), events)
        self.ids, self.pending = [], ""
        return chunk


class Backoff:
    """Waits that double from half a second to half a minute, each logged once: a write that
    keeps failing (a full disk) is retried without spinning or flooding the log."""

    def __init__(self) -> None:
        self.delay = BACKOFF_FIRST

    async def wait(self, what: str) -> None:
        log.warning("%s; trying again in %.1f s", what, self.delay)
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, BACKOFF_LAST)

    def reset(self) -> None:
        self.delay = BACKOFF_FIRST


class Runner:
    def __init__(self, store: Store, bus: EventBus, engines: list[Engine], modes: EngineModes,
                 upstreams: Upstreams, engine_factory: Callable[..., Engine] = Engine) -> None:
        self.store = store
        self.engine_factory = engine_factory
        self.bus = bus
        self.engines = engines
        self.modes = modes
        self.upstreams = upstreams
        self.jobs: dict[str, Job] = {}
        self.capacity = len(engines)  # how many tasks may run at once locally (max_concurrent_tasks)
        self.remote_capacity = 8      # and on remote endpoints (max_concurrent_remote_tasks)
        self.tokens_generated = 0     # since start, for /metrics
        self.last_tokens_per_second: float | None = None
        self.paused = False
        self._wake = asyncio.Event()
        self._last_client = ""  # whose task was taken last: the next queued one is another's
        self._offer: Offer | None = None  # held by a claim in flight: one at a time
        self._stopping = False
        self._main: asyncio.Task[None] | None = None
        self._workers: set[asyncio.Task[None]] = set()
        bus.on_watch(self._hurry)

    async def write(self, fn: Any, *args: Any) -> Any:
        """A transaction whose returned events are published once it has committed."""
        return await self.bus.commit(self.store, fn, *args)

    def start(self) -> None:
        self._main = asyncio.create_task(self._schedule(), name="lmsp-runner")

    def wake(self) -> None:
        self._wake.set()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.wake()

    def busy(self, engine: Engine) -> bool:
        return any(job.engine is engine for job in self.jobs.values())

    def idle_engine(self) -> Engine | None:
        return next((e for e in self.engines[:self.capacity] if not self.busy(e)), None)

    def offer(self) -> Offer | None:
        """Room for the next task, held until `settle`; None while paused, stopping, or full. While
        a claim is in flight, its offer is shared, not made again: two offers at once would both
        count on the same free engine, and could both take the same resumed task. Shared, a
        request that arrives while the scheduler looks for work is still taken in its own commit."""
        if self.paused or self._stopping:
            return None
        if self._offer is not None:
            if self._offer.taken:
                return None  # the next offer comes once it is settled
            self._offer.holders += 1
            return self._offer
        engine = self.idle_engine()
        # No remote model, no remote task to look for: a claim that finds nothing still costs the
        # writer a transaction, and would run after every task that ends.
        remote = bool(self.upstreams.models) and self.remote_running() < self.remote_capacity
        formats = [name for name, free in (("gguf", engine is not None), ("remote", remote)) if free]
        if not formats:
            return None
        self._offer = Offer(engine, engine.ready() if engine else None, formats, list(self.jobs), self._last_client)
        return self._offer

    def settle(self, offer: Offer, claimed: Claimed | None) -> None:
        """After a claim on `offer` committed (or failed: `claimed` None): start the task it took,
        publish the events taking it wrote, and, with the last holder, let the next offer be made
        (whoever settles an offer the scheduler did not make wakes it, unless no room is left
        that the scheduler could use: one more claim finding nothing costs the writer a
        transaction)."""
        assert self._offer is offer
        offer.holders -= 1
        if offer.holders == 0:
            self._offer = None
        if claimed is None:
            return
        self._last_client = claimed.client_id
        self.bus.publish(claimed.events)
        if self._stopping:
            return  # taken as the service stops: the next start's recovery settles it
        runs: Runs | None = RemoteEngine(self.upstreams) if claimed.format == "remote" else offer.engine
        assert runs is not None
        job = self.jobs[claimed.task_id] = Job(claimed.task_id, runs)
        worker = asyncio.create_task(self._run(job, claimed.task), name=f"lmsp-task-{claimed.task_id}")
        self._workers.add(worker)
        worker.add_done_callback(self._workers.discard)

    def remote_running(self) -> int:
        return sum(isinstance(job.engine, RemoteEngine) for job in self.jobs.values())

    def resize(self, capacity: int) -> None:
        """Change how many tasks run at once; engines beyond it finish their task and then rest."""
        # Engines share the cores: several llama.cpp processes each spinning every core would
        # all run slower than one. An engine keeps its share until it is restarted.
        threads = max(1, (os.cpu_count() or 1) // capacity)
        while len(self.engines) < capacity:
            self.engines.append(self.engine_factory(f"engine{len(self.engines)}", self.modes, n_threads=threads))
        self.capacity = capacity
        self.wake()

    def cancel(self, task_id: str) -> None:
        """The database already says `cancelling`; stop the generation."""
        job = self.jobs.get(task_id)
        if job is not None:
            job.engine.cancel()

    def _hurry(self, task_id: str) -> None:
        """A live reader arrived: what the task holds back is written now, the rest as it comes."""
        job = self.jobs.get(task_id)
        if job is not None:
            job.hurry.set()

    async def accept_cancel(self, task_id: str) -> list[machine.Event] | None:
        """Commit a cancel (`request_cancel`), after the output the task holds back: what was
        generated before the cancel is kept. None when the task has already ended."""
        job = self.jobs.get(task_id)
        # Taken and queued in one step of the loop, as the task's own writes are: whichever of
        # this and the task's end takes the output first also commits first.
        held = job.take() if job is not None and job.live and job.unwritten() else None
        try:
            return await self.store.write(request_cancel, task_id, held)
        except WRITE_ERRORS as exc:
            if job is not None and held is not None:  # a piece of its output is lost: it fails, as
                job.error = exc                        # when any write of its output fails
                job.engine.cancel()
            raise

    async def _schedule(self) -> None:
        backoff = Backoff()
        while not self._stopping:
            self._wake.clear()
            offer = self.offer()
            if offer is None:
                await self._wake.wait()
                continue
            claimed, failure = None, None
            try:
                claimed = await self.store.write(claim, offer)
            except WRITE_ERRORS as exc:  # a full disk: no task can start until a write succeeds
                failure = exc
            finally:
                self.settle(offer, claimed)  # whatever the write raised: a held offer would stop every claim
            if failure is not None:
                await backoff.wait(f"cannot take the next task ({failure})")
                continue
            backoff.reset()
            if claimed is None:
                await self._wake.wait()

    async def _run(self, job: Job, task: Prepared) -> None:
        try:
            await self._execute(job, task)
        except Exception as exc:
            if isinstance(exc, StoreError) and exc.code == "disk_full":
                code, message = "disk_full", ("The disk filled up while this task ran, so it stopped; its output "
                                              "up to then is kept. Free some space and ask again.")
            else:
                log.exception("task %s failed unexpectedly", job.task_id)
                code, message = "internal_error", "An unexpected error stopped this task."
            await self._fail_when_possible(job.task_id, code, message)
        finally:
            log.info("task %s: left the engine", job.task_id)
            job.starting = None  # a write to `running` still in flight must not stop the engine's next task
            self.jobs.pop(job.task_id, None)
            self.wake()

    async def _fail_when_possible(self, task_id: str, code: str, message: str) -> None:
        """Fail the task. While the database refuses writes (a full disk) keep trying, ever more
        slowly, and keep the task: taken again, it would fail again at once, in a tight loop."""
        backoff = Backoff()
        while True:
            try:
                if await self.write(_fail, task_id, code, message) is None:
                    await self.write(_cancelled, task_id)  # a cancel was accepted meanwhile
                return
            except WRITE_ERRORS as exc:
                if self._stopping:
                    return  # the next start's recovery settles it, by its on_restart
                await backoff.wait(f"task {task_id}: cannot record that it stopped ({exc})")

    async def _execute(self, job: Job, task: Prepared) -> None:
        row = task.row
        job.item_id = records.message_id(row["response_id"])
        log.info("task %s: %s on %s (attempt %d, %d tokens so far)", job.task_id,
                 "resuming" if row["status"] == RUNNING else "starting", job.engine.name, row["attempt"],
                 row["output_tokens"])
        request = task.request
        ids, job.text = task.ids, task.text
        job.tokens = row["output_tokens"]  # a remote task's output has a count but no token ids
        if request.get("call"):
            job.call = calls.CallStream(row["response_id"], job.text)
        gen = Generation(messages=calls.prompt(request), max_tokens=row["max_output_tokens"],
                         temperature=request.get("temperature", 1.0), top_p=request.get("top_p", 1.0),
                         seed=request.get("seed"), stop=request.get("stop"), constraint=request.get("constraint"),
                         prefix_ids=ids, prefix_text=job.text, prefix_tokens=job.tokens)

        async def waiting(message: str) -> None:
            if await self.write(_waiting, job.task_id, message) is None:
                job.engine.cancel()  # a cancel was accepted while it waited

        try:
            if task.refused is not None:
                raise task.refused
            if await job.engine.open(task.model, gen, waiting):  # a fresh load: tell the GUI
                self.bus.publish([{"type": "models.changed"}])
        except (LmspError, EngineError) as exc:
            code = exc.code if isinstance(exc, LmspError) or exc.code in OWN_CODES else "model_load_failed"
            if await self.write(_fail, job.task_id, code, exc.message) is None:
                await self.write(_cancelled, job.task_id)
            return
        if not task.running:
            # `running` commits while the engine reads the prompt, so its fsync is not added to
            # the wait for the first token; nothing else of the task is written before it has.
            job.starting = asyncio.ensure_future(self.write(
                _start_running, job.task_id, job.item_id, bool(request.get("call"))))
            job.starting.add_done_callback(lambda _: _settle_start(job))
        reason, usage = "cancelled", {}
        job.started = time.monotonic()  # tokens/s counts generation, not the model load
        failure: EngineError | None = None
        try:
            async for msg in job.engine.generate(gen):
                live = await _until_running(job)
                if msg["ev"] == "done":
                    reason, usage = msg["reason"], msg
                    break
                if not live:  # the engine was told to stop (`_settle_start`), and remembers it: drop what still comes
                    continue
                if msg["ev"] == "reset":
                    await self._restart_output(job, msg["resume_mode"])
                    continue
                tokens = msg.get("tokens", len(msg["ids"]))
                job.add(msg["ids"], msg["text"], tokens)
                self.tokens_generated += tokens
                if msg.get("last"):  # `done` follows at once: this is written with the end, in one commit
                    job.ending = True
                elif job.saving is None or job.saving.done():
                    if job.saving is not None and not job.saving.result():
                        job.engine.cancel()  # the task left `running` (a cancel), or a write failed
                    job.saving = asyncio.create_task(self._save(job))
        except EngineError as exc:
            failure = exc
        if not await _until_running(job):  # a cancel came first, while the model loaded (or the write failed)
            if job.error is not None:
                raise job.error
            await self.write(_cancelled, job.task_id)
            return
        if failure is not None:
            await self._flush(job)
            if await self.write(_fail, job.task_id, failure.code, failure.message) is None:
                await self.write(_cancelled, job.task_id)
            return
        self.last_tokens_per_second = _tokens_per_second(job) or self.last_tokens_per_second
        await job.stop_saving()
        if job.error is not None:
            raise job.error
        if reason == "cancelled":
            if await self.write(_cancelled, job.task_id) is None:
                await self._flush(job)  # shutting down: keep the snapshot, recovery decides
            return
        last = job.take()
        if job.call is not None:
            ending = job.call.done("incomplete" if reason == "length" else "completed")
        else:
            ending = [("response.output_text.done", {"text": job.text, "output_index": 0, "content_index": 0,
                                                     "item_id": job.item_id})]
        if await self._end_and_hand_over(job.task_id, last, ending, reason, usage) is None:
            await self.write(_cancelled, job.task_id)

    async def _end_and_hand_over(self, task_id: str, last: Chunk, ending: list[calls.Event], reason: str,
                                 usage: dict[str, Any]) -> list[machine.Event] | None:
        """Complete the task and, in the same commit, let the next one take its engine, free since
        the generation ended: a queued task then starts without a commit of its own before it."""
        self.jobs.pop(task_id)  # nothing of it can be stopped or hurried any more
        offer, claimed = self.offer(), None
        try:
            events, claimed = await self.store.write(_complete_then_claim, offer, task_id, last, ending, reason, usage)
            if events:
                self.bus.publish(events)
            return events
        finally:
            if offer is not None:
                self.settle(offer, claimed)

    async def _restart_output(self, job: Job, resume_mode: str) -> None:
        """Drop the output written so far: the engine starts the text again (LMSP §11, `retry`).
        What was held back goes too, unwritten."""
        await job.stop_saving()
        job.reset()
        if await self.write(_reset_output, job.task_id, resume_mode) is None:
            job.engine.cancel()

    async def _save(self, job: Job) -> bool:
        """Write the output produced so far, again and again while more comes during a commit,
        until the engine's last output came (the task's end writes that). False once the task is
        no longer running (a cancel was accepted) or a write failed (kept in `job.error`: the
        generation is stopped, then the task fails)."""
        while job.unwritten() and not job.ending:
            await self._pace(job)
            if job.ending or not job.unwritten():  # the task ends, or a cancel took the output
                break
            job.written_at = time.monotonic()
            try:
                if await self.write(_save_output, job.task_id, job.take()) is None:
                    return False
            except WRITE_ERRORS as exc:
                job.error = exc
                return False
        return True

    async def _pace(self, job: Job) -> None:
        """Hold an unwatched task's output back until QUIET_SPACING after its last write began,
        unless a live reader arrives or the task must be written now (`hurry`, which this write
        answers)."""
        wait = job.written_at + QUIET_SPACING - time.monotonic()
        if wait > 0 and not job.hurry.is_set() and not self.bus.watched(job.task_id):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await job.hurry.wait()
        job.hurry.clear()

    async def _flush(self, job: Job) -> None:
        """Wait for the write in flight, then write what is left."""
        await job.stop_saving()
        if job.unwritten():
            await self.write(_save_output, job.task_id, job.take())

    async def stop(self, grace: float = 5.0) -> None:
        """Stop taking tasks; running work stops at a token and its snapshot is committed."""
        self._stopping = True
        self.wake()
        for job in list(self.jobs.values()):
            job.engine.cancel()
        if self._workers:
            await asyncio.wait(list(self._workers), timeout=grace)
        for worker in list(self._workers) + ([self._main] if self._main else []):
            worker.cancel()


def _tokens_per_second(job: Job) -> float | None:
    elapsed = time.monotonic() - job.started
    return round(job.new_tokens / elapsed, 2) if job.new_tokens and elapsed > 0 else None


def _settle_start(job: Job) -> None:
    """Once the write to `running` is done (the first of its done callback and `_until_running`
    to see it): unless it committed, nothing more of the task is written and the engine stops,
    at once, mid-prompt if need be: a cancel came first, while the model loaded, or it failed."""
    if job.starting is None or not job.starting.done():
        return
    try:
        job.live = job.starting.result() is not None
    except Exception as exc:  # raised once the generation has ended (a write error, or a bug)
        job.live, job.error = False, exc
    job.starting = None
    if not job.live:
        job.engine.cancel()  # a remote stream that opened is closed too


async def _until_running(job: Job) -> bool:
    """Whether the task's output may be written: waits for the write to `running` if in flight."""
    if job.starting is not None:
        await asyncio.wait([job.starting])
        _settle_start(job)
    return job.live


def _prepare(conn: sqlite3.Connection, task_id: str) -> Prepared:
    """Read in the claim's transaction: a trip to a reader thread would add a wake-up to the start.
    The output is read once, with its ids (`one_task` would read its text a second time)."""
    row = dict(records.joined(conn, "t.id = ?", (task_id,))[0])
    ids, text = output.read(conn, task_id)
    request, running = json.loads(row["request"]), row["status"] == RUNNING
    try:
        return Prepared(row, request, ids, text, models.usable(conn, row["model_id"]), None, running)
    except LmspError as exc:
        return Prepared(row, request, ids, text, None, exc, running)


# Transactions: each runs on the writer thread and returns the events it wrote.

def claim(conn: sqlite3.Connection, offer: Offer) -> Claimed | None:
    """The next task to run in the room offered (`formats`: local `gguf`, `remote`): a resumed
    `running` task first, else a queued one, round-robin by client: the oldest of the first
    client after the last one served (in id order, wrapping around) that has one. A client with
    50 queued tasks delays another's single task by one task, not 50. Also run in the transaction
    that creates a task (app/core/service.py), so that a task arriving at a free engine starts
    without a commit of its own to wait for; and when that engine holds the task's model, the
    task is `running` in the same commit. None when nothing waits, or another claim on the
    offer took the room."""
    if offer.taken:
        return None
    busy, formats = offer.busy, offer.formats
    # Downloads are tasks too, but no engine work: app/tasks/downloads.py runs them. A task whose
    # model was deleted is taken as a local one, and fails as such.
    tasks = ("SELECT t.id, r.client_id, COALESCE(m.format, 'gguf') AS format FROM tasks t "
             "JOIN responses r ON r.id = t.response_id LEFT JOIN models m ON m.id = r.model_id "
             f"WHERE t.kind = 'response' AND COALESCE(m.format, 'gguf') IN ({','.join('?' * len(formats))})")
    exclude = f" AND t.id NOT IN ({','.join('?' * len(busy))})" if busy else ""
    row = conn.execute(f"{tasks} AND t.status = 'running'{exclude} ORDER BY t.created_at LIMIT 1",
                       (*formats, *busy)).fetchone()
    if row is not None:
        offer.taken = True
        return Claimed(row["id"], row["client_id"], row["format"], [], _prepare(conn, row["id"]))
    row = conn.execute(f"{tasks} AND t.status = 'queued' ORDER BY r.client_id <= ?, r.client_id, t.created_at LIMIT 1",
                       (*formats, offer.last_client)).fetchone()
    if row is None:
        return None
    offer.taken = True
    events = machine.transition(conn, row["id"], LOADING, [("response.loading", {"progress": 0.0})])
    assert events is not None
    task = _prepare(conn, row["id"])
    if task.model is not None and offer.ready is not None and models.registered(task.model) == offer.ready:
        # Nothing to load: the task starts running in this commit, not in one of its own.
        started = _start_running(conn, row["id"], records.message_id(task.row["response_id"]),
                                 bool(task.request.get("call")))
        assert started is not None
        events, task = events + started, replace(task, running=True)
    return Claimed(row["id"], row["client_id"], row["format"], events, task)


def _waiting(conn: sqlite3.Connection, task_id: str, message: str) -> list[machine.Event] | None:
    return machine.record(conn, task_id, (LOADING,), [("response.loading", {"progress": 0.0, "message": message})])


def _reset_output(conn: sqlite3.Connection, task_id: str, resume_mode: str) -> list[machine.Event] | None:
    """A new attempt from nothing, in place: the output goes, and the event says so."""
    task = conn.execute("SELECT status, attempt FROM tasks WHERE id = ?", (task_id,)).fetchone()
    if task["status"] != RUNNING:
        return None
    output.clear(conn, task_id)  # first: the response in the event shows the output as it now is
    return machine.record(conn, task_id, (RUNNING,), [("response.in_progress", {
        "response": RESPONSE, "output_reset": True, "resume_mode": resume_mode})],
        attempt=task["attempt"] + 1, output_tokens=0, tokens_per_second=None)


def _start_running(conn: sqlite3.Connection, task_id: str, item_id: str, call: bool) -> list[machine.Event] | None:
    # The output message and its text part open before the first delta, as OpenAI's stream does:
    # the openai SDK's `responses.stream()` helper refuses deltas for an item it was not given.
    # A function call's item opens once its name is decoded (calls.CallStream).
    item = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    opened = [] if call else [
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.content_part.added", {"item_id": item_id, "output_index": 0, "content_index": 0, "part": part})]
    return machine.transition(conn, task_id, RUNNING, [
        ("response.loading", {"progress": 1.0}),
        ("response.in_progress", {"response": RESPONSE}),
        *opened,
    ], only_from=(LOADING,), started_at=time.time())


def _save_output(conn: sqlite3.Connection, task_id: str, chunk: Chunk) -> list[machine.Event] | None:
    events = machine.record(conn, task_id, (RUNNING,), chunk.events, output_tokens=chunk.output_tokens,
                            tokens_per_second=chunk.tokens_per_second)
    if events is not None and (chunk.ids or chunk.text):
        output.append(conn, task_id, chunk.ids, chunk.text)
    return events


def _complete(conn: sqlite3.Connection, task_id: str, last: Chunk, ending: list[calls.Event], reason: str,
              usage: dict[str, Any]) -> list[machine.Event] | None:
    saved = _save_output(conn, task_id, last)
    if saved is None:
        return None
    done = machine.transition(
        conn, task_id, COMPLETED,
        [*ending, ("response.incomplete" if reason == "length" else "response.completed", {"response": RESPONSE})],
        finish_reason=reason, input_tokens=usage.get("input_tokens", 0), cached_tokens=usage.get("cached_tokens", 0),
        finished_at=time.time())
    assert done is not None
    return saved + done


def _complete_then_claim(conn: sqlite3.Connection, offer: Offer | None, task_id: str, last: Chunk,
                         ending: list[calls.Event], reason: str,
                         usage: dict[str, Any]) -> tuple[list[machine.Event] | None, Claimed | None]:
    return _complete(conn, task_id, last, ending, reason, usage), claim(conn, offer) if offer is not None else None


def _fail(conn: sqlite3.Connection, task_id: str, code: str, message: str) -> list[machine.Event] | None:
    error = {"code": code, "message": message}
    return machine.transition(conn, task_id, FAILED, [("response.failed", {"response": RESPONSE, "error": error})],
                              error_code=code, error_message=message, finished_at=time.time())


def _cancelled(conn: sqlite3.Connection, task_id: str) -> list[machine.Event] | None:
    return machine.transition(conn, task_id, CANCELLED, [("response.cancelled", {"response": RESPONSE})],
                              only_from=(CANCELLING,), finished_at=time.time())


def request_cancel(conn: sqlite3.Connection, task_id: str, held: Chunk | None = None) -> list[machine.Event] | None:
    """Accept a cancel atomically: queued ends at once, loading/running go to `cancelling`, after
    the output the runner `held` back. None when the task is already finished."""
    saved = (_save_output(conn, task_id, held) or []) if held is not None else []
    events = machine.transition(conn, task_id, CANCELLED, [("response.cancelled", {"response": RESPONSE})],
                                only_from=(QUEUED,), finished_at=time.time())
    if events is None:
        events = machine.transition(conn, task_id, CANCELLING, [("response.cancelling", {})])
    return None if events is None else saved + events
