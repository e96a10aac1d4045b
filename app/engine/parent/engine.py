"""The parent's side of one engine child: start it, load a model, stream a generation.

The child's messages become items on an asyncio queue, read by the event loop when the pipe
is readable (on Windows, by a thread), so the loop never waits on the pipe. If the child dies
from a crash signal in llama.cpp's compute kernels (loading, warming up, reading a prompt,
decoding: the child says which part runs, see phases.KERNELS) in fast mode and the setting is
`auto`, the engine starts a fresh child in safe mode and carries on with the same load or
generation from the tokens already produced (LMSP §11): the caller sees no failure. Other
deaths (a crash in the request's grammar, say), and a second crash in safe mode, are an
`engine_crashed` error that changes no mode; the next request starts a fresh child in the mode
the model runs in.
"""

from __future__ import annotations

import asyncio
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
from app.engine.parent import cpu
from app.engine.parent.modes import FAST, SAFE, EngineModes
from app.engine.registry import models
from app.engine.registry.models import Registered
from app.engine.request import Request

log = logging.getLogger(__name__)
Message = dict[str, Any]
CRASHED: Message = {"ev": "error", "code": "engine_crashed", "message": "The inference process stopped unexpectedly."}
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
    """What the runner needs of an engine, local (`Engine`) or remote (app/engine/net/remote.py)."""
    name: str

    async def open(self, model: Any, gen: Generation, waiting: Waiting) -> bool:
        """Get ready to run `gen` on the model of this `models` row; True when it had to be loaded."""

    def generate(self, gen: Generation) -> AsyncIterator[Message]:
        """`chunk` messages (`ids`, `text`, and `tokens` where there are no ids), a `reset` when the
        output starts again from nothing, then one `done`. Raises EngineError."""

    def cancel(self) -> None:
        """Stop what runs: `generate` ends with a `done` of reason `cancelled`."""


def _drain(loop: asyncio.AbstractEventLoop, conn: Connection, inbox: asyncio.Queue[Message]) -> None:
    """On the loop, when the child's pipe is readable: take one message (the loop calls again
    while more wait; `recv` waits at most for the rest of one the child is writing). At the end
    of the pipe (the child gone) the engine hears CRASHED."""
    try:
        inbox.put_nowait(conn.recv())  # not `conn.poll()` first: it builds a selector each call
    except (EOFError, OSError):
        loop.remove_reader(conn.fileno())
        inbox.put_nowait(CRASHED)


def _pump(loop: asyncio.AbstractEventLoop, conn: Connection, inbox: asyncio.Queue[Message]) -> None:
    """On a thread: hand each message of the child to the loop, then CRASHED when the pipe ends."""
    try:
        while True:
            msg = conn.recv()
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
    except (EOFError, OSError):
        pass
    if not loop.is_closed():
        loop.call_soon_threadsafe(inbox.put_nowait, CRASHED)


def _relay(stderr: Connection, name: str) -> None:
    """On a thread: each line the child writes to its standard error into the log, until the
    child is gone. Else llama.cpp's messages (why it aborted, say) would be in no log, and on a
    stderr nobody reads the child would wait for room in the pipe once the parent filled it."""
    with open(stderr.fileno(), "rb", closefd=False) as lines:
        for line in lines:
            log.info("%s: %s", name, line.decode(errors="replace").rstrip())
    stderr.close()


