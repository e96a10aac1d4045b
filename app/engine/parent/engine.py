"""A local engine: the model a task runs on, loaded in llama.cpp's own `llama-server` (LMSP §18;
the process itself: app/engine/parent/server.py), and the tasks' generations streamed from it.

A loaded model serves up to `slots` generations at once (the `parallel` it was loaded with),
each a `Seat`: one task's place on the engine, with its own streamed request and its own cancel.
The prompt is the model's chat template rendered here (app/engine/template.py, as the check made
when a request is accepted renders it) and tokenized by the server piece by piece, the template's
markers as special tokens and the messages' text as plain text, so a message that spells
`<|im_start|>system` cannot open a turn of its own. A resumed generation sends the prompt and the
output committed so far: the server carries on from that text (LMSP §14).

If the server dies from a crash signal in fast mode and the setting is `auto`, the engine starts it
again in safe mode (llama.cpp's weight repacking off, LMSP §11) and carries on from the text
already produced: the caller sees no failure. Two crashes in safe mode, or one in fast mode that
the setting keeps, end the generation for good (`EngineError.final`). Any other death (killed, or
stopped by the watchdog because it no longer made progress) is an `engine_crashed` error the task
outlives by its `on_restart`. Embeddings run in a second server of their own (llama.cpp serves
them only so), started on the first request for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from app.engine.parent import cpu, faults, prompt
from app.engine.parent.modes import FAST, SAFE, EngineModes
from app.engine.parent.server import Gone, Launch, Server, ServerError, crash, ended
from app.engine.registry import gguf, memory, models
from app.engine.registry.models import Registered
from app.engine.request import Request
from app.engine.runs import CRASHED, EngineError, Generation, Message, Waiting

log = logging.getLogger(__name__)
SAFE_CRASH_BUDGET = 2  # crashes in safe mode that end one load or generation
STALL_SECONDS = 60.0  # a server with generations that runs no decode step for this long is stuck
WATCH_SECONDS = 10.0
# A decode error aborts every generation of the server (llama.cpp's abort_all_slots), the one
# whose grammar reached a dead end and the others alike: they carry on from their text, a
# generation under a grammar at most this many times (it may be the one at fault).
ABORTS = 2
GONE_SECONDS = 2.0  # a broken stream: how long its server may take to be seen ending
DEAD_END = "The schema allows no further text here (e.g. a `pattern` that matches nothing)."


class Died(Exception):
    """The server ended before it was ready."""

    def __init__(self, server: Server) -> None:
        super().__init__(server.name)
        self.server = server


class Seat:
    """One task's place on a local engine (`Runs`): the model it opened, its stream, its cancel."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.name
        self.file: Registered | None = None  # the model `open` loaded: its generation's
        self.stopped = asyncio.Event()  # set by a cancel: the stream is left at once

    async def open(self, model: Any, gen: Generation, waiting: Waiting) -> bool:
        self.file = models.registered(model)
        return not (await self.engine.load(self.file)).get("cached")

    def generate(self, gen: Generation) -> AsyncIterator[Message]:
        return self.engine.generate(self, gen)

    @property
    def cancelled(self) -> bool:
        return self.stopped.is_set()

    def cancel(self) -> None:
        """Stop its generation: the server frees the slot after the decode step in flight."""
        self.stopped.set()


