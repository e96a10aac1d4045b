"""Benchmark (not in the default run): decoding while another program keeps a core busy.

A person's computer is rarely idle: a browser tab, a build, a video call. Decoding through the
service must keep the share of the CPU that a bare llama-server (tests/bench/bare.py: the binary
and command line the engine runs) gets beside the same busy program, and the service must still
answer at once while it decodes (request -> 202). Every ratio is against the bare server in the
same run, under the same load."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from tests.bench.bare import Bare, bare
from tests.bench.figures import record
from tests.bench.test_streaming import Stream, accept, direct_stream, ms, pct, service_stream
from tests.conftest import Headless, Processes, busy_programs, wait_until
from tests.helpers import COUNT
from tests.test_busy_machine import story

ROUNDS = 3
BUSY_TOKENS = 48


def decode(runs: list[Stream]) -> float:
    return statistics.median(run.decode for run in runs)


def prompt_seconds(svc: Headless, peer: Bare, n: int) -> tuple[float, float]:
    """Seconds to the answer of a 1-token request for `story(n)` (about 700 tokens, none cached):
    straight to the bare server, and through the service."""
    start = time.perf_counter()
    peer.complete(story(n), 1)
    bare_took = time.perf_counter() - start
    start = time.perf_counter()
    status, answer = svc.post("/v1/responses", {"input": story(n), "temperature": 0, "max_output_tokens": 1})
    assert status == 200, answer
    return bare_took, time.perf_counter() - start


@pytest.mark.timeout(900)
def test_decoding_beside_a_busy_program(headless: Headless, procs: Processes, tmp_path: Path) -> None:
    peer = bare(procs, tmp_path / "bare.log", parallel=4)
    headless.start()
    # 200 background requests from one client in a row: past the default per-client limit.
    assert headless.request("PATCH", "/v1/settings", {"max_queued_tasks_per_client": 1000})[0] == 200
    headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 4})  # the model loaded
    idle = ([direct_stream(peer) for _ in range(ROUNDS)], [service_stream(headless) for _ in range(ROUNDS)])
    idle_prompts = [prompt_seconds(headless, peer, n) for n in range(ROUNDS)]
    with busy_programs(procs, 1):
        time.sleep(0.5)
        bared, served, prompts = [], [], []
        for n in range(ROUNDS):  # interleaved: both see the same machine
            bared.append(direct_stream(peer, BUSY_TOKENS))
            served.append(service_stream(headless, BUSY_TOKENS))
            prompts.append(prompt_seconds(headless, peer, ROUNDS + n))
    record(f"decode, idle machine, median of {ROUNDS}", decode(idle[1]), decode(idle[0]), "tok/s")
    record(f"decode, one core kept busy, median of {ROUNDS}", decode(served), decode(bared), "tok/s")
    for name, runs in (("idle machine", idle_prompts), ("one core kept busy", prompts)):
        theirs, ours = (statistics.median(side) for side in zip(*runs))
        record(f"a 700-token prompt, {name}, median of {ROUNDS}", ours * 1000, theirs * 1000, "ms")

    status, long = headless.post("/v1/responses", {"input": COUNT, "background": True, "temperature": 0,
                                                   "max_output_tokens": 2000})
    assert status == 202
    task_id = long["task"]["id"]
    wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] > 20, interval=0.05)
    took = [accept(headless) for _ in range(200)]
    assert headless.get(f"/v1/tasks/{task_id}")[1]["status"] == "running", "the requests must overlap decoding"
    print(f"[bench] request -> 202 while a task decodes, one client (200 requests): p50 {ms(pct(took, 0.5))}, "
          f"p99 {ms(pct(took, 0.99))}")