class Engine:
    """A local engine: one llama.cpp child process."""
    _ids = itertools.count(1)

    def __init__(self, name: str, modes: EngineModes, n_threads: int | None = None) -> None:
        self.name = name
        self.modes = modes
        self.n_threads = n_threads or os.cpu_count() or 1
        self.file: Registered | None = None  # the model file loaded
        self._task_file: Registered | None = None  # the one `open` loaded for the task: its generation's
        self._cancelled = False  # a cancel came since `open`, perhaps before the child had the job
        self.refused: set[Registered] = set()  # files the child found not to be what was registered
        self.mode: str | None = None          # the mode the loaded model runs in
        self.cpu_variant: str | None = None   # which libggml-cpu-<variant> the child picked
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._inbox: asyncio.Queue[Message] | None = None
        self._lock = asyncio.Lock()  # one request to the child at a time
        self._job: str | None = None
        self._embedding: str | None = None  # the child's embedding job, while it has one
        self._left: set[str] = set()  # embedding jobs whose clients left
        self._last_used = time.monotonic()
        self.exit_signal: int | None = None  # how the last child died, if by a signal
        self.exit_phase = phases.OTHER        # and what it was doing (phases.PHASES)
        self._phase: Any = None               # the byte the child says that in
        self._mode_asked = FAST  # the mode of the last load asked for

    @property
    def model_path(self) -> str | None:
        """The path of the model loaded, if any."""
        return self.file.path if self.file else None

    def ready(self) -> Registered | None:
        """The model file loaded, if loading it now would find nothing to do (loaded, in the
        mode it runs in, by a live child)."""
        if self.file is not None and self.alive and self.mode == self.modes.mode(self.file.digest):
            return self.file
        return None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

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
            threading.Thread(target=_relay, args=(errors, self.name), name=f"lmsp-{self.name}-stderr",
                             daemon=True).start()
        log.info("%s: started inference process %s", self.name, proc.pid)
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._proc, self._conn, self._inbox, self.file = proc, parent, inbox, None

        if os.name == "posix":  # the pipe is a socket the loop watches: no thread to wake it per token
            loop.add_reader(parent.fileno(), _drain, loop, parent, inbox)
        else:  # Windows' named pipes are no selectable sockets: a thread reads them
            threading.Thread(target=_pump, args=(loop, parent, inbox), name=f"lmsp-{self.name}-pipe",
                             daemon=True).start()

    def _send(self, msg: Message) -> None:
        if not self.alive or self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            raise EngineError(CRASHED["code"], CRASHED["message"]) from exc

    async def _next(self) -> Message:
        assert self._inbox is not None
        msg = await self._inbox.get()
        if msg is CRASHED:
            await self._reap()
        return msg

    async def _reap(self) -> None:
        self.exit_signal, self.exit_phase = None, phases.OTHER
        if self._proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 1)
            code = self._proc.exitcode
            self.exit_signal = -code if code is not None and code < 0 else None
            self.exit_phase = self._phase.value
            log.warning("%s process exited with code %s", self.name, code)
        self._proc = self._conn = None
        self.file = self.mode = None

    async def _survive(self, crashes: list[str], stage: str, file: Registered) -> None:
        """After the child died: decide whether to carry on (in safe mode) or fail.
        `crashes` holds the modes the child crashed in during this one request."""
        sig, phase = self.exit_signal, self.exit_phase
        path, mode = file.path, self._mode_asked
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
                        "safe": mode == SAFE})
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
            self.file, self.mode = file, mode
            log.info("%s: loaded %s in %s mode in %.2f s (warm-up %.2f s; llama.cpp CPU backend: %s)", self.name,
                     file.path, mode, msg["load_seconds"], msg.get("warmup_seconds", 0.0),
                     self.cpu_variant or "native")
            self._last_used = time.monotonic()
            return msg

    async def open(self, model: Any, gen: Generation, waiting: Waiting) -> bool:
        self._task_file, self._cancelled = models.registered(model), False
        return not (await self.load(self._task_file)).get("cached")

    async def load(self, file: Registered) -> Message:
        """Load `file` unless it is already loaded. Raises EngineError on failure (`model_changed`
        when the file at its path is no longer the one registered)."""
        async with self._lock:
            return await self._load(file, [])

    async def unload(self) -> None:
        async with self._lock:
            if self.alive and self.model_path is not None:
                self._send({"op": "unload"})
                await self._next()
            self.file = self.mode = None

    async def generate(self, gen: Generation) -> AsyncIterator[Message]:
        """Yield `chunk` messages, then one `done`. Raises EngineError on failure.
        A crash that `_survive` forgives is invisible here: the model is loaded again and
        the generation continues from the tokens already yielded."""
        async with self._lock:
            file = self._task_file
            if file is None:
                raise EngineError("model_not_loaded", "No model is loaded.")
            crashes: list[str] = []
            # An embedding may have had the lock since `open` and loaded its own model: the task's
            # comes back first (nothing to do when it is still loaded).
            await self._load(file, crashes)
            ids, emitted = list(gen.prefix_ids), len(gen.prefix_text)
            while True:
                if self._cancelled:  # before the child had this job (a reload, a restart after a crash)
                    yield {"ev": "done", "reason": "cancelled", "input_tokens": 0, "output_tokens": 0}
                    return
                job = f"job{next(self._ids)}"
                self._job = job
                self._send({"op": "generate", "job": job, "request": gen.request, "max_tokens": gen.max_tokens,
                            "prefix_ids": ids, "emitted_chars": emitted})
                while True:
                    msg = await self._next()
                    if msg is CRASHED:
                        break
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
                await self._survive(crashes, "generating with", file)
                await self._load(file, crashes)

    async def embed(self, file: Registered, texts: list[str], dimensions: int | None) -> Message:
        """Embed `texts` with the model in `file`, loading it if needed. It waits its turn on the
        same lock as a generation: it runs between two, never during one. The `embedded` message,
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
                self._tell_child({"op": "cancel", "job": job})
            work.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody waits for it
            raise

    async def _embed(self, job: str, file: Registered, texts: list[str], dimensions: int | None) -> Message:
        async with self._lock:
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

    def cancel(self) -> None:
        """Ask the running generation to stop; it ends with reason `cancelled` within a token."""
        self._cancelled = True
        if self._job:
            self._tell_child({"op": "cancel", "job": self._job})

    def _tell_child(self, msg: Message) -> None:
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
