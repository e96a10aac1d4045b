"""A scripted engine: the engine interface of app/engine/parent/engine.py without llama.cpp, for
the tests about the machine around inference (the task states, cancel, recovery, idempotency,
fairness, limits, streams). A user never meets it: the app always runs `Engine`.

Every prompt is answered the same way, counting: "1, 2, 3, ..." (a number, then a comma, each
a token) up to `Script.length`, then it stops (reason `stop`), unless `max_tokens` or a stop
sequence ends it first, at `Script.pace` tokens a second. A token's id is its position, so a
resumed generation (its ids so far given back) goes on with exactly the text an uninterrupted
one would have had, as llama.cpp's does at temperature 0.

Each engine has a real child process, as `Engine` has: a `cat` reading its pipe, which ends when
the app closes that pipe or dies. A test may kill it (`pid`), or have the engine kill it after
`Script.crash_after` tokens: the generation then fails with the real engine's `engine_crashed`,
and the next one starts a fresh child.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from app.engine.parent.modes import EngineModes
from app.engine.registry import models
from app.engine.registry.models import Registered
from app.engine.runs import CRASHED, EngineError, Generation, Message, Waiting

log = logging.getLogger("app.engine.parent.engine")  # its lines read as the real engine's
CHILD = ["cat"]  # the scripted engine's child (tests/conftest.py's Headless.engine_pids finds it so)


@dataclass
class Script:
    """What every scripted engine of one service does; a test may change it between requests."""
    pace: float = 200.0          # tokens a second
    length: int = 5000           # the number the answer counts to before it stops by itself
    load_seconds: float = 0.0    # a model load
    prompt_seconds: float = 0.0  # reading the prompt, before the first token
    crash_after: int | None = None  # tokens into a generation, the child is killed: engine_crashed

    def token(self, k: int) -> str:
        """The k-th token of the answer: "1", ",", " 2", ",", " 3", ..."""
        return "," if k % 2 else f"{' ' if k else ''}{k // 2 + 1}"

    def tokens(self) -> int:
        """How many tokens the whole answer has (no comma after the last number)."""
        return 2 * self.length - 1


def tokens(text: str) -> int:
    """What a text costs of the context: a token a word, or four characters (no spaces)."""
    return max(len(text.split()), -(-len(text) // 4))


def factory(script: Script) -> Callable[..., ScriptedEngine]:
    """An `engine_factory` for AppService: engines made as `Engine(name, modes, n_threads=...)` are."""
    return functools.partial(ScriptedEngine, script=script)


class ScriptedEngine:
    """One engine, as the runner, the models, the embeddings and the service use `Engine`."""

    def __init__(self, name: str, modes: EngineModes, n_threads: int | None = None, *,
                 script: Script | None = None) -> None:
        self.name, self.modes = name, modes
        self.script = script or Script()
        self.file: Registered | None = None
        self.mode: str | None = None
        self.refused: set[Registered] = set()
        self.embeds: Registered | None = None  # it computes no embeddings
        self.parallel = self.slots = 1
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = asyncio.Lock()
        self._last_used = time.monotonic()

    @property
    def model_path(self) -> str | None:
        return self.file.path if self.file else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def ready(self) -> Registered | None:
        if (self.file is not None and self.alive and self.mode == self.modes.mode(self.file.digest)
                and self.slots == self.parallel):
            return self.file
        return None

    def processor(self, info: Any) -> dict[str, Any] | None:
        """It runs on no GPU."""
        return {"device": "CPU", "gpu_layers": 0, "layers": None, "vram_bytes": 0} if self.alive else None

    def seat(self) -> ScriptedSeat:
        return ScriptedSeat(self)

    def _reap(self) -> None:
        """After the child died, as `Engine._reap`: nothing is loaded any more."""
        if self._proc is not None:
            log.warning("%s process exited with code %s", self.name, self._proc.wait())
        self._proc, self.file, self.mode = None, None, None

    async def _load(self, file: Registered) -> bool:
        """Load `file` unless it is ready; True when it had to be loaded."""
        if self.ready() == file:
            return False
        if self._proc is not None and not self.alive:
            self._reap()
        if self._proc is None:
            self._proc = subprocess.Popen(CHILD, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            log.info("%s: started inference process %s", self.name, self._proc.pid)
        self.file = self.mode = None
        try:  # the file checks the real child makes before llama.cpp reads it
            fd, _ = await asyncio.to_thread(models.open_verified, file)
            os.close(fd)
        except models.FileChanged as exc:
            self.refused.add(file)
            raise EngineError("model_changed", str(exc)) from exc
        except OSError as exc:
            raise EngineError("model_load_failed", str(exc)) from exc
        await asyncio.sleep(self.script.load_seconds)
        self.file, self.mode, self.slots = file, self.modes.mode(file.digest), self.parallel
        log.info("%s: loaded %s in %s mode (scripted)", self.name, file.path, self.mode)
        self._last_used = time.monotonic()
        return True

    async def load(self, file: Registered) -> Message:
        async with self._lock:
            return {"ev": "loaded", "cached": not await self._load(file)}

    async def unload(self) -> None:
        async with self._lock:
            self.file = self.mode = None

    async def generate(self, seat: ScriptedSeat, gen: Generation) -> AsyncIterator[Message]:
        file = seat.file
        if file is None:
            raise EngineError("model_not_loaded", "No model is loaded.")
        async with self._lock:
            await self._load(file)
        async for msg in self._answer(seat, gen, file):
            self._last_used = time.monotonic()
            yield msg

    async def _answer(self, seat: ScriptedSeat, gen: Generation, file: Registered) -> AsyncIterator[Message]:
        """A generation as the engine streams it, scripted: chunks held back
        while they could still become a stop sequence, the last one marked `last`."""
        script, start = self.script, len(gen.prefix_ids or [])
        prompt = sum(tokens(str(m.get("content", ""))) + 4 for m in gen.request.prompt())
        limit = min(gen.max_tokens or script.tokens(), script.tokens())
        stops = gen.request.stop or []
        hold = max((len(s) for s in stops), default=1) - 1
        if prompt >= file.context_length:
            raise EngineError("context_length_exceeded",
                              f"The input is {prompt} tokens; the model's context holds {file.context_length}.")
        text = "".join(script.token(k) for k in range(start))
        emitted, count, reason = len(gen.prefix_text), start, "stop"
        await self._pause(seat, script.prompt_seconds)
        while count < limit:
            await self._pause(seat, 1 / script.pace)
            if script.crash_after is not None and count - start >= script.crash_after and self.alive:
                assert self._proc is not None
                self._proc.send_signal(signal.SIGKILL)
            if not self.alive:
                self._reap()
                raise EngineError(CRASHED["code"], CRASHED["message"])
            if seat.cancelled:
                yield {"ev": "done", "reason": "cancelled", "input_tokens": prompt, "output_tokens": count}
                return
            text += script.token(count)
            count += 1
            cut = min((i for i in (text.find(s, max(0, emitted - hold)) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                yield {"ev": "chunk", "ids": [count], "text": text[emitted:cut], "last": True}
                emitted = cut
                break
            safe = max(emitted, len(text) - hold)
            yield {"ev": "chunk", "ids": [count], "text": text[emitted:safe], "last": count >= limit}
            emitted = safe
        else:
            reason = "length" if count < script.tokens() else "stop"
            if len(text) > emitted:
                yield {"ev": "chunk", "ids": [], "text": text[emitted:], "last": True}
        yield {"ev": "done", "reason": reason, "input_tokens": prompt, "cached_tokens": 0, "output_tokens": count}

    async def _pause(self, seat: ScriptedSeat, seconds: float) -> None:
        """Wait `seconds`, or less if a cancel comes (the real child sees one between two slices
        of the prompt, and between two tokens)."""
        deadline = time.monotonic() + seconds
        while not seat.cancelled and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.01))

    async def embed(self, file: Registered, texts: list[str], dimensions: int | None) -> Message:
        raise EngineError("embeddings_unavailable", "The scripted engine computes no embeddings.")

    def idle_for(self) -> float:
        return time.monotonic() - self._last_used

    async def stop(self) -> None:
        """As `Engine.stop`: the child is told to go (its pipe closed), killed if it lingers."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.to_thread(proc.wait, 3)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


class ScriptedSeat:
    """One task's place on a scripted engine, as `Seat` is on an `Engine`."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine, self.name = engine, engine.name
        self.file: Registered | None = None
        self.cancelled = False

    async def open(self, model: Any, gen: Generation, waiting: Waiting) -> bool:
        self.file = models.registered(model)
        async with self.engine._lock:
            return await self.engine._load(self.file)

    def generate(self, gen: Generation) -> AsyncIterator[Message]:
        return self.engine.generate(self, gen)

    def cancel(self) -> None:
        self.cancelled = True
