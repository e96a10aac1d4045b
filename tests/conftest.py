"""Shared fixtures: a real service on a real SQLite file, a real HTTP client, a real process.

Every process a test starts ends with the test, pass or fail: start it through the `procs`
fixture (or the `headless` one), which kills its whole process group at teardown. Every process
started from this session carries LMSP_TEST_RUN=<this session's id> in its environment, and
`no_process_outlives_the_session` fails the run (and kills them) if any is still alive at its end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

# Never touch a real keychain: the "fail" backend makes the app use its user-only token file.
os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.fail.Keyring"
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Inherited by every child, grandchild (an engine) and tool a test starts: how leftovers are found.
TEST_RUN = os.environ["LMSP_TEST_RUN"] = uuid.uuid4().hex

from app import paths  # noqa: E402
from app.core.service import AppService  # noqa: E402
from app.engine.parent.engine import Engine  # noqa: E402
from app.engine.registry.models import DEFAULT_MODEL_ID  # noqa: E402
from app.server.app import make_app  # noqa: E402
from app.store.store import Store  # noqa: E402
from tests import scripted  # noqa: E402
from tests.helpers import wait_until  # noqa: E402  (imported from here by many tests)

ROOT = Path(__file__).resolve().parent.parent
APP = [sys.executable, "-m", "app"]
# The files that take a minute or more, handed to the workers first (make test: pytest-xdist, each
# file on one worker), so that none of them starts on a worker when the others are done.
LONGEST = ("test_power_cut.py", "test_views_xvfb.py", "test_durable.py", "test_schemathesis.py",
           "test_terminal.py", "test_crash.py", "test_usage.py", "test_ollama.py")


# The files that are Linux by nature: FUSE power cuts, the Xvfb screen and tray, /proc's counts of
# a process (memory, descriptors, threads), the Linux build of the frozen app. Skipped elsewhere.
LINUX = ("test_power_cut.py", "test_durable.py", "test_clean_close.py", "test_tray_xvfb.py", "test_views_xvfb.py",
         "test_engine_process.py", "test_limits.py", "test_logs.py", "test_memory.py", "test_stream_limits.py",
         "test_packaging.py", "test_wheel.py", "test_hostile_inputs.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in LONGEST)  # stable: each file's tests stay in order
    for item in items:
        if item.path.name in LINUX:
            item.add_marker(pytest.mark.linux)
            if sys.platform != "linux":
                item.add_marker(pytest.mark.skip(reason="Linux by nature (FUSE, Xvfb or /proc)"))


def scripted_app(**script: Any) -> list[str]:
    """What runs the app with scripted engines (tests/scripted_app.py), doing as Script(**script) says."""
    return [sys.executable, "-m", "tests.scripted_app", json.dumps(script)]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    """The store alone, on a fresh database file."""
    opened = Store(tmp_path / "lmsp.sqlite3")
    await opened.open()
    yield opened
    await opened.close()


def scripted_marker(request: pytest.FixtureRequest) -> pytest.Mark | None:
    """The `scripted` marker of a test (or of its module), unless the test is marked `llama`."""
    return None if request.node.get_closest_marker("llama") else request.node.get_closest_marker("scripted")


@pytest.fixture
def script(request: pytest.FixtureRequest) -> scripted.Script:
    """What the scripted engines of a test marked `scripted` do: the marker's arguments
    (`@pytest.mark.scripted(pace=50)`), changeable by the test as it goes."""
    marker = scripted_marker(request)
    return scripted.Script(**(marker.kwargs if marker else {}))


@pytest.fixture
def engine_factory(request: pytest.FixtureRequest, script: scripted.Script) -> Any:
    """The service's engines: llama.cpp, or the scripted engine in a test marked `scripted`."""
    return scripted.factory(script) if scripted_marker(request) else Engine


