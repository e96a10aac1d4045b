"""Cancels at random moments against generation (scripted, tests/scripted.py; llama.cpp's own
child where the test is about it): a task whose cancel was accepted never ends `completed`, and
one that completed refuses the cancel with 409."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from app.core.service import AppService
from app.core.tasks import TERMINAL_EVENTS
from app.engine.registry import models
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.engine.request import Request
from app.engine.runs import Generation
from app.errors import Conflict
from app.tasks.states import TERMINAL
from tests.helpers import poll

pytestmark = pytest.mark.scripted


async def test_cancel_and_completion_never_both_win(service: AppService) -> None:
    owner = await service.access.authenticate(await service.access.owner_token())
    assert owner is not None
    rng = random.Random(11)
    created = [(await service.responses.create_response(owner, {
        "input": f"Count to {n}.", "background": True, "temperature": 0, "max_output_tokens": rng.randrange(2, 30)
    })).body for n in range(40)]
    outcomes: dict[str, str] = {}

    async def cancel_later(task_id: str) -> None:
        # A random moment in the task's own life: while queued, while it generates (where the
        # race with completion is), or after it ended. Tied to its progress, not the clock, so a
        # slow machine still hits every moment.
        moment = rng.choice(["queued", "running", "running", "ended"])
        if moment == "running":
            with service.tasks.feed(task_id, watch=False) as feed:
                while (await feed.queue.get())["type"] not in ("response.in_progress", *TERMINAL_EVENTS):
                    pass
            await asyncio.sleep(rng.uniform(0, 0.3))
        elif moment == "ended":
            await service.tasks.wait(task_id)
        try:
            await service.tasks.cancel(owner, "task", task_id)
            outcomes[task_id] = "accepted"
        except Conflict:
            outcomes[task_id] = "refused"

    await asyncio.gather(*(cancel_later(r["task"]["id"]) for r in created))
    for r in created:
        await asyncio.wait_for(service.tasks.wait(r["task"]["id"]), 60)

    seen = set()
    for r in created:
        task_id = r["task"]["id"]
        task = await service.tasks.task(owner, task_id)
        assert task["status"] in TERMINAL
        expected = "cancelled" if outcomes[task_id] == "accepted" else "completed"
        assert task["status"] == expected, (outcomes[task_id], task["status"])
        events = await service.tasks.events(owner, task_id, -1)
        terminal = [e["type"] for e in events if e["type"] in TERMINAL_EVENTS]
        assert len(terminal) == 1
        assert (terminal[0] == "response.cancelled") == (expected == "cancelled")
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        seen.add(outcomes[task_id])
    assert seen == {"accepted", "refused"}, "the random moments should hit both sides of the race"


async def test_a_request_given_up_while_its_task_is_written_still_runs_that_task(service: AppService) -> None:
    """A task arriving at a free engine is taken by the scheduler in the commit that creates it. A
    request cancelled while that commit is on its way (its client gone) still starts what it
    committed: the task runs to its end instead of staying `loading` for good."""
    owner = await service.access.authenticate(await service.access.owner_token())
    assert owner is not None
    write = service.store.write

    async def leaving_once_written(fn: Any, *args: Any) -> Any:
        """The client leaves as the commit is handed to the writer (the request is read first,
        off the loop, so no fixed number of loop turns gets there)."""
        call.cancel()
        return await write(fn, *args)

    service.store.write = leaving_once_written  # type: ignore[method-assign]
    call = asyncio.create_task(service.responses.create_response(owner, {
        "input": "Say hi", "background": True, "temperature": 0, "max_output_tokens": 4}))
    try:
        await call
    except asyncio.CancelledError:
        pass
    service.store.write = write  # type: ignore[method-assign]
    rows = await poll(lambda: service.store.read(lambda c: c.execute("SELECT id FROM tasks").fetchall()),
                      timeout=10, what="the task to be committed")
    assert len(rows) == 1
    task_id = rows[0]["id"]
    final = await asyncio.wait_for(service.tasks.wait(task_id), 60)
    assert final["status"] == "completed", final
    types = [e["type"] for e in await service.tasks.events(owner, task_id, -1)]
    assert types[:4] == ["response.created", "response.queued", "response.loading", "response.loading"], types


@pytest.mark.llama
async def test_a_cancel_before_the_engine_child_has_the_job_ends_the_generation_without_output(
        service: AppService) -> None:
    """A cancel can reach the engine after the task's model is loaded but before the child was
    asked to generate (the generation's write to `running` found a cancel; a reload in between). The
    generation then ends `cancelled` at once, and the engine's next task runs normally."""
    engine = service.pool.engines[0]
    model = await service.store.read(models.usable, DEFAULT_MODEL_ID)
    gen = Generation(Request([{"role": "user", "content": "Say hi"}], temperature=0), max_tokens=8)

    async def waiting(_: str) -> None:
        pass

    seat = engine.seat()
    await seat.open(model, gen, waiting)
    seat.cancel()
    stopped = [msg async for msg in seat.generate(gen)]
    assert [(m["ev"], m.get("reason")) for m in stopped] == [("done", "cancelled")], stopped
    seat = engine.seat()
    await seat.open(model, gen, waiting)
    ran = [msg async for msg in seat.generate(gen)]
    assert any(m["ev"] == "chunk" and m["text"] for m in ran) and ran[-1]["reason"] in ("length", "stop"), ran
