"""The parent's side of one engine child: start it, load a model, stream its generations.

The child's messages become items on an asyncio queue, read by the event loop when the pipe
is readable (on Windows, by a thread), so the loop never waits on the pipe. If the child dies
from a crash signal in llama.cpp's compute kernels (loading, warming up, reading a prompt,
decoding: the child says which part runs, see phases.KERNELS) in fast mode and the setting is
`auto`, the engine starts a fresh child in safe mode and carries on with the same load or
generation from the tokens already produced (LMSP §11): the caller sees no failure. Other
deaths (a crash in the request's grammar, say), and a second crash in safe mode, are an
`engine_crashed` error that changes no mode; the next request starts a fresh child in the mode
the model runs in.

A loaded model serves up to `slots` generations at once (the `parallel` it was loaded with),
each a `Seat`: one task's place on the engine, with its own job in the child, its own stream of
messages and its own cancel. After a crash every seat carries on (or fails) on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from app.engine.child import main as child
from app.engine.child import phases
from app.engine.parent import cpu, pipe
from app.engine.parent.modes import FAST, SAFE, EngineModes
from app.engine.registry import models
from app.engine.registry.models import Registered
from app.engine.request import Request

log = logging.getLogger(__name__)
Message = dict[str, Any]
CRASHED = pipe.CRASHED
# Deaths that point at llama.cpp's own code, not at someone killing the process (SIGKILL from the
# out-of-memory killer, SIGTERM). Which code is what the child said it ran (phases.PHASES): in the
# compute kernels, fast mode's paths may be at fault, and every one of these signals counts:
# SIGSEGV/SIGBUS (AMX on Sapphire Rapids), SIGILL (AMX a virtual machine reports but refuses),
# SIGFPE, and SIGABRT (a GGML_ASSERT in a repacking kernel). Elsewhere none counts: there
# SIGABRT is mostly a C++ exception with nowhere to go, as when a request's grammar runs out of
# ways to continue ("Unexpected empty grammar stack"), and safe mode would run the same code.
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
SAFE_CRASH_BUDGET = 2  # crashes in safe mode that end one load or generation


class EngineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param  # the request field at fault, if the request was


@dataclass(frozen=True)
class Generation:
    """One run of a request: the request as stored, its task's limit, and where to pick up from (resume)."""
    request: Request
    max_tokens: int | None
    prefix_ids: list[int] = field(default_factory=list)  # the output so far: its token ids (local engines)
    prefix_text: str = ""                # its text
    prefix_tokens: int = 0               # and how many tokens it counted (a remote one has no ids)


Waiting = Callable[[str], Awaitable[None]]  # told why a task waits for its engine, before each pause


class Runs(Protocol):
    """What a task needs of an engine, local (a `Seat` on an `Engine`) or remote (app/engine/net/remote.py)."""
    name: str

    async def open(self, model: Any, gen: Generation, waiting: Waiting) -> bool:
        """Get ready to run `gen` on the model of this `models` row; True when it had to be loaded."""

    def generate(self, gen: Generation) -> AsyncIterator[Message]:
        """`chunk` messages (`ids`, `text`, and `tokens` where there are no ids), a `reset` when the
        output starts again from nothing, then one `done`. Raises EngineError."""

    def cancel(self) -> None:
        """Stop what runs: `generate` ends with a `done` of reason `cancelled`."""


