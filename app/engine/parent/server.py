"""One `llama-server` process (LMSP §18): a model loaded by llama.cpp's own server, spoken to over
HTTP on a Unix socket only this user can reach, with a key of its own.

Every option that decides memory or behaviour is passed (`arguments`): nothing is left to the
server's defaults, which suit a machine given over to one model, not a desktop (the training
context, four slots, an 8 GiB prompt cache, threads that busy-wait while idle). The key travels in
the environment, never on the command line, and options or keys the user's environment sets for
llama.cpp (`LLAMA_ARG_*`) are not passed on.

It never outlives the app: on Linux the kernel kills it when the app's main thread ends, however
it ends; everywhere it holds a pipe from the app on its standard input and exits when that closes
(llama.cpp's own router protocol: `LLAMA_SERVER_ROUTER_PORT` set, the state lines on its standard
output, `cmd_router_to_child:exit` to stop). Ready means the model answered a real request, not
that the process listens. `progress` reads its decode counter, which the engine's watchdog compares.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import psutil

from app import paths
from app.engine.parent import gpu

log = logging.getLogger(__name__)
STATE = "cmd_child_to_router:state:"
EXIT = b"cmd_router_to_child:exit\n"
# Host memory for prompts llama.cpp keeps after their slot moved on (a conversation's next turn
# finds its history there): enough for a few long chats of a small model, not a server's 8 GiB.
CACHE_RAM_MIB = 512
UBATCH = 512  # prompt tokens one decode step reads: what a cancel or another slot's token waits for at most
# llama.cpp's OpenMP threads wait for each other at every step; spinning while they wait (libgomp's
# default, and 100,000 spins) made a server beside one busy program decode 0.7 tokens/s where
# sleeping made 64 (two threads, two cores).
WAIT_POLICY = "PASSIVE"
# Inference keeps every core busy; the service and the GUI must still answer at once. A slightly
# lower priority lets their threads run the moment they wake (more starves decoding whenever other
# programs keep the cores busy: nice 10 gave 6 tokens/s beside two, nice 3 19, nice 0 26).
NICENESS = 3
POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's pooling types, by their GGUF number
PR_SET_PDEATHSIG = 1
BACKEND = re.compile(r"libggml-cpu-(\w+)\.(?:so|dll|dylib)")  # the CPU variant's library, as loaded
HTTP_THREADS = 4  # beside one per slot: the prompt's tokenizing, the watchdog, a cancel
# llama.cpp's trace level: the library's own lines, where it says as it loads where the model went
# (the GPU's layers and buffers: `placement`); a request then adds some thirty lines, not one a token.
LOG_VERBOSITY = 4
TAIL = 20  # lines of its output kept, for the error when it fails to load
# The level letter llama.cpp's log puts after each line's time ("0.00.021.190 I srv ...").
LEVELS = {"D": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR}


class ServerError(Exception):
    """The server answered an error (`status`: its HTTP status), or failed to start."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Gone(Exception):
    """The process ended (or the connection broke) while a request was under way."""


@dataclass(frozen=True)
class Launch:
    """What one server is started for: the model (at `path`, opened as `fd` where that is passed on),
    each slot's context, the slots, the threads, safe mode, embeddings (with the model's pooling),
    its layers on a GPU (None: as many as the GPU's free memory holds), and the vision projector
    that lets a generation server read images."""
    path: str
    alias: str
    n_ctx: int
    parallel: int
    threads: int
    safe: bool
    pooling: int | None = None  # None: a generation server; else embeddings, pooled this way (0: by mean)
    fd: int | None = None
    gpu_layers: int | None = 0
    projector: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.gpu_layers != 0


# Deaths that point at llama.cpp's own code, not at someone killing the process (SIGKILL from the
# out-of-memory killer or the watchdog, SIGTERM): SIGSEGV/SIGBUS (AMX on Sapphire Rapids), SIGILL
# (AMX a virtual machine reports but refuses), SIGFPE, and SIGABRT (a GGML_ASSERT in a kernel).
# Windows has no such signals: a process that crashes there ends with the exception's NTSTATUS as
# its exit code (abort() is a fail fast, 0xC0000409).
if sys.platform == "win32":
    CRASH_SIGNALS: set[int] = set()
