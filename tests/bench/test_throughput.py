"""Benchmarks (not in the default run): `make bench`. Each prints its figures and a ratio
against a baseline measured in the same run: here, a whole answer (nobody following the output)
through the service, against the same request sent straight to a bare llama-server
(tests/bench/bare.py: the binary and command line the engine runs)."""

from __future__ import annotations

import time
from pathlib import Path

from tests.bench.bare import Bare, bare
from tests.bench.figures import record
from tests.conftest import Headless, Processes

PROMPT = "Write a detailed essay about the history of lighthouses."
TOKENS = 256


def bare_tokens_per_second(peer: Bare) -> float:
    """Best of three: the request unstreamed, straight to the bare server."""
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        answer = peer.complete(PROMPT, TOKENS)
        tokens = answer["usage"]["completion_tokens"]
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def service_tokens_per_second(svc: Headless, background: bool) -> float:
    """Best of three: a background task, 202 to completed as its client's polling sees it, or a
    plain request (the answer when it is done, as `openai`'s create without stream waits)."""
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


def test_background_task_and_plain_request_throughput_vs_bare_llama_server(headless: Headless, procs: Processes,
                                                                            tmp_path: Path) -> None:
    peer = bare(procs, tmp_path / "bare.log", parallel=4)
    headless.start()
    headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 8})  # the model loaded
    rounds = [(bare_tokens_per_second(peer), service_tokens_per_second(headless, True),
               service_tokens_per_second(headless, False)) for _ in range(2)]  # interleaved
    theirs, background, plain = (max(r[i] for r in rounds) for i in range(3))
    record(f"{TOKENS}-token background task, 202 to completed (polled every 10 ms)", background, theirs, "tok/s")
    record(f"{TOKENS}-token plain request, unstreamed", plain, theirs, "tok/s")