@pytest.fixture
async def service(tmp_path: Path, engine_factory: Any) -> AsyncIterator[AppService]:
    svc = AppService(tmp_path / "data", engine_factory)
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture
async def loaded(service: AppService) -> Any:
    """The engine with the default model loaded: its prompt maker and its llama-server."""
    await service.models.load_model(DEFAULT_MODEL_ID)
    engine = service.pool.engines[0]
    assert engine.template is not None and engine._server is not None
    return engine.template, engine._server


@pytest.fixture
async def api(service: AppService, aiohttp_client: Any) -> Any:
    """An aiohttp test client on a real loopback port, authorised as the owner."""
    client = await aiohttp_client(make_app(service))
    token = await service.access.owner_token()
    client.session.headers["Authorization"] = f"Bearer {token}"
    client.token = token
    return client


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process and everything under it: its tree (psutil, on any system) and, where
    there are process groups, the group it leads (which keeps a child whose parent died first)."""
    with contextlib.suppress(psutil.Error):
        tree = psutil.Process(proc.pid)
        for each in [*tree.children(recursive=True), tree]:
            with contextlib.suppress(psutil.Error):
                each.kill()
    if sys.platform != "win32":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Processes:
    """The processes one test starts, each the leader of its own process group."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[Any]] = []

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(args, start_new_session=True, **kwargs)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            kill_group(proc)


@pytest.fixture
def procs() -> Iterator[Processes]:
    started = Processes()
    try:
        yield started
    finally:
        started.close()


