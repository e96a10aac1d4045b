"""Decoding and reading a prompt beside another busy program (a build, a browser tab): they go
on at the speed one core gives, and give the same answer.

llama.cpp's threads wait for each other at every step of a token. Beside a busy program a thread
waits for a sibling that is not running: on two cores a llama-server on both fell to 0.7 tokens/s
beside one busy program while its threads spun. The engine runs on all cores but one, its threads
sleeping while they wait (app/engine/parent/pool.py, server.py), so one busy program leaves it its
core (tests/bench/test_cpu_load.py has the figures)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.conftest import Headless, Processes, busy_programs
from tests.helpers import COUNT

pytestmark = pytest.mark.alone  # it measures tokens/s beside a busy program: no other test may be one


def generate(svc: Headless) -> tuple[float, str]:
    """tokens/s and text of one 48-token task."""
    task = svc.complete({"input": COUNT, "temperature": 0, "max_output_tokens": 48}, timeout=240)
    response: dict[str, Any] = svc.get(f"/v1/responses/{task['response_id']}")[1]
    return float(task["progress"]["tokens_per_second"]), response["output_text"]


def test_decoding_beside_a_busy_program_keeps_the_speed_of_a_core_and_the_same_text(
        headless: Headless, procs: Processes) -> None:
    headless.start()
    generate(headless)  # the model loaded and warm
    idle, text = generate(headless)
    # Half the cores kept busy at the user's own priority: the engine's threads use them all.
    with busy_programs(procs, max(1, (os.cpu_count() or 2) // 2)):
        beside = [generate(headless) for _ in range(3)]
    # One thread of two makes about 0.6 of the idle speed here; decoding on both, beside the busy
    # program, made 0.36-0.44 of it with short spins and 0.02 with long ones. The first task may
    # pay for a token on both threads before the engine switches.
    best = max(speed for speed, _ in beside)
    assert best >= 0.5 * idle, f"{best:.1f} tokens/s beside busy programs, {idle:.1f} on an idle machine"
    # The thread count does not change what llama.cpp computes: the same greedy text.
    assert [answer for _, answer in beside] == [text] * 3


def story(n: int) -> str:
    """A prompt of about 700 tokens that differs from every other `n`'s from its first words on:
    no cache holds any of it after another one."""
    return f"Story {n}: " + " ".join(f"item {i} is {(i * 7 + n) % 13}" for i in range(95))


def prompt_seconds(svc: Headless, n: int) -> float:
    """Seconds a task spends on `story(n)`."""
    task = svc.complete({"input": story(n), "temperature": 0, "max_output_tokens": 1}, timeout=240)
    usage = svc.get(f"/v1/responses/{task['response_id']}")[1]["usage"]
    assert usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"] > 600, usage
    return float(task["finished_at"] - task["started_at"])


def test_a_long_prompt_beside_a_busy_program_is_read_at_the_speed_of_a_core(
        headless: Headless, procs: Processes) -> None:
    headless.start()
    # One task at a time: with several (`parallel` 4) a prompt is read in 256-token batches and the
    # switch to one thread comes later; measured 6.6 s beside busy programs against 2.4 s idle there
    # (over this bound of 2.5 x), an open point of issue 38.
    assert headless.request("PATCH", "/v1/settings", {"parallel": 1})[0] == 200
    prompt_seconds(headless, 0)  # the model loaded and warm
    idle = min(prompt_seconds(headless, n) for n in (1, 2))
    with busy_programs(procs, max(1, (os.cpu_count() or 2) // 2)):
        beside = [prompt_seconds(headless, n) for n in (3, 4, 5)]
    # Two threads read the prompt in 2.8 s here idle, one in 5 (1.8 x); both, beside the busy
    # program, took 18-32 s (7-11 x). The first prompt may pay for slices on both threads before
    # the engine switches, and a later one for a trial of both on its last token.
    best = min(beside)
    assert best <= 2.5 * idle, f"{best:.1f} s beside busy programs, {idle:.1f} s on an idle machine"
