"""Benchmarks (not in the default run): `make bench`. Each prints its figures and a ratio
against a baseline measured in the same run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import cache
from typing import Any

from app import paths
from tests.conftest import ROOT, Headless

PROMPT = "Write a detailed essay about the history of lighthouses."
TOKENS = 256


@cache
def fast_works() -> bool:
    """Whether llama.cpp's fast CPU paths decode on this CPU at all (on some, e.g. with Intel
    AMX, they crash: LMSP §11). Tried in a child process: a crash would end the benchmark."""
    probe = "from tests.bench.test_throughput import bare_llama; bare_llama(fast=True)"
    return subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, timeout=300).returncode == 0


def bare_llama(fast: bool | None = None, threads: int | None = None) -> Any:
    """Plain llama-cpp-python: same model, context and threads as the service's engine, warm.
    `fast=False`: as in the engine's safe mode (no extra buffer types); by default the mode the
    service's engine ends up in on this CPU (`auto`: fast unless it crashes), so that a
    baseline compares like with like. `threads`: by default, as many as the engine uses alone."""
    from llama_cpp import Llama

    if fast is None:
        fast = fast_works()

    from app.engine.child import backend
    from app.engine.child.main import extra_bufts

    backend.load()
    with extra_bufts(fast):
        llm = Llama(model_path=str(paths.default_model_file()), n_ctx=4096, n_threads=threads or os.cpu_count(),
                    verbose=False)
    llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    return llm


def bare_tokens_per_second(fast: bool | None = None) -> float:
    """Plain llama-cpp-python, same model, prompt, context and threads as the service's engine."""
    llm = bare_llama(fast)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        out = llm.create_chat_completion([{"role": "user", "content": PROMPT}], max_tokens=TOKENS, temperature=0)
        best = max(best, out["usage"]["completion_tokens"] / (time.perf_counter() - start))
    return best


def service_tokens_per_second(svc: Headless, background: bool) -> float:
    """Best of three: a background task, 202 to completed as its client's polling sees it, or a
    plain request (the answer when it is done, as `openai`'s create without stream waits)."""
    svc.post("/v1/responses", {"input": "hi", "max_output_tokens": 8})  # load the model first
    body = {"input": PROMPT, "temperature": 0, "max_output_tokens": TOKENS}
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        if background:
            tokens = svc.complete(body, interval=0.01)["progress"]["output_tokens"]
        else:
            status, answer = svc.post("/v1/responses", body)
            assert status == 200, answer
            tokens = answer["usage"]["output_tokens"]
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def test_background_task_and_plain_request_throughput_vs_bare_llama_cpp(headless: Headless) -> None:
    headless.start()
    rounds = [(bare_tokens_per_second(), service_tokens_per_second(headless, True),
               service_tokens_per_second(headless, False)) for _ in range(2)]  # interleaved
    bare, background, plain = (max(r[i] for r in rounds) for i in range(3))
    print(f"\n[bench] bare llama-cpp-python: {bare:.1f} tokens/s; through the service, nobody following the "
          f"output: background task (202 to completed, seen by the client polling every 10 ms) {background:.1f} "
          f"tokens/s, ratio {background / bare:.3f}; plain request {plain:.1f} tokens/s, ratio {plain / bare:.3f}")