def leftover_processes() -> dict[int, str]:
    """pid -> command line of every live process started from this session, but this one and
    its own multiprocessing resource tracker (which ends with it)."""
    marker = f"LMSP_TEST_RUN={TEST_RUN}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            parent = int(proc_stat(int(entry.name))[1])
        except OSError:  # gone meanwhile
            continue
        if not (parent == os.getpid() and "multiprocessing.resource_tracker" in cmdline):
            found[int(entry.name)] = cmdline
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_session() -> Iterator[None]:
    yield
    if not Path("/proc").is_dir():  # not Linux: nothing to look in
        return
    deadline = time.monotonic() + 10  # a process told to stop a moment ago may still be exiting
    while (left := leftover_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, "processes started by the tests outlived them (now killed): " + "; ".join(
        f"{pid}: {cmd}" for pid, cmd in left.items())


class Headless:
    """`lmsp-tray --headless` as a real child process, to be stopped or SIGKILLed.
    `command` is what runs the app (default: this Python on the checkout)."""

    def __init__(self, data_dir: Path, procs: Processes, command: list[str] | None = None, cwd: Path = ROOT,
                 env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.procs = procs
        self.command = command or APP
        self.cwd, self.env = cwd, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.token = ""
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def start(self, timeout: float = 60.0, preexec: Any = None, output: Any = None) -> Headless:
        """`preexec`: run in the child before it starts (e.g. to lower its resource limits).
        `output`: where its stdout and stderr go (default: the file `log`)."""
        with self.log.open("ab") as log:
            self.proc = self.procs.popen([*self.command, "--headless", "--data-dir", str(self.data_dir),
                                          "--port", "0"], cwd=self.cwd, env=self.env, stdout=output or log,
                                         stderr=subprocess.STDOUT, preexec_fn=preexec)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"service exited: {self.log.read_text()[-2000:]}"
            try:  # service.json may be one a killed run left: only this process's counts
                info = json.loads((self.data_dir / "service.json").read_text())
                self.url = info["url"]
                if info["pid"] == self.proc.pid and self.get("/health")[0] == 200:
                    self.token = (self.data_dir / "owner_token").read_text().strip()
                    return self
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.02)
        raise TimeoutError(f"service did not become healthy: {self.log.read_text()[-2000:]}")

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
                ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Content-Type": "application/json", **({"Authorization": f"Bearer {self.token}"} if self.token else {}),
            **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return self.request("POST", path, body)

    def complete(self, body: dict[str, Any], timeout: float = 120.0, interval: float = 0.05) -> dict[str, Any]:
        """Send `body` as a background request; its task once completed."""
        status, created = self.post("/v1/responses", {**body, "background": True})
        assert status == 202, created
        task_id = created["task"]["id"]
        task: dict[str, Any] = wait_until(
            lambda: (t := self.get(f"/v1/tasks/{task_id}")[1])["status"] == "completed" and t,
            timeout=timeout, interval=interval, what=f"task {task_id} to complete")
        return task

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def engine_pids(self) -> list[int]:
        """The engines' processes: llama-server (a scripted engine's: tests/scripted.py's CHILD)."""
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split() if (args := Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
                and (Path(args[0].decode()).name == "llama-server"
                     or args[:-1] == [a.encode() for a in scripted.CHILD])]



@pytest.fixture
def headless(request: pytest.FixtureRequest, tmp_path: Path, procs: Processes) -> Headless:
    """The app as a process: with scripted engines in a test marked `scripted` (the marker's
    arguments given to its Script)."""
    marker = scripted_marker(request)
    if marker is None:
        return Headless(tmp_path / "data", procs)
    return Headless(tmp_path / "data", procs, scripted_app(**marker.kwargs))


@contextlib.contextmanager
def busy_programs(procs: Processes, count: int) -> Iterator[None]:
    """`count` programs that each keep a core busy, at the user's own priority, while the block runs."""
    busy = [procs.popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for program in busy:
            program.kill()
            program.wait()


# -- real OpenAI-compatible upstreams, for the remote-endpoint tests ---------------------------

# The llama.cpp build every local model runs in (`make` builds it once; LMSP_LLAMA_SERVER, as
# `make test` sets it, says where): the program of the remote-endpoint tests' upstreams too.
LLAMA_SERVER = paths.llama_server() or (Path.home() / ".cache" / paths.APP_NAME
                                        / f"llama.cpp-{paths.LLAMA_CPP}-vulkan" / paths.LLAMA_SERVER)
# Beside the build (not beside a link to it, as .venv/bin/llama-server is).
LLAMA_QUANTIZE = LLAMA_SERVER.resolve().parent / "llama-quantize"


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and
    parentheses): [0] the state, [1] the parent's pid, [11] and [12] user and system CPU ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def llama_servers(parent: int) -> list[int]:
    """The pids of the `llama-server` processes `parent` started (a service's engines), known by
    their program (/proc/<pid>/exe: the file itself, whatever link started it)."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split() if Path(f"/proc/{pid}/exe").resolve().name == paths.LLAMA_SERVER]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (its threads, not its children)."""
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick; another could take it before use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Upstream:
    """One OpenAI-compatible server on loopback serving the default model as `alias`, generating
    for real: llama.cpp's `llama-server` (`kind="llama-server"`), which can continue an answer, or
    that same server behind tests/openai_upstream.py (`kind="openai"`), a plain OpenAI-compatible
    server as OpenAI's own or vLLM are: the service cannot continue an answer there and starts it
    again. One thread each by default: two of them share the machine's two cores. `parallel`: its
    slots (answers at once, each with 2048 tokens of context), a further request waiting for one.
    `fast`: llama.cpp's fast mode (weight repacking, AMX where there is some), as a benchmark's peer
    of the engine; off by default, as it crashes on some CPUs (AMX: Sapphire Rapids). `server`:
    which build; `options`: more of its options, after (and so over) the ones here."""

    def __init__(self, procs: Processes, log: Path, kind: str = "llama-server", alias: str = "smollm2",
                 api_key: str | None = None, threads: int = 1, parallel: int = 1, fast: bool = False,
                 server: Path = LLAMA_SERVER, options: tuple[str, ...] = ()) -> None:
        assert kind in ("llama-server", "openai"), kind
        assert server.is_file(), f"no {server}: `make llama-server` builds it"
        self.procs, self.log, self.kind, self.alias, self.api_key = procs, log, kind, alias, api_key
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        # The server itself, and (kind "openai") the proxy in front of it, each a process.
        self.proc: subprocess.Popen[bytes] | None = None
        self.front: subprocess.Popen[bytes] | None = None
        server_port = self.port if kind == "llama-server" else free_port()
        self.command = [str(server), "--model", str(paths.default_model_file()), "--alias", alias,
                        "--host", "127.0.0.1", "--port", str(server_port), "--threads", str(threads),
                        "--threads-batch", str(threads), "--parallel", str(parallel),
                        "--ctx-size", str(2048 * parallel), "--no-ui", *([] if fast else ["--no-repack"]),
                        *(["--api-key", api_key] if api_key else []),  # then requests need it, else 401
                        *options]
        self.front_command = [sys.executable, "-m", "tests.openai_upstream", "--port", str(self.port),
                              "--server", f"http://127.0.0.1:{server_port}"] if kind == "openai" else None

    def start(self) -> Upstream:
        """Start it (don't wait: `ready` does, so that several load at once)."""
        with self.log.open("ab") as log:
            self.proc = self.procs.popen(self.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            if self.front_command:
                self.front = self.procs.popen(self.front_command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self

    def ready(self, timeout: float = 60.0) -> Upstream:
        """Wait until GET /v1/models answers 200."""
        assert self.proc is not None
        models = urllib.request.Request(self.base_url + "/models", headers={
            "Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in (self.proc, self.front):
                assert proc is None or proc.poll() is None, (
                    f"upstream {self.base_url} exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(models, timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except OSError:  # refused while it loads, 503 (llama-server's "Loading model"), the proxy's 500
                pass
            time.sleep(0.05)
        raise TimeoutError(f"upstream {self.base_url} not ready in {timeout}s: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crash: a stream in progress ends short (its chunked body cut off), new
        connections are refused."""
        assert self.proc is not None
        for proc in (self.front, self.proc):  # the one listening on the port first
            if proc is not None:
                kill_group(proc)

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (user + system): whether it is generating."""
        assert self.proc is not None
        return cpu_seconds(self.proc.pid)

    def restart(self) -> Upstream:
        """The same server again, on the same port (under a second for the default model)."""
        self.kill()
        return self.start().ready()


@pytest.fixture
def upstreams(tmp_path: Path, procs: Processes) -> Any:
    """upstreams(n=1, kind="llama-server", alias="smollm2", api_key=None, threads=1, parallel=1, fast=False,
    server=LLAMA_SERVER, options=()) -> n ready Upstreams, each killed (whole process group) with the test."""
    def start(n: int = 1, **kwargs: Any) -> list[Upstream]:
        count = len(list(tmp_path.glob("upstream-*.log")))
        started = [Upstream(procs, tmp_path / f"upstream-{count + i}.log", **kwargs).start() for i in range(n)]
        return [upstream.ready() for upstream in started]
    return start


@pytest.fixture(scope="session")
def fast_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model requantized to Q5_0 (100 MB, 2 s), which neither llama.cpp's AMX kernels
    nor its weight repacking take: fast mode runs it on every CPU, so a test can watch a model stay
    in fast mode where fast mode crashes on the default model (AMX: Sapphire Rapids)."""
    made = tmp_path_factory.mktemp("fast-model") / "SmolLM2-135M-Instruct.Q5_0.gguf"
    subprocess.run([str(LLAMA_QUANTIZE), "--allow-requantize", str(paths.default_model_file()), str(made), "Q5_0"],
                   check=True, capture_output=True, timeout=300)
    return made


@pytest.fixture
def powercut(tmp_path: Path, procs: Processes) -> Iterator[Any]:
    """A power-cut file system (tests/powercut/): mount() it, run things in `.mnt`, cut() the power."""
    from tests.powercut import PowerCutMount, available

    if (why := available()) is not None:
        pytest.skip(why)
    mount = PowerCutMount(tmp_path / "power", procs)
    try:
        yield mount
    finally:
        procs.close()  # whatever still runs on the mount (an app), then the file system itself
        mount.unmount()
