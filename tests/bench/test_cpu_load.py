"""Benchmark (not in the default run): decoding while another program keeps a core busy.

A person's computer is rarely idle: a browser tab, a build, a video call. Decoding through the
service must keep the share of the CPU that plain llama-cpp-python gets beside the same busy
program, and the service must still answer at once while it decodes (request -> 202).
Every ratio is against bare llama-cpp-python in the same run, under the same load."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from tests.bench.test_streaming import accept, bare_stream, ms, pct, service_stream
from tests.bench.test_throughput import bare_llama
from tests.conftest import Headless, Processes, busy_programs, wait_until
from tests.helpers import COUNT
from tests.test_busy_machine import prompt_seconds, story

ROUNDS = 3
BUSY_TOKENS = 24  # plain llama-cpp-python may decode one token in two seconds beside the busy program


def decode(runs: list[Any]) -> float:
    return statistics.median(run.decode for run in runs)


def bare_prompt_seconds(llm: Any, n: int) -> float:
    start = time.perf_counter()
    llm.create_chat_completion([{"role": "user", "content": story(n)}], max_tokens=1, temperature=0)
    return time.perf_counter() - start


@pytest.mark.timeout(900)
def test_decoding_beside_a_busy_program(headless: Headless, procs: Processes) -> None:
    llm = bare_llama()
    headless.start()
    # 200 background requests from one client in a row: past the default per-client limit.
    assert headless.request("PATCH", "/v1/settings", {"max_queued_tasks_per_client": 1000})[0] == 200
    headless.post("/v1/responses", {"input": "hi", "max_output_tokens": 4})  # the model loaded
    idle = ([bare_stream(llm) for _ in range(ROUNDS)], [service_stream(headless) for _ in range(ROUNDS)])
    idle_prompts = [(bare_prompt_seconds(llm, n), prompt_seconds(headless, n)) for n in range(ROUNDS)]
    with busy_programs(procs, 1):
        time.sleep(0.5)
        bare, served, prompts = [], [], []
        for n in range(ROUNDS):  # interleaved: both see the same machine
            bare.append(bare_stream(llm, BUSY_TOKENS))
            served.append(service_stream(headless, BUSY_TOKENS))
            prompts.append((bare_prompt_seconds(llm, ROUNDS + n), prompt_seconds(headless, ROUNDS + n)))
    print(f"\n[bench] decode, tokens/s (bare llama-cpp-python | through the service), median of {ROUNDS}:"
          f"\n  idle machine            {decode(idle[0]):.1f} | {decode(idle[1]):.1f}  "
          f"(ratio {decode(idle[1]) / decode(idle[0]):.3f})"
          f"\n  one core kept busy      {decode(bare):.1f} | {decode(served):.1f}  "
          f"(ratio {decode(served) / decode(bare):.3f}; the service keeps "
          f"{decode(served) / decode(idle[1]):.2f} of its idle speed, bare {decode(bare) / decode(idle[0]):.2f})")
    print(f"[bench] a 700-token prompt, seconds (bare llama-cpp-python | through the service), median of {ROUNDS}:")
    for name, runs in (("idle machine", idle_prompts), ("one core kept busy", prompts)):
        one, other = (statistics.median(side) for side in zip(*runs))
        print(f"  {name:<22}  {one:.2f} | {other:.2f}  (ratio {other / one:.3f})")

    status, long = headless.post("/v1/responses", {"input": COUNT, "background": True, "temperature": 0,
                                                   "max_output_tokens": 2000})
    assert status == 202
    task_id = long["task"]["id"]
    wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] > 20, interval=0.05)
    took = [accept(headless) for _ in range(200)]
    assert headless.get(f"/v1/tasks/{task_id}")[1]["status"] == "running", "the requests must overlap decoding"
    print(f"[bench] request -> 202 while a task decodes, one client (200 requests): p50 {ms(pct(took, 0.5))}, "
          f"p99 {ms(pct(took, 0.99))}")
