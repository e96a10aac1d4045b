"""The scripted engine (tests/scripted.py) keeps the promises of llama.cpp's that the tests on it
rely on: a resumed generation ends with the uninterrupted text, a stop sequence cuts the text
where the engine child cuts it, and a crash on demand kills its child and fails the generation
with `engine_crashed`, the next one starting a fresh child."""

from __future__ import annotations

from typing import Any

import pytest

from app.core.service import AppService
from app.engine.registry import models
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.engine.request import Request
from app.engine.runs import EngineError, Generation
from tests.scripted import Script

pytestmark = pytest.mark.scripted(pace=2000.0)
HI = Request([{"role": "user", "content": "Say hi"}])


async def run(service: AppService, gen: Generation) -> list[dict[str, Any]]:
    seat = service.pool.engines[0].seat()

    async def waiting(_: str) -> None:
        pass

    await seat.open(await service.store.read(models.usable, DEFAULT_MODEL_ID), gen, waiting)
    return [msg async for msg in seat.generate(gen)]


def text(messages: list[dict[str, Any]]) -> str:
    return "".join(m["text"] for m in messages if m["ev"] == "chunk")


async def test_a_resumed_generation_ends_with_the_uninterrupted_text(service: AppService) -> None:
    whole = await run(service, Generation(HI, max_tokens=20))
    assert text(whole) == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10," and whole[-1]["reason"] == "length"
    first = [m for m in whole if m["ev"] == "chunk"][:7]
    ids = [i for m in first for i in m["ids"]]
    rest = await run(service, Generation(HI, max_tokens=20, prefix_ids=ids, prefix_text=text(first)))
    assert text(first) + text(rest) == text(whole) and rest[-1]["output_tokens"] == 20


async def test_a_stop_sequence_cuts_the_text_before_it(service: AppService) -> None:
    stopped = await run(service, Generation(Request(HI.messages, stop=["5,", "zzz"]), max_tokens=40))
    assert text(stopped) == "1, 2, 3, 4, " and stopped[-1]["reason"] == "stop"
    assert [m for m in stopped if m["ev"] == "chunk"][-1]["last"] is True


async def test_a_crash_on_demand_kills_the_child_and_the_next_generation_gets_a_fresh_one(
        service: AppService, script: Script) -> None:
    await run(service, Generation(HI, max_tokens=2))
    engine = service.pool.engines[0]
    before = engine.pid
    script.crash_after = 5
    with pytest.raises(EngineError) as crashed:
        await run(service, Generation(HI, max_tokens=40))
    assert crashed.value.code == "engine_crashed" and not engine.alive
    script.crash_after = None
    assert text(await run(service, Generation(HI, max_tokens=3))) == "1, 2"
    assert engine.alive and engine.pid not in (None, before)
