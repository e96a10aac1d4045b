"""Generations: a response's task, run on a local engine or on a remote model's endpoints (the
model's format decides: `gguf` on an engine of the pool, `remote` on its endpoints).

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

The share of an engine's slots (the red team's P7): while another app's task waits for a model,
no app holds every slot of an engine that runs it (with `parallel` 1 apps only take turns). An
app alone fills every slot: one kept back for an app that may never come would cost it a share of
its throughput, and an app that did come would still wait for a long task to end (a full context
is minutes). So the rule holds at both ends. A claim gives the last slot to an app that holds the
others only when no other app's task is there to take it (`EngineRoom.crowded`). And once one app
holds them all and another's task comes (`make_way`), the first app's task with the least output
stops at a token and goes back to the queue with its output, word for word (`writes.requeue`),
first of that app's: the other task takes its slot in the same commit, and the stopped one
continues from its output, as `resume` does, when a slot frees. The cost of making way is that
task reading its prompt and output again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Coroutine, Iterable
from typing import Any

from app.engine.net.remote import RemoteEngine
from app.engine.parent.engine import Engine
from app.engine.registry.models import Registered
from app.engine.runs import EngineError, Generation, Runs
from app.errors import LmspError, StoreError
from app.tasks import calls, machine, recovery
from app.tasks.kinds import generation_writes as writes
from app.tasks.kinds.base import WRITE_ERRORS, Backoff, Claimed, Kind, Needs, Recovered, Room
from app.tasks.kinds.generation_job import EngineRoom, Job, Prepared, settle_start, tokens_per_second, until_running
from app.tasks.states import RUNNING

log = logging.getLogger(__name__)
# Engine errors a task fails with as they are; any other failure to open an engine is a failed load.
OWN_CODES = ("engine_crashed", "upstream_unavailable", "upstream_error")
# Engine deaths a task outlives by its `on_restart` (resumed or retried), in one run of the service:
# a request that kills its engine every time fails after this many, not in a loop.
ENGINE_DEATHS = 2
# The least time between two writes of an unwatched task's output (seconds): at 100 tokens/s
# about ten tokens a commit instead of one (tests/bench/test_throughput.py has the figures).
QUIET_SPACING = 0.1


class Generations(Kind):
    name = "response"
    worker = "lmsp-task"
    terminal_events = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")
    holds_on_pause = True  # "pause new tasks" is about the engines

    def __init__(self, needs: Needs) -> None:
        self.store = needs.store
        self.bus = needs.bus
        self.pool = needs.pool
        self.upstreams = needs.upstreams
        self.jobs: dict[str, Job] = {}
        self.remote_capacity = 8      # tasks at once on remote endpoints (max_concurrent_remote_tasks)
        self.tokens_generated = 0     # since start, for /metrics
        self.last_tokens_per_second: float | None = None
        self.last_app = ""  # whose task was taken last: the next queued one is another's
        self.deaths: dict[str, int] = {}  # engine deaths each task has outlived
        self._stopping = False
        self._making_way: asyncio.Task[None] | None = None  # `make_way`'s look, while it runs
        self._look_again = False  # asked again while it ran: it may have read before the task asking
        self.bus.on_watch(self._hurry)

    async def write(self, fn: Any, *args: Any) -> Any:
        """A transaction whose returned events are published once it has committed."""
        return await self.bus.commit(self.store, fn, *args)

    def remote_running(self) -> int:
        return sum(isinstance(job.engine, RemoteEngine) for job in self.jobs.values())

    def room(self) -> EngineRoom | None:
        engine, shared = self.pool.idle(), self.pool.shared()
        # No remote model, no remote task to look for: a claim that finds nothing still costs the
        # writer a transaction, and would run after every task that ends.
        remote = bool(self.upstreams.models) and self.remote_running() < self.remote_capacity
        local = engine is not None or shared is not None
        names = tuple(name for name, free in (("gguf", local), ("remote", remote)) if free)
        if not names:
            return None
        return EngineRoom(names, tuple(self.jobs), engine, engine.ready() if engine else None, shared,
                          shared.ready() if shared else None, self.last_app,
                          self._crowded([shared] if shared else []))

    def _crowded(self, engines: Iterable[Engine]) -> tuple[str, ...]:
        """The apps that hold all but one of the slots (or all) of one of these engines of several."""
        crowded: set[str] = set()
        for engine in engines:
            if engine.parallel > 1:
                held = Counter(self.jobs[task_id].app for task_id in self.pool.holders(engine))
                crowded.update(app for app, n in held.items() if n >= engine.parallel - 1)
        return tuple(sorted(crowded))

    def claim(self, conn: sqlite3.Connection, room: Room) -> Claimed | None:
        assert isinstance(room, EngineRoom)
        taken = writes.take(conn, self.name, room)
        if taken is None:
            return None
        return Claimed(self, taken.task_id, room, taken.name, taken.events, taken)

    def start(self, claimed: Claimed) -> Coroutine[Any, Any, None]:
        taken: writes.Taken = claimed.detail
        task, engine = taken.task, taken.engine
        self.last_app = taken.app
        if claimed.name == "remote":
            runs: Runs = RemoteEngine(self.upstreams)
        else:
            assert engine is not None
            runs = engine.seat()
            self.pool.lease(claimed.task_id, engine, taken.app)
        job = self.jobs[claimed.task_id] = Job(claimed.task_id, runs, taken.app)
        return self._run(job, task)

    def make_way(self) -> None:
        """A task waits: if one app's tasks fill an engine of several slots while another app's
        task waits for its model, the first app's task with the least output gives its slot back
        (see the module's docstring). The look reads the queue: it runs beside."""
        if self._stopping:
            return
        if self._making_way is not None:
            self._look_again = True
        elif self._filled():
            self._making_way = asyncio.create_task(self._make_way(), name="lmsp-make-way")

    def _filled(self) -> list[tuple[Registered, Job]]:
        """Each engine of several slots that one app's tasks fill, none of them already making
        way, with that app's task to stop: the fewest tokens to read again, the newest of those."""
        found = []
        for engine in self.pool.engines:
            jobs, file = [self.jobs[task_id] for task_id in self.pool.holders(engine)], engine.ready()
            if (file is not None and 1 < engine.parallel <= len(jobs)
                    and len({job.app for job in jobs}) == 1 and not any(job.preempted for job in jobs)):
                found.append((file, min(jobs, key=lambda job: (job.tokens, -job.started))))
        return found

    async def _make_way(self) -> None:
        try:
            while True:
                self._look_again = False
                for file, job in self._filled():
                    if (await self.store.read(writes.waits_for, self.name, file, job.app)
                            and job.task_id in self.jobs and not job.preempted):
                        log.info("task %s: gives its slot to another app's task, and waits", job.task_id)
                        job.preempted = True
                        job.engine.cancel()
                if not self._look_again:
                    return
        except WRITE_ERRORS as exc:  # a read the store refused: the next task that waits looks again
            log.warning("cannot look for tasks waiting for a slot (%s)", exc)
        finally:
            self._making_way = None

    def cancel(self, task_id: str) -> None:
        """The database already says `cancelling`; stop the generation."""
        job = self.jobs.get(task_id)
        if job is not None:
            job.engine.cancel()

    async def places(self, task_ids: list[str], queued: bool) -> dict[str, dict[str, Any]]:
        """Where each of these tasks stands: `queue_position` (1: the next to run) while queued
        (the queue is read only when one of them is), `slot` (app/engine/parent/pool.py
        `slot_of`) while it runs on a local engine."""
        crowded = self._crowded(self.pool.engines)
        order = await self.store.read(writes.queue_order, self.name, crowded, self.last_app) if queued else []
        position = {task_id: n for n, task_id in enumerate(order, 1)}
        return {task_id: {"queue_position": position.get(task_id), "slot": self.pool.slot_of(task_id)}
                for task_id in task_ids}

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
            result: list[machine.Event] | None = await self.store.write(writes.request_cancel, task_id, held)
            return result
        except WRITE_ERRORS as exc:
            if job is not None and held is not None:  # a piece of its output is lost: it fails, as
                job.error = exc                        # when any write of its output fails
                job.engine.cancel()
            raise

    def recover(self, conn: sqlite3.Connection) -> Recovered:
        return Recovered(counts=recovery.recover(conn, self.name))

    def halt(self) -> None:
        """Running work stops at a token and its snapshot is committed."""
        self._stopping = True
        for job in list(self.jobs.values()):
            job.engine.cancel()

    def _leave(self, task_id: str) -> None:
        """Nothing of the task can be stopped or hurried any more, and its engine is free."""
        self.jobs.pop(task_id, None)
        self.pool.release(task_id)

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
            self._leave(job.task_id)

    async def _fail_when_possible(self, task_id: str, code: str, message: str) -> None:
        """Fail the task. While the database refuses writes (a full disk) keep trying, ever more
        slowly, and keep the task: taken again, it would fail again at once, in a tight loop."""
        backoff = Backoff()
        while True:
            try:
                await self._fail(task_id, code, message)
                return
            except WRITE_ERRORS as exc:
                if self._stopping:
                    return  # the next start's recovery settles it, by its on_restart
                await backoff.wait(f"task {task_id}: cannot record that it stopped ({exc})")

    async def _fail(self, task_id: str, code: str, message: str) -> None:
        if await self.write(writes.fail, task_id, code, message) is None:
            await self.write(writes.cancelled, task_id)  # a cancel was accepted meanwhile

    async def _execute(self, job: Job, task: Prepared) -> None:
        gen = await self._open(job, task)
        if gen is None:
            return
        if not task.running:
            # `running` commits while the engine reads the prompt, so its fsync is not added to
            # the wait for the first token; nothing else of the task is written before it has.
            job.starting = asyncio.ensure_future(self.write(writes.start_running, task))
            job.starting.add_done_callback(lambda _: settle_start(job))
        job.started = time.monotonic()  # tokens/s counts generation, not the model load
        failure: EngineError | None = None
        try:
            reason, usage = await self._generate(job, gen)
        except EngineError as exc:
            reason, usage, failure = "cancelled", {}, exc
        await self._finish(job, reason, usage, failure)

    async def _open(self, job: Job, task: Prepared) -> Generation | None:
        """The generation the task asks for, from where it stands, with its engine ready for it;
        None when the task failed instead (its model unusable or failing to load)."""
        row, request = task.row, task.request
        log.info("task %s: %s on %s (attempt %d, %d tokens so far)", job.task_id,
                 "resuming" if row["status"] == RUNNING else "starting", job.engine.name, row["attempt"],
                 row["output_tokens"])
        job.tokens = row["output_tokens"]  # a remote task's output has a count but no token ids
        job.out = calls.stream(request, row["response_id"], task.text)
        gen = Generation(request, row["max_output_tokens"], prefix_ids=task.ids, prefix_text=task.text,
                         prefix_tokens=job.tokens)

        async def waiting(message: str) -> None:
            if await self.write(writes.waiting, job.task_id, message) is None:
                job.engine.cancel()  # a cancel was accepted while it waited

        try:
            if task.refused is not None:
                raise task.refused
            if await job.engine.open(task.model, gen, waiting):  # a fresh load: tell the GUI
                self.bus.publish([{"type": "models.changed"}])
                self.host.wake()  # and the tasks queued for that model: its other slots are free now
        except (LmspError, EngineError) as exc:
            code = exc.code if isinstance(exc, LmspError) or exc.code in OWN_CODES else "model_load_failed"
            await self._fail(job.task_id, code, exc.message)
            return None
        return gen

    async def _generate(self, job: Job, gen: Generation) -> tuple[str, dict[str, Any]]:
        """Read the engine's messages, writing the output as it comes; the reason it ended and its usage."""
        async for msg in job.engine.generate(gen):
            live = await until_running(job)
            if msg["ev"] == "done":
                return msg["reason"], msg
            if not live:  # the engine was told to stop (`settle_start`), and remembers it: drop what still comes
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
        return "cancelled", {}

    async def _finish(self, job: Job, reason: str, usage: dict[str, Any], failure: EngineError | None) -> None:
        """End the task as its generation ended: cancelled, failed, or done (with what is left)."""
        if not await until_running(job):  # a cancel came first, while the model loaded (or the write failed)
            if job.error is not None:
                raise job.error
            await self.write(writes.cancelled, job.task_id)
            return
        if failure is not None:
            await self._flush(job)
            if not await self._outlive(job.task_id, failure):
                self.deaths.pop(job.task_id, None)
                await self._fail(job.task_id, failure.code, failure.message)
            return
        self.deaths.pop(job.task_id, None)
        self.last_tokens_per_second = tokens_per_second(job) or self.last_tokens_per_second
        await job.stop_saving()
        if job.error is not None:
            raise job.error
        if reason == "cancelled":
            if job.preempted and not self._stopping:
                await self._requeue(job)
            elif await self.write(writes.cancelled, job.task_id) is None:
                await self._flush(job)  # shutting down: keep the snapshot, recovery decides
            return
        last = job.take()
        assert job.out is not None
        ending = job.out.done("incomplete" if reason == "length" else "completed")
        # Completed, and in the same commit the next task takes the engine, free since the
        # generation ended: a queued task then starts without a commit of its own before it.
        self._leave(job.task_id)
        if await self.host.end_and_claim(writes.complete, job.task_id, last, ending, reason, usage) is None:
            await self.write(writes.cancelled, job.task_id)

    async def _requeue(self, job: Job) -> None:
        """Back to the queue with its output (`make_way`); in the same commit, the slot it freed goes
        to the task waiting for it."""
        self._leave(job.task_id)
        if await self.host.end_and_claim(writes.requeue, job.task_id, job.take()) is None:
            await self.write(writes.cancelled, job.task_id)  # a cancel was accepted meanwhile

    async def _outlive(self, task_id: str, failure: EngineError) -> bool:
        """After its engine (a llama-server, a remote endpoint) died beneath it, the task runs again as
        its `on_restart` says (as after a restart of the service), its room freed for the next claim;
        False when it fails (the engine said it already spent the crashes a task may cost: `final`)."""
        deaths = self.deaths.get(task_id, 0)
        if failure.code != "engine_crashed" or failure.final or deaths >= ENGINE_DEATHS or self._stopping:
            return False
        if await self.write(recovery.after_engine_death, task_id) is None:
            return False
        self.deaths[task_id] = deaths + 1
        log.warning("task %s: its engine stopped; it runs again by its on_restart", task_id)
        return True

    async def _restart_output(self, job: Job, resume_mode: str) -> None:
        """Drop the output written so far: the engine starts the text again (LMSP §11, `retry`).
        What was held back goes too, unwritten."""
        await job.stop_saving()
        job.reset()
        if await self.write(writes.reset_output, job.task_id, resume_mode) is None:
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
                if await self.write(writes.save_output, job.task_id, job.take()) is None:
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
            await self.write(writes.save_output, job.task_id, job.take())
