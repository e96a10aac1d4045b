"""The benches' peer and their thread counts.

The peer is a bare `llama-server`: the very binary the app's engine runs (app.paths.llama_server,
LMSP_LLAMA_SERVER as `make bench` sets it), started with the command line the engine builds
(app.engine.parent.server.arguments: each slot the model's context, `--parallel N`, the threads,
`--poll 0`, the prompt cache, the batch sizes, fast or safe mode), the same OpenMP spin count and
the same lower priority, but on TCP loopback and with nothing in front of it: requests go to it
straight. Whatever the service adds (HTTP, SQLite, the scheduler, its own socket to the engine) is
what its figures show beside the peer's.

Threads: the engine's come from the pool (the cores shared by `max_concurrent_tasks` engines).
A bench that compares at another count runs the app as `python -m tests.bench.threads_app <n>`,
whose engines all take `n` (the composition root's engine factory, as tests/scripted_app.py swaps
engines), so that both sides run llama.cpp on as many threads.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from app import paths
from app.engine.parent import server
from app.engine.registry import gguf
from app.engine.registry.models import context_length
from tests.conftest import ROOT, Processes, Upstream

ALIAS = "smollm2"
CORES = os.cpu_count() or 1
# The two thread counts the speed bounds name: a core left to the service and to the clients, and every core.
SPARE, ALL = max(1, CORES - 1), CORES


def binary() -> Path:
    found = paths.llama_server()
    if found is None or not found.is_file():
        pytest.skip("no llama-server: `make llama-server` builds it (LMSP_LLAMA_SERVER says where)")
    return found


def threads_app(threads: int) -> list[str]:
    """What runs the app with every engine on `threads` llama.cpp threads."""
    return [sys.executable, "-m", "tests.bench.threads_app", str(threads)]


@functools.cache
def fast_works() -> bool:
    """Whether llama.cpp's fast paths (weight repacking) load and decode on this CPU: on some (Intel
    AMX) they crash, and the app's engine (`auto`) then runs the model in safe mode (`--no-repack`)."""
    procs = Processes()
    try:
        probe = Bare(procs, Path(os.devnull), parallel=1, threads=1, safe=False).start()
        try:
            probe.ready()
            probe.complete("hi", 2)
        except (AssertionError, TimeoutError, OSError):
            return False
        return True
    finally:
        procs.close()


class Bare(Upstream):
    """A bare llama-server as the engine would start it for `parallel` slots on `threads` threads,
    in the mode the engine ends up in on this CPU (or `safe` as given); with `pooling`, as its
    embeddings server (0: the model names none, the mean is taken)."""

    def __init__(self, procs: Processes, log: Path, parallel: int, threads: int, safe: bool | None = None,
                 pooling: int | None = None) -> None:
        program = binary()
        super().__init__(procs, log, kind="llama-server", alias=ALIAS, server=program)
        model = paths.default_model_file()
        assert model is not None
        n_ctx = context_length(gguf.inspect(str(model)).context_length)
        safe = not fast_works() if safe is None else safe
        self.launch = server.Launch(str(model), ALIAS, n_ctx, parallel, threads, safe, pooling)
        args = server.arguments(str(program), self.launch, "@")
        at = args.index("--host")  # the engine's `--host <its Unix socket> --port 0`: a loopback port here
        args[at:at + 4] = ["--host", "127.0.0.1", "--port", str(self.port)]
        self.command = args

    def start(self) -> Bare:
        env = {**os.environ, "OMP_WAIT_POLICY": server.WAIT_POLICY}  # as the engine waits
        with self.log.open("ab") as log:
            self.proc = self.procs.popen(self.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=lambda: os.nice(server.NICENESS))
        return self

    def complete(self, prompt: str, tokens: int) -> dict[str, Any]:
        """One unstreamed chat completion, greedy: its answer."""
        body = {"model": ALIAS, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                "temperature": 0}
        req = urllib.request.Request(self.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer: dict[str, Any] = json.load(resp)
            return answer


def bare(procs: Processes, log: Path, parallel: int, threads: int = SPARE, safe: bool | None = None) -> Bare:
    """A started, ready, warm bare llama-server."""
    peer = Bare(procs, log, parallel, threads, safe).start()
    peer.ready(timeout=120)
    peer.complete("hi", 4)
    return peer
