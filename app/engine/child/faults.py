"""Crashes injected on purpose, for tests only (a user never sets LMSP_ENGINE_FAULT)."""

from __future__ import annotations

import os
import signal


def fault(point: str, extra_bufts: bool) -> None:
    """LMSP_ENGINE_FAULT=<scope>:<point>[:<signal>] makes the engine child die by SIGSEGV (or the
    signal named, e.g. SIGABRT) at <point>: `warmup`, `prompt`, `token<N>` (evaluating the N-th
    output token, for the next one; again when a resumed task decodes its output so far), as
    llama.cpp's AMX kernels do on some CPUs, or `grammar` (the request's grammar at work, as when
    llama.cpp throws from it). <scope> `fast` crashes only with extra buffer types on (fast mode),
    `any` in every mode. Unset, this costs one dictionary lookup."""
    spec = os.environ.get("LMSP_ENGINE_FAULT")
    if spec:
        scope, where, how = (spec.split(":") + ["SIGSEGV"])[:3]
        if where == point and (scope == "any" or (scope == "fast" and extra_bufts)):
            os.kill(os.getpid(), signal.Signals[how])