else:
    CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
NTSTATUS_CRASHES = {0xC0000005: "access violation", 0xC000001D: "illegal instruction",
                    0xC0000094: "integer division by zero", 0xC00000FD: "stack overflow",
                    0xC0000409: "fail fast", 0x80000003: "breakpoint"}


def crash(code: int, platform: str = sys.platform) -> str | None:
    """The crash an exit code (a Popen returncode) says llama.cpp's own code had, by name; None
    where it says none (an exit, or a kill from outside)."""
    if platform == "win32":
        status = code & 0xFFFFFFFF  # an NTSTATUS, however the int was read
        return f"{NTSTATUS_CRASHES[status]} (0x{status:08X})" if status in NTSTATUS_CRASHES else None
    return signal.Signals(-code).name if code < 0 and -code in CRASH_SIGNALS else None


def ended(code: int) -> str:
    """How a process with this exit code ended, in words."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"ended with {crash(code) or f'exit code {code}'}"


def arguments(binary: str, launch: Launch, socket: str) -> list[str]:
    """The command line: every option that decides memory or behaviour, explicitly."""
    t = str(launch.threads)
    args = [binary, "--model", launch.path, "--alias", launch.alias, "--host", socket, "--port", "0",
            "--threads", t, "--threads-batch", t, "--poll", "0", "--prio", "0",
            *_gpu(launch.gpu_layers), "--no-webui", "--metrics", "--slots", "--warmup",
            "--threads-http", str(launch.parallel + HTTP_THREADS),
            "--repack" if not launch.safe else "--no-repack", "--log-verbosity", str(LOG_VERBOSITY),
            "--log-colors", "off"]
    if launch.pooling is None:
        args += ["--ctx-size", str(launch.n_ctx * launch.parallel), "--parallel", str(launch.parallel),
                 "--no-kv-unified", "--batch-size", "2048", "--ubatch-size", str(UBATCH),
                 "--cache-ram", str(CACHE_RAM_MIB), "--cache-reuse", "0", "--jinja", "--reasoning-format", "none"]
    else:  # each input in one batch, as pooling needs
        args += ["--embedding", "--pooling", POOLING.get(launch.pooling, "mean"), "--ctx-size", str(launch.n_ctx),
                 "--parallel", "1", "--batch-size", str(launch.n_ctx), "--ubatch-size", str(launch.n_ctx),
                 "--cache-ram", "0"]
    # A vision projector goes where the model's layers go; without one, none is looked for.
    offload = "--mmproj-offload" if launch.on_gpu else "--no-mmproj-offload"
    args += ["--mmproj", launch.projector, offload] if launch.projector else ["--no-mmproj"]
    return args


def _gpu(layers: int | None) -> list[str]:
    """Where the model's layers go (LMSP §18)."""
    if layers == 0:  # no device at all: llama.cpp would still send a long prompt's matrices to one
        return ["--device", "none", "--n-gpu-layers", "0", "--fit", "off"]
    if layers is None:  # llama.cpp fits them to the devices' free memory, leaving room for the desktop
        return ["--n-gpu-layers", "auto", "--fit", "on", "--fit-target", str(gpu.FIT_MARGIN_MIB)]
    return ["--n-gpu-layers", str(layers), "--fit", "off"]


def environment(key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "LLAMA_API_KEY"))}
    env.update(LLAMA_API_KEY=key, LLAMA_SERVER_ROUTER_PORT="0", OMP_WAIT_POLICY=WAIT_POLICY)
    env.setdefault("HOME", os.path.expanduser("~"))  # llama.cpp reads it while parsing its options
    return env


def _in_child() -> None:
    """Run in the server's process before it starts (POSIX): killed with the app's main thread,
    which started it (Linux), and a little below the app's priority."""
    if sys.platform == "win32":  # never run there (no preexec_fn): CREATION says its priority
        return
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.nice(NICENESS)


# How a server is started a little below the app's priority: Windows has a creation flag for it.
if sys.platform == "win32":
    PREEXEC: Callable[[], None] | None = None
    CREATION = subprocess.BELOW_NORMAL_PRIORITY_CLASS
else:
    PREEXEC, CREATION = _in_child, 0