class Seat:
    """One task's place on a local engine (`Runs`): the model it opened, its job in the child, its cancel."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.name
        self.file: Registered | None = None  # the model `open` loaded: its generation's
        self.cancelled = False  # a cancel came, perhaps before the child had the job
        self.job: str | None = None  # its job in the child, while it has one

    async def open(self, model: Any, gen: Generation, waiting: Waiting) -> bool:
        self.file = models.registered(model)
        return not (await self.engine.load(self.file)).get("cached")

    def generate(self, gen: Generation) -> AsyncIterator[Message]:
        return self.engine.generate(self, gen)

    def cancel(self) -> None:
        """Ask its generation to stop; it ends with reason `cancelled` within a token."""
        self.cancelled = True
        if self.job:
            self.engine.tell_child({"op": "cancel", "job": self.job})


class Engine:
    """A local engine: one llama.cpp child process."""
    _ids = itertools.count(1)

    def __init__(self, name: str, modes: EngineModes, n_threads: int | None = None) -> None:
        self.name = name
        self.modes = modes
        self.n_threads = n_threads or os.cpu_count() or 1
        self.parallel = 1  # generations the next load serves at once (the pool's `parallel`)
        self.slots = 1     # those the loaded model serves (the `parallel` it was loaded with)
        self.file: Registered | None = None  # the model file loaded
        self.refused: set[Registered] = set()  # files the child found not to be what was registered
        self.mode: str | None = None          # the mode the loaded model runs in
        self.cpu_variant: str | None = None   # which libggml-cpu-<variant> the child picked
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()  # the child's messages about no generation
        self._jobs: dict[str, asyncio.Queue[Message]] = {}    # each generation's, by its job in the child
        self._drained = asyncio.Event()  # no generation in the child
        self._drained.set()
        self._lock = asyncio.Lock()  # one load, job start or embedding at a time
        self._death: asyncio.Future[None] | None = None  # the last child's, reaped
        self._embedding: str | None = None  # the child's embedding job, while it has one
        self._left: set[str] = set()  # embedding jobs whose clients left
        self._last_used = time.monotonic()
        self.exit_signal: int | None = None  # how the last child died, if by a signal
        self.exit_phase = phases.OTHER        # and what it was doing (phases.PHASES)
        self.exit_mode = FAST                 # in which mode
        self._phase: Any = None               # the byte the child says that in
        self._mode_asked = FAST  # the mode of the last load asked for

    @property
    def model_path(self) -> str | None:
        """The path of the model loaded, if any."""
        return self.file.path if self.file else None

    def ready(self) -> Registered | None:
        """The model file loaded, if loading it now would find nothing to do (loaded, in the
        mode it runs in and with the slots asked for, by a live child)."""
        if (self.file is not None and self.alive and self.mode == self.modes.mode(self.file.digest)
                and self.slots == self.parallel):
            return self.file
        return None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def seat(self) -> Seat:
        return Seat(self)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs Qt and threads
        parent, kid = ctx.Pipe()
        # Windows' pipes are handles, not descriptors to put in place of its stderr.
        errors, their_errors = ctx.Pipe(duplex=False) if os.name == "posix" else (None, None)
        self._phase = ctx.RawValue("B", phases.OTHER)
        proc = ctx.Process(target=child.main, args=(kid, their_errors, self._phase), name=f"lmsp-{self.name}",
                           daemon=True)
        proc.start()
        kid.close()
        if errors is not None and their_errors is not None:
            their_errors.close()
            threading.Thread(target=pipe.relay, args=(errors, self.name), name=f"lmsp-{self.name}-stderr",
                             daemon=True).start()
        log.info("%s: started inference process %s", self.name, proc.pid)
        self._proc, self._conn, self._inbox, self.file = proc, parent, asyncio.Queue(), None

        if os.name == "posix":  # the pipe is a socket the loop watches: no thread to wake it per token
            loop.add_reader(parent.fileno(), pipe.drain, loop, parent, self._deliver)
        else:  # Windows' named pipes are no selectable sockets: a thread reads them
            threading.Thread(target=pipe.pump, args=(loop, parent, self._deliver), name=f"lmsp-{self.name}-pipe",
                             daemon=True).start()

    def _deliver(self, msg: Message) -> None:
        """A message of the child, to the generation it is about, else to whoever talks to the child.
        Its death, to everyone: it is reaped once, whoever hears of it first waits for that."""
        if msg is CRASHED:
            self._death = asyncio.ensure_future(self._reap(self._proc))
            for queue in self._jobs.values():
                queue.put_nowait(CRASHED)
        if "job" not in msg:
            self._inbox.put_nowait(msg)
        elif msg["job"] in self._jobs:  # else a late word of a generation nobody reads any more
            self._jobs[msg["job"]].put_nowait(msg)

    def _send(self, msg: Message) -> None:
        if not self.alive or self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            raise EngineError(CRASHED["code"], CRASHED["message"]) from exc

    async def _next(self, queue: asyncio.Queue[Message] | None = None) -> Message:
        msg = await (queue or self._inbox).get()
        if msg is CRASHED and self._death is not None:
            await asyncio.shield(self._death)
        return msg

    async def _reap(self, proc: multiprocessing.process.BaseProcess | None) -> None:
        if proc is None or proc is not self._proc:
            return
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 1)
        code = proc.exitcode
        self.exit_signal = -code if code is not None and code < 0 else None
        self.exit_phase, self.exit_mode = self._phase.value, self._mode_asked
        log.warning("%s process exited with code %s", self.name, code)
        if proc is self._proc:
            self._proc = self._conn = None
            self.file = self.mode = None

    async def _survive(self, crashes: list[str], stage: str, file: Registered) -> None:
        """After the child died: decide whether to carry on (in safe mode) or fail.
        `crashes` holds the modes the child crashed in during this one request."""
        sig, phase = self.exit_signal, self.exit_phase
        path, mode = file.path, self.exit_mode
        name = signal.Signals(sig).name if sig else "no signal"
        detail = (f"{self.name}: inference process killed by {name} while {stage} {path} in {mode} mode, "
                  f"{phases.PHASES[phase]} (CPU: {cpu.summary()}; "
                  f"llama.cpp CPU backend: {self.cpu_variant or 'native'})")
        log.error("%s", detail)
        if sig not in CRASH_SIGNALS:
            raise EngineError(CRASHED["code"], CRASHED["message"])
        if phase != phases.KERNELS:
            # Not fast mode's doing: safe mode runs the same code, and the cause may well be this
            # request (its grammar). It fails alone; the next request gets a fresh child, in the
            # mode the model runs in.
            raise EngineError("engine_crashed", f"The inference engine crashed ({name}) {phases.PHASES[phase]}, "
                              "so this task stopped. Safe mode would not avoid that, and the model's engine mode "
                              "is unchanged; the next request gets a fresh engine. The log has the details.")
        crashes.append(mode)
        if mode == FAST and self.modes.auto:
            if self.modes.mode(file.digest) == FAST:  # not yet said by another generation of that child
                await self.modes.fall_back(file.digest, (
                    f"The inference engine crashed ({name}) in fast mode on this CPU while {stage} this model; "
                    "it now runs in safe mode (llama.cpp's weight repacking and AMX kernels off), a little slower."))
            log.warning("%s: continuing in safe mode", self.name)
            return
        if mode == FAST:
            raise EngineError("engine_crashed", f"The inference engine crashed ({name}). The setting engine_mode "
                              "is 'fast'; set it to 'auto' or 'safe' to let LMSP Tray avoid the crash.")
        if crashes.count(SAFE) >= SAFE_CRASH_BUDGET:
            raise EngineError("engine_crashed", f"The inference engine crashed ({name}) {SAFE_CRASH_BUDGET} times "
                              "on this model, even in safe mode, so this task stopped. Other models may still "
                              "work; the log has the details.")
        log.warning("%s: crashed in safe mode; trying once more with a fresh process", self.name)

    async def _load(self, file: Registered, crashes: list[str]) -> Message:
        """Load in the mode the model should run in; survive a crash as `_survive` decides.
        The child loads the file only if it still is the one validated at registration."""
        while True:
            if self.ready() == file:
                return {"ev": "loaded", "cached": True}
            mode = self.modes.mode(file.digest)
            # Until it has loaded, nothing is: a failed load must not leave the old path behind.
            self.file = self.mode = None
            self._mode_asked = mode
            self._send({"op": "load", "file": file, "n_ctx": file.context_length, "n_threads": self.n_threads,
                        "safe": mode == SAFE, "parallel": self.parallel})
            msg = await self._next()
            if msg is not CRASHED and msg["ev"] == "backend":
                self.cpu_variant = msg["cpu_variant"]
                msg = await self._next()
            if msg is CRASHED:
                await self._survive(crashes, "loading and warming up", file)
                continue
            if msg["ev"] != "loaded":
                if msg["code"] == "model_changed":
                    self.refused.add(file)
                raise EngineError(msg["code"], msg["message"])
            self.file, self.mode, self.slots = file, mode, msg["parallel"]
            log.info("%s: loaded %s in %s mode, %d at once, in %.2f s (warm-up %.2f s; llama.cpp CPU backend: %s)",
                     self.name, file.path, mode, self.slots, msg["load_seconds"], msg.get("warmup_seconds", 0.0),
                     self.cpu_variant or "native")
            self._last_used = time.monotonic()
            return msg

    @contextlib.asynccontextmanager
    async def _turn(self, file: Registered) -> AsyncIterator[None]:
        """Hold the lock, once no generation runs unless `file` is ready as it is: another model
        (an embedding's) or other slots are loaded only between generations."""
        while True:
            await self._lock.acquire()
            if not self._jobs or self.ready() == file:
                break
            self._lock.release()
            await self._drained.wait()
        try:
            yield
        finally:
            self._lock.release()

    async def load(self, file: Registered) -> Message:
        """Load `file` unless it is already loaded. Raises EngineError on failure (`model_changed`
        when the file at its path is no longer the one registered)."""
        async with self._turn(file):
            return await self._load(file, [])

    async def unload(self) -> None:
        """Let the model go (the pool asks only while no generation runs)."""
        async with self._lock:
            if self.alive and self.model_path is not None:
                self._send({"op": "unload"})
                await self._next()
            self.file = self.mode = None

    async def _begin(self, seat: Seat, file: Registered, crashes: list[str], queue: asyncio.Queue[Message],
                     gen: Generation, ids: list[int], emitted: int) -> str | None:
        """Start the seat's generation in the child, `file` loaded first (again, after a crash);
        its job, or None when a cancel came first."""
        async with self._lock:
            # An embedding may have had the lock since `open` and loaded its own model: the task's
            # comes back first (nothing to do when it is still loaded).
            await self._load(file, crashes)
            if seat.cancelled:  # before the child had this job (a reload, a restart after a crash)
                return None
            job = seat.job = f"job{next(self._ids)}"
            self._jobs[job] = queue
            self._drained.clear()
            self._send({"op": "generate", "job": job, "request": gen.request, "max_tokens": gen.max_tokens,
                        "prefix_ids": ids, "emitted_chars": emitted})
            return job

    def _forget(self, seat: Seat) -> None:
        """The seat's job in the child is over (it ended, or the child died)."""
        if seat.job is not None:
            self._jobs.pop(seat.job, None)
            seat.job = None
        if not self._jobs:
            self._drained.set()

    async def generate(self, seat: Seat, gen: Generation) -> AsyncIterator[Message]:
        """Yield `chunk` messages, then one `done`. Raises EngineError on failure.
        A crash that `_survive` forgives is invisible here: the model is loaded again and
        the generation continues from the tokens already yielded."""
        file = seat.file
        if file is None:
            raise EngineError("model_not_loaded", "No model is loaded.")
        crashes: list[str] = []
        ids, emitted = list(gen.prefix_ids), len(gen.prefix_text)
        queue: asyncio.Queue[Message] = asyncio.Queue()
        while True:
            if await self._begin(seat, file, crashes, queue, gen, ids, emitted) is None:
                yield {"ev": "done", "reason": "cancelled", "input_tokens": 0, "output_tokens": 0}
                return
            try:
                while True:
                    msg = await self._next(queue)
                    if msg is CRASHED:
                        break
                    if msg["ev"] in ("done", "error"):
                        self._forget(seat)  # before the yield: the task stops iterating at `done`
                    if msg["ev"] == "error":
                        raise EngineError(msg["code"], msg["message"])
                    if msg["ev"] == "chunk":
                        ids.extend(msg["ids"])
                        emitted += len(msg["text"])
                    # Idle time counts from the last message, before its yield: the runner stops
                    # iterating at `done`, so nothing after that yield runs.
                    self._last_used = time.monotonic()
                    yield msg
                    if msg["ev"] == "done":
                        return
            finally:
                self._forget(seat)
            await self._survive(crashes, "generating with", file)

    async def embed(self, file: Registered, texts: list[str], dimensions: int | None) -> Message:
        """Embed `texts` with the model in `file`, loading it if needed. It waits its turn: with the
        model the generations run, the child embeds between two of their steps (between two
        generations when it serves one at a time); another model waits for them to end. The `embedded` message,
        with `fresh` set if the model had to be loaded. Raises EngineError.
        Cancelled (its client left), it stops the child at its next batch (within a second); the
        lock is held until the child has said so, so that nobody takes its answer for their own."""
        job = f"embed{next(self._ids)}"
        work = asyncio.ensure_future(self._embed(job, file, texts, dimensions))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            self._left.add(job)
            if self._embedding == job:
                self.tell_child({"op": "cancel", "job": job})
            work.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody waits for it
            raise

    async def _embed(self, job: str, file: Registered, texts: list[str], dimensions: int | None) -> Message:
        async with self._turn(file):
            try:
                loaded = None if job in self._left else await self._load(file, [])
                if loaded is None or job in self._left:  # its client left before the child had it
                    return {"ev": "cancelled"}
                self._embedding = job
                self._send({"op": "embed", "job": job, "texts": texts, "dimensions": dimensions})
                msg = await self._next()
            finally:
                self._left.discard(job)
                self._embedding = None
        if msg["ev"] == "error":
            raise EngineError(msg["code"], msg["message"], msg.get("param"))
        self._last_used = time.monotonic()
        return {**msg, "fresh": not loaded.get("cached")}

    def idle_for(self) -> float:
        return time.monotonic() - self._last_used

    def tell_child(self, msg: Message) -> None:
        """Send if there is a child to hear it (a cancel for a job it finished is ignored)."""
        if self._conn is not None and self.alive:
            try:
                self._conn.send(msg)
            except OSError:
                pass

    async def stop(self) -> None:
        if self._proc is None:
            return
        proc = self._proc
        try:
            if self._conn is not None:
                self._conn.send({"op": "shutdown"})
        except OSError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 3)
        if proc.is_alive():
            proc.kill()
        self._proc = self._conn = None
