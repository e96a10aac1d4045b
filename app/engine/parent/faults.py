"""Crashes injected on purpose, for tests only (a user never sets LMSP_ENGINE_FAULT)."""

from __future__ import annotations

import os
import re
import signal

from app.engine.parent.server import Server


def fault(point: str, server: Server, count: int = 0) -> None:
    """LMSP_ENGINE_FAULT=<scope>:<point>[:<signal>] kills the engine's llama-server by SIGSEGV (or
    the signal named, e.g. SIGABRT) at <point>, as llama.cpp's AMX kernels do on some CPUs:
    `warmup` (as it loads), `prompt` (a generation's request sent), `token<N>` (a generation's
    output `count` reached N tokens: again when a resumed task starts past it). <scope> `fast`
    kills it only in fast mode, `gpu` only with layers on a GPU (as a lost device or one out of
    memory ends it), `any` in every mode. Unset, this costs one dictionary lookup."""
    spec = os.environ.get("LMSP_ENGINE_FAULT")
    if not spec or server.pid is None:
        return
    scope, where, how = (spec.split(":") + ["SIGSEGV"])[:3]
    token = re.fullmatch(r"token(\d+)", where)
    hit = where == point or (point == "token" and token is not None and count >= int(token[1]))
    if hit and (scope == "any" or (scope == "fast" and not server.launch.safe)
                or (scope == "gpu" and server.launch.on_gpu)):
        os.kill(server.pid, signal.Signals[how])