class Server:
    """One llama-server process, started by `start` on the event loop's thread."""

    def __init__(self, name: str, launch: Launch) -> None:
        self.name = name
        self.launch = launch
        self.key = secrets.token_urlsafe(32)
        _sweep_once()
        self.folder = tempfile.mkdtemp(prefix=f"lmsp-{os.getpid()}-")  # private (0700): the socket's
        self.socket = os.path.join(self.folder, "llama.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: deque[str] = deque(maxlen=TAIL)
        self.facts: dict[str, Any] = {}  # what its ready line said of the model (n_ctx, n_ctx_train, ...)
        self.placement = gpu.Placement()  # where it put the model, as it said while loading
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self.ended: asyncio.Future[int] | None = None  # its exit code, once it ended
        self._client: httpx2.AsyncClient | None = None
        self.stopped = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def backend(self) -> str | None:
        """The libggml-cpu-<variant> llama.cpp picked for this CPU, where the system says (Linux)."""
        try:
            found = BACKEND.search(Path(f"/proc/{self.pid}/maps").read_text())
        except OSError:
            return None
        return found[1] if found else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        binary = paths.llama_server()
        if binary is None:
            raise ServerError("llama-server is not installed: `make run` builds it (LMSP_LLAMA_SERVER says where "
                              "another one is).")
        loop = asyncio.get_running_loop()
        self._ready, self.ended = loop.create_future(), loop.create_future()
        fds = (self.launch.fd,) if self.launch.fd is not None else ()
        self.proc = subprocess.Popen(  # noqa: S603 - our own build, options we chose
            arguments(str(binary), self.launch, self.socket), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=environment(self.key), pass_fds=fds, preexec_fn=PREEXEC,
            creationflags=CREATION)
        log.info("%s: started inference process %s (llama-server, %s)", self.name, self.proc.pid, self.launch.alias)
        threading.Thread(target=self._read, args=(loop, self.proc), name=f"lmsp-{self.name}-out", daemon=True).start()

    def _read(self, loop: asyncio.AbstractEventLoop, proc: subprocess.Popen[bytes]) -> None:
        """Its output, line by line, into the log (and `tail`); its state lines to `_ready`; its end to
        `ended`. What it says as it loads is logged, what it says of each request only at debug
        level; its warnings and errors always."""
        assert proc.stdout is not None
        loaded = False
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if line.startswith(STATE):
                with contextlib.suppress(ValueError):
                    state = json.loads(line[len(STATE):])
                    if state.get("state") == "ready":
                        loaded = True
                        loop.call_soon_threadsafe(_settle, self._ready, state.get("payload", {}))
            elif line:
                self.tail.append(line)
                if not loaded:
                    self.placement.read(line)
                level = LEVELS.get(line.split(" ", 2)[1] if " " in line else "", logging.INFO)
                log.log(logging.DEBUG if loaded and level == logging.INFO else level, "%s: %s", self.name, line)
        code = proc.wait()
        loop.call_soon_threadsafe(_settle, self.ended, code)
        loop.call_soon_threadsafe(_fail, self._ready, Gone(self.why(code)))

    def why(self, code: int) -> str:
        """What its end says: the signal or exit code, and its last lines of output."""
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        errors = [line for line in self.tail if " E " in line or "error" in line.lower()]
        return f"llama-server {how}" + (f": {errors[-1]}" if errors else "")

    async def exited(self) -> int:
        """Its exit code (negative: the signal that killed it), once it has ended."""
        return await asyncio.shield(self.ended) if self.ended is not None else 0

    async def ends_within(self, seconds: float) -> bool:
        """Whether it has ended, or does within `seconds` (a broken stream may come a little before)."""
        if self.ended is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self.ended), seconds)
        except TimeoutError:
            return False
        return True

    async def ready(self) -> None:
        """Wait until the model is loaded and has answered one token. Raises Gone if it ended first."""
        assert self._ready is not None
        self.facts = await self._ready
        if self.launch.pooling is None:
            async for _ in self.stream("/completion", {"prompt": [0], "n_predict": 1, "stream": True,
                                                        "cache_prompt": False}):
                pass
        else:
            await self.post("/embedding", {"content": [0], "embd_normalize": -1})

    def client(self) -> httpx2.AsyncClient:
        if self.stopped:  # a late request (the watchdog's, say) finds no server, and makes no client
            raise Gone("the server was stopped")
        if self._client is None:
            # A connection a request: llama.cpp's HTTP server closes idle kept-alive ones on its own
            # schedule, and a request sent on one it just closed fails (a Unix socket costs little to open).
            transport = httpx2.AsyncHTTPTransport(uds=self.socket, limits=httpx2.Limits(
                max_connections=None, max_keepalive_connections=0))
            self._client = httpx2.AsyncClient(transport=transport, base_url="http://llama",
                                              timeout=httpx2.Timeout(None),
                                              headers={"Authorization": f"Bearer {self.key}"})
        return self._client

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        """One request, its JSON answer. Raises ServerError (an error answer) or Gone."""
        try:
            resp = await self.client().post(path, json=body)
            answer = resp.json()
        except (httpx2.TransportError, ValueError) as exc:
            raise Gone(str(exc) or type(exc).__name__) from exc
        if resp.status_code != 200:
            raise ServerError(_message(answer), resp.status_code)
        return answer

    async def get(self, path: str) -> str:
        try:
            return (await self.client().get(path)).text
        except httpx2.TransportError as exc:
            raise Gone(str(exc) or type(exc).__name__) from exc

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A streamed request's events. Leaving the loop early closes the connection: the server
        stops that generation (after the decode step in flight). Raises ServerError or Gone."""
        try:
            async with self.client().stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    raise ServerError(_message(json.loads(await resp.aread())), resp.status_code)
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise ServerError(_message(event), 500)
                    yield event
        except (httpx2.TransportError, ValueError) as exc:
            raise Gone(str(exc) or type(exc).__name__) from exc

    async def pump(self, path: str, body: dict[str, Any], into: asyncio.Queue[Any]) -> None:
        """A streamed request's events into a queue, then whatever ended them (an error, or the
        cancel of this coroutine's task): its reader raises that."""
        try:
            async for event in self.stream(path, body):
                into.put_nowait(event)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            into.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def progress(self, within: float) -> int | None:
        """Decode steps it has run so far (its `/metrics`), None if it does not answer `within` seconds."""
        try:
            text = await asyncio.wait_for(self.get("/metrics"), within)
        except (TimeoutError, Gone):
            return None
        found = next((line.split()[-1] for line in text.splitlines() if line.startswith("llamacpp:n_decode_total")),
                     None)
        return int(float(found)) if found else None

    def kill(self) -> None:
        if self.alive and self.proc is not None:
            self.proc.kill()

    async def stop(self, grace: float = 3.0) -> None:
        """Ask it to exit, kill it after `grace` seconds; then forget its socket."""
        self.stopped = True
        if self.proc is not None and self.ended is not None:
            if self.alive and self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.write(EXIT)
                    self.proc.stdin.flush()
            try:
                await asyncio.wait_for(asyncio.shield(self.ended), grace)
            except TimeoutError:
                self.kill()
                await self.ended
            with contextlib.suppress(OSError):
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        shutil.rmtree(self.folder, ignore_errors=True)


@functools.cache
def _sweep_once() -> None:
    """Once a run, in a thread of its own (it lists the temporary folder): `_sweep`."""
    threading.Thread(target=_sweep, name="lmsp-sweep", daemon=True).start()


def _sweep() -> None:
    """Remove the socket folders of servers whose app is gone: a killed app could not (its pid is
    in the folder's name). Only this user's, and none of an app still running."""
    for folder in Path(tempfile.gettempdir()).glob("lmsp-*-*"):
        pid = folder.name.split("-")[1]
        with contextlib.suppress(OSError):
            mine = sys.platform == "win32" or folder.stat().st_uid == os.getuid()  # Windows: a temp folder per user
            if pid.isdigit() and mine and not psutil.pid_exists(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)


def _message(answer: Any) -> str:
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or answer)


def _settle(future: asyncio.Future[Any] | None, value: Any) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any] | None, exc: Exception) -> None:
    if future is not None and not future.done():
        future.set_exception(exc)
        future.exception()  # nobody may be waiting (a load already done): not an unretrieved error