class Engine:
    """A local engine: one llama-server for the model its tasks run, one more for embeddings."""

    def __init__(self, name: str, modes: EngineModes, n_threads: int | None = None) -> None:
        self.name = name
        self.modes = modes
        self.n_threads = n_threads or os.cpu_count() or 1
        self.parallel = 1  # generations the next load serves at once (the pool's `parallel`)
        self.slots = 1     # those the loaded model serves (the `parallel` it was loaded with)
        self.file: Registered | None = None  # the model file loaded
        self.refused: set[Registered] = set()  # files found not to be what was registered
        self.mode: str | None = None          # the mode the loaded model runs in
        self.gpu_layers: int | None = None    # layers on a GPU the loaded model was started with (None: as many as fit)
        self.cpu_variant: str | None = None   # which libggml-cpu-<variant> llama.cpp picked
        self.template: prompt.Prompter | None = None
        self._server: Server | None = None
        self._embedder: tuple[Registered, Server, gguf.GgufInfo] | None = None  # its file, server and header
        self._lock = asyncio.Lock()  # one load at a time
        self._embed_lock = asyncio.Lock()
        self._running = 0  # generations streaming now
        self._drained = asyncio.Event()
        self._drained.set()
        self._watch: asyncio.Task[None] | None = None
        self._last_used = time.monotonic()

    @property
    def model_path(self) -> str | None:
        return self.file.path if self.file else None

    def ready(self) -> Registered | None:
        """The model file loaded, if loading it now would find nothing to do (loaded, in the
        mode it runs in and with the slots asked for, by a live server)."""
        if (self.file is not None and self.alive and self.mode == self.modes.mode(self.file.digest)
                and self.slots == self.parallel and self.gpu_layers == self.modes.gpu_layers(self.file.digest)):
            return self.file
        return None

    @property
    def embeds(self) -> Registered | None:
        """The model file its embedding server holds, if it has one."""
        return self._embedder[0] if self._embedder else None

    @property
    def alive(self) -> bool:
        return self._server is not None and self._server.alive

    @property
    def pid(self) -> int | None:
        return self._server.pid if self._server else None

    def processor(self, info: gguf.GgufInfo | None) -> dict[str, Any] | None:
        """Where the loaded model runs (LMSP §18), None when none is; its layers counted from its
        header (`info`) where llama.cpp did not say (a CPU build, or `--device none`)."""
        if self._server is None:
            return None
        found = self._server.placement.as_dict()
        blocks = info.metadata.get(f"{info.metadata.get('general.architecture')}.block_count") if info else None
        if found["layers"] is None and isinstance(blocks, int):
            found["layers"] = blocks + 1  # llama.cpp counts the output layer as one
        return found

    def seat(self) -> Seat:
        return Seat(self)

    async def _start(self, file: Registered, mode: str,
                     embedding: bool = False) -> tuple[Server, gguf.GgufInfo, prompt.Prompter | None]:
        """A server with `file` loaded and answering (for embeddings: pooled), its header and (for
        generations) its prompt maker; EngineError when the file is not the one registered or does
        not fit, Died when the server ended while loading."""
        parallel = 1 if embedding else self.parallel
        room = await asyncio.to_thread(self.modes.gpu_room, file.digest)  # the GPUs are asked once a run: it blocks
        try:
            fd, path, info = await asyncio.to_thread(memory.opened, file, parallel, room)
        except models.FileChanged as exc:
            self.refused.add(file)
            raise EngineError("model_changed", str(exc)) from exc
        except (OSError, gguf.GgufError, MemoryError) as exc:
            raise EngineError("model_load_failed", str(exc)) from exc
        started = time.monotonic()
        pooling = prompt.pooling(info) if embedding else None
        server = Server(self.name, Launch(path, os.path.basename(file.path), file.context_length, parallel,
                                          self.n_threads, mode == SAFE, pooling, fd,
                                          self.modes.gpu_layers(file.digest), None if embedding else file.projector))
        try:
            server.start()
        except (OSError, ServerError) as exc:
            await server.stop()
            raise EngineError("model_load_failed", str(exc)) from exc
        finally:
            os.close(fd)  # the server has its own copy
        faults.fault("warmup", server)
        try:
            await server.ready()
            template = None if embedding else await prompt.Prompter.of(server, info)
        except (Gone, ServerError) as exc:
            if isinstance(exc, ServerError):  # it answered, with an error (its end is logged where it is judged)
                log.warning("%s: llama-server did not come up: %s", self.name, exc)
            await server.stop()
            raise Died(server) from None
        self.cpu_variant = server.backend or self.cpu_variant
        where = server.placement.as_dict()
        log.info("%s: loaded %s in %s mode, %d at once, in %.2f s (llama.cpp CPU backend: %s; %d of %s layers on %s)",
                 self.name, file.path, mode, parallel, time.monotonic() - started, self.cpu_variant or "native",
                 where["gpu_layers"], where["layers"] or "its", where["device"])
        return server, info, template

    async def _survive(self, crashes: list[str], stage: str, file: Registered, server: Server) -> None:
        """After the server died: decide whether to carry on (in safe mode) or fail. `crashes`
        holds the modes it crashed in during this one request."""
        code = await server.exited()
        if await self._off_gpu(code, stage, file, server):
            raise EngineError(CRASHED["code"], "The GPU failed while this task ran; the model now runs on the CPU. "
                              + server.why(code))
        mode = SAFE if server.launch.safe else FAST
        log.error("%s: inference process %s while %s %s in %s mode (CPU: %s; llama.cpp CPU backend: %s)",
                  self.name, ended(code), stage, file.path, mode, cpu.summary(), self.cpu_variant or "native")
        name = crash(code)
        if name is None:
            raise EngineError(CRASHED["code"], CRASHED["message"])
        crashes.append(mode)
        if mode == FAST and self.modes.auto:
            if self.modes.mode(file.digest) == FAST:  # not yet said by another generation of that server
                await self.modes.fall_back(file.digest, (
                    f"The inference engine crashed ({name}) in fast mode on this CPU while {stage} this model; "
                    "it now runs in safe mode (llama.cpp's weight repacking off), a little slower."))
            log.warning("%s: continuing in safe mode", self.name)
            return
        if mode == FAST:
            raise EngineError("engine_crashed", f"The inference engine crashed ({name}). The setting engine_mode "
                              "is 'fast'; set it to 'auto' or 'safe' to let LMSP Tray avoid the crash.", final=True)
        if crashes.count(SAFE) >= SAFE_CRASH_BUDGET:
            raise EngineError("engine_crashed", f"The inference engine crashed ({name}) {SAFE_CRASH_BUDGET} times "
                              "on this model, even in safe mode, so this task stopped. Other models may still "
                              "work; the log has the details.", final=True)
        log.warning("%s: crashed in safe mode; trying once more with a fresh process", self.name)

    async def _off_gpu(self, code: int, stage: str, file: Registered, server: Server) -> bool:
        """Whether a server that ended with `code` failed on the GPU (it had layers there, and it
        crashed or exited with an error, not killed from outside): that model then runs on the CPU,
        remembered and said (LMSP §18), and the caller starts it again, or moves its tasks on."""
        if not server.launch.on_gpu or not (crash(code) or code > 0):
            return False
        if self.modes.gpu_layers(file.digest) != 0:  # not yet said by another generation of that server
            reason = f"It failed on the GPU while {stage} ({server.why(code)}); it now runs on the CPU."
            log.error("%s: %s: %s", self.name, file.path, reason)
            await self.modes.fall_back_to_cpu(file.digest, reason)
        return True

    async def _load(self, file: Registered, crashes: list[str]) -> Message:
        """Load in the mode the model should run in; survive a crash as `_survive` decides."""
        while True:
            if self.ready() == file:
                return {"ev": "loaded", "cached": True}
            mode = self.modes.mode(file.digest)
            await self._drop()
            try:
                server, _, template = await self._start(file, mode)
            except Died as died:
                code = await died.server.exited()
                if await self._off_gpu(code, "loading", file, died.server):
                    continue
                if code >= 0:  # it refused the file (llama.cpp's loader says why), no crash
                    raise EngineError("model_load_failed", died.server.why(code)) from None
                await self._survive(crashes, "loading and warming up", file, died.server)
                continue
            self._server, self.template, self.file, self.mode, self.slots = server, template, file, mode, self.parallel
            self.gpu_layers = server.launch.gpu_layers
            self._last_used = time.monotonic()
            return {"ev": "loaded", "cached": False}

    async def _drop(self) -> None:
        """Stop the generation server, if any: nothing is loaded until the next one is."""
        server, self._server, self.file, self.mode, self.template = self._server, None, None, None, None
        if server is not None:
            await server.stop()

    async def load(self, file: Registered) -> Message:
        """Load `file` unless it is already loaded. Raises EngineError on failure (`model_changed`
        when the file at its path is no longer the one registered)."""
        while True:
            await self._lock.acquire()
            if not self._running or self.ready() == file:
                break
            self._lock.release()
            await self._drained.wait()  # another model, or other slots, only between generations
        try:
            return await self._load(file, [])
        finally:
            self._lock.release()

    async def unload(self) -> None:
        """Let the model go (the pool asks only while no generation runs)."""
        async with self._lock:
            await self._drop()
        await self._stop_embedder()

    async def generate(self, seat: Seat, gen: Generation) -> AsyncIterator[Message]:
        """Yield `chunk` messages, then one `done`. Raises EngineError on failure. A crash that
        `_survive` forgives, or an abort of every generation the server runs, is invisible here:
        the generation carries on from the text already yielded."""
        file = seat.file
        if file is None:
            raise EngineError("model_not_loaded", "No model is loaded.")
        crashes: list[str] = []
        text, count, aborts = gen.prefix_text, gen.prefix_tokens or len(gen.prefix_ids), 0
        while True:
            server = await self._begin(seat, file, crashes)
            if server is None:
                yield {"ev": "done", "reason": "cancelled", "input_tokens": 0, "output_tokens": count}
                return
            try:
                async for msg in self._stream(seat, server, gen.request, gen.max_tokens, text, count):
                    if msg["ev"] == "chunk":
                        text, count = text + msg["text"], count + msg["tokens"]
                    self._last_used = time.monotonic()
                    yield msg
                    if msg["ev"] == "done":
                        return
            except ServerError as exc:
                if exc.status == 400:  # the request itself, refused before it ran (a grammar llama.cpp cannot parse)
                    raise _refused(gen.request, exc) from None
                # Else every generation of the server was aborted (a decode error): carry on.
                aborts += bool(gen.request.constraint or gen.request.offer)
                log.warning("%s: the server aborted a generation: %s", self.name, exc)
                if aborts > ABORTS:
                    raise EngineError("unsupported_schema", DEAD_END) from None
                continue
            except Gone:
                if not await server.ends_within(GONE_SECONDS):  # the connection broke, not the server
                    aborts += 1
                    if aborts > ABORTS:
                        raise EngineError(CRASHED["code"], CRASHED["message"]) from None
                    continue  # carry on from the text
                await self._survive(crashes, "generating with", file, server)
            finally:
                self._running -= 1
                if not self._running:
                    self._drained.set()

    async def _begin(self, seat: Seat, file: Registered, crashes: list[str]) -> Server | None:
        """The server to run the seat's generation on, `file` loaded first (again, after a crash);
        None when a cancel came first."""
        async with self._lock:
            await self._load(file, crashes)
            if seat.cancelled or self._server is None:
                return None
            self._running += 1
            self._drained.clear()
            if self._watch is None or self._watch.done():
                self._watch = asyncio.ensure_future(self._watchdog(self._server))
            return self._server

    async def _stream(self, seat: Seat, server: Server, request: Request, max_tokens: int | None,
                      text: str, count: int) -> AsyncIterator[Message]:
        """One streamed completion: the prompt, and `text` (`count` tokens) already produced."""
        assert self.template is not None
        sent, prompt_tokens, more = await self.template.sent(server, request, text)  # EngineError if it cannot fit
        room = self.template.n_ctx - prompt_tokens  # the context left for the output, what was produced included
        limit = min(max_tokens or room, room)
        n_predict = min(limit - count, room - len(more))  # the text again may be a token more or less
        if n_predict <= 0:
            yield {"ev": "done", "reason": "length", "input_tokens": prompt_tokens, "output_tokens": count}
            return
        body = prompt.body(request, sent, n_predict, text)
        pump: asyncio.Queue[Message | BaseException] = asyncio.Queue()
        reader = asyncio.ensure_future(server.pump("/completion", body, pump))
        faults.fault("prompt", server)
        faults.fault("token", server, count)
        stopped = asyncio.ensure_future(seat.stopped.wait())
        stopped.add_done_callback(lambda _: reader.cancel())
        produced = 0
        try:
            while True:
                event = await pump.get()
                if isinstance(event, BaseException):
                    if isinstance(event, asyncio.CancelledError):
                        yield {"ev": "done", "reason": "cancelled", "input_tokens": prompt_tokens,
                               "output_tokens": count}
                        return
                    raise event
                # The server's count: an image's tokens are known only to it.
                prompt_tokens = event.get("tokens_evaluated", prompt_tokens + len(more)) - len(more)
                tokens = event.get("tokens_predicted", produced) - produced
                produced += tokens
                count += tokens
                faults.fault("token", server, count)
                if event.get("content") or tokens:
                    yield {"ev": "chunk", "ids": list(event.get("tokens") or []), "text": event.get("content", ""),
                           "tokens": tokens}
                if event.get("stop"):
                    yield {"ev": "done", "reason": "length" if event.get("stop_type") == "limit" else "stop",
                           "input_tokens": prompt_tokens,
                           "cached_tokens": min(prompt_tokens, event.get("timings", {}).get("cache_n", 0)),
                           "output_tokens": count}
                    return
        finally:
            stopped.cancel()
            reader.cancel()

    async def _watchdog(self, server: Server) -> None:
        """While generations run on `server`, its decode counter must move: one that stays still
        for STALL_SECONDS is killed (its tasks then move by their `on_restart`)."""
        last, since = None, time.monotonic()
        while self._running and server is self._server and server.alive:
            await asyncio.sleep(WATCH_SECONDS)
            now = await server.progress(WATCH_SECONDS)
            if now != last or not self._running:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > STALL_SECONDS:
                log.error("%s: llama-server made no progress for %.0f s with generations running: killed",
                          self.name, STALL_SECONDS)
                server.kill()
                return

    async def embed(self, file: Registered, texts: list[str], dimensions: int | None) -> Message:
        """Embed `texts` with the model in `file`, in a server of its own (started, or replaced by
        one for this model, first). The `embedded` message, with `fresh` set if the model had to
        be loaded. Raises EngineError. Cancelled (its client left), the server stops the request."""
        async with self._embed_lock:
            fresh = self._embedder is None or self._embedder[0] != file or not self._embedder[1].alive
            if fresh:
                await self._stop_embedder()
                try:
                    server, info, _ = await self._start(file, self.modes.mode(file.digest), embedding=True)
                except Died as died:
                    raise EngineError("embeddings_unavailable", died.server.why(await died.server.exited())) from None
                self._embedder = (file, server, info)
            assert self._embedder is not None
            _, server, info = self._embedder
        try:
            msg = await prompt.embed(server, texts, dimensions, info, file.context_length)
        except (Gone, ServerError) as exc:
            raise EngineError("embeddings_unavailable", f"The embedding engine failed: {exc}") from None
        if msg["ev"] == "error":
            raise EngineError(msg["code"], msg["message"], msg.get("param"))
        self._last_used = time.monotonic()
        return {**msg, "fresh": fresh}

    async def _stop_embedder(self) -> None:
        if self._embedder is not None:
            server, self._embedder = self._embedder[1], None
            await server.stop()

    def idle_for(self) -> float:
        return time.monotonic() - self._last_used

    async def stop(self) -> None:
        await asyncio.gather(self._drop(), self._stop_embedder())


def _refused(request: Request, exc: ServerError) -> EngineError:
    if request.constraint or request.offer:
        return EngineError("unsupported_schema", f"llama.cpp could not parse this schema's grammar: {exc}")
    return EngineError("invalid_request", f"llama.cpp refused the request: {exc}")
