"""Several tasks at once on one loaded model (`parallel`, default 4): real llama.cpp and the
default model, its tasks decoded together in one context. Each task's stream stays its own:
gap-free, its deltas exactly its text; a cancel or an engine death touches each task alone."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from app.engine.registry.models import DEFAULT_MODEL_ID
from tests.helpers import COUNT, pair, poll, raw, wait_status
from tests.test_api import check_sequence, deltas, events, task
from tests.test_metrics import metrics, value

# Distinct prompts that share their beginning, as apps send them.
LONG = {"max_output_tokens": 96, "temperature": 0, "background": True}


async def start(api: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    resp, text = await raw(api, "POST", "/v1/responses", headers=headers or dict(api.session.headers), json=body)
    assert resp.status == 202, text
    return str(json.loads(text)["task"]["id"])


async def generating_together(api: Any, ids: list[str], tokens: int = 4) -> list[dict[str, Any]]:
    """The tasks once all of them are running and have written `tokens`, none of them ended."""
    async def check() -> list[dict[str, Any]] | None:
        now = [await task(api, i) for i in ids]
        assert all(t["status"] in ("queued", "loading", "running") for t in now), now
        return now if all(t["status"] == "running" and t["progress"]["output_tokens"] >= tokens for t in now) else None
    return list(await poll(check, timeout=120, what="the tasks to generate together"))


async def exact(api: Any, task_id: str) -> dict[str, Any]:
    """The ended task's response, after checking its stream: gap-free, its deltas its text."""
    final = await wait_status(api, task_id, timeout=180)
    evs = await events(api, task_id)
    check_sequence(evs)
    resp = await api.get(f"/v1/responses/{final['response_id']}")
    response = await resp.json()
    # A retried task's text is its last attempt's.
    assert deltas([e for e in evs if e["attempt"] == final["attempt"]]) == response["output_text"], task_id
    return {**final, "response": response, "events": evs}


@pytest.mark.llama
async def test_tasks_of_one_model_run_together_and_each_stream_stays_exact(api: Any, service: Any) -> None:
    assert service.settings["parallel"] == 4
    ids = [await start(api, {**LONG, "input": f"{COUNT} ({word})"}) for word in ("red", "green", "blue")]
    await generating_together(api, ids)
    assert service.pool.slots() == {service.pool.engines[0].model_path: (3, 4)}
    for task_id in ids:
        done = await exact(api, task_id)
        assert done["status"] == "completed" and done["response"]["status"] == "incomplete", done
        assert done["response"]["usage"]["output_tokens"] == 96, done["response"]["usage"]


@pytest.mark.llama
async def test_a_cancel_stops_one_task_and_the_others_carry_on(api: Any) -> None:
    first, second = [await start(api, {**LONG, "input": f"{COUNT} ({n})"}) for n in (1, 2)]
    await generating_together(api, [first, second])
    resp = await api.post(f"/v1/tasks/{first}/cancel")
    assert resp.status == 200, await resp.text()
    cancelled = await exact(api, first)
    assert cancelled["status"] == "cancelled" and cancelled["response"]["usage"]["output_tokens"] < 96
    carried_on = await exact(api, second)
    assert carried_on["response"]["status"] == "incomplete" and carried_on["response"]["usage"]["output_tokens"] == 96


@pytest.mark.llama
async def test_an_engine_death_moves_each_of_its_tasks_by_its_own_on_restart(api: Any, service: Any) -> None:
    policies = ("fail", "retry", "resume")
    ids = [await start(api, {**LONG, "input": f"{COUNT} ({p})", "on_restart": p}) for p in policies]
    await generating_together(api, ids, tokens=8)
    committed = deltas(await events(api, ids[2]))  # the resumed task's text so far: kept, word for word
    assert committed
    pid = service.pool.engines[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)

    failed, retried, resumed = [await exact(api, task_id) for task_id in ids]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_crashed", failed
    assert retried["response"]["status"] == "incomplete" and retried["attempt"] == 2, retried
    assert any(e.get("output_reset") for e in retried["events"] if e["type"] == "response.queued")
    assert resumed["response"]["status"] == "incomplete" and resumed["attempt"] == 1, resumed
    assert resumed["response"]["output_text"].startswith(committed)
    assert resumed["response"]["usage"]["output_tokens"] == 96


@pytest.mark.scripted(pace=40.0)
async def test_slots_go_round_robin_between_apps(api: Any, service: Any) -> None:
    """One app's queue does not take every slot: another app's single task gets the next one."""
    assert (await api.patch("/v1/settings", json={"parallel": 2})).status == 200
    _, busy_token = await pair(api, ["responses:write", "tasks:read"], name="Busy App")
    _, other_token = await pair(api, ["responses:write", "tasks:read"], name="Other App")
    service.tasks.set_paused(True)
    body = {"input": "count", "max_output_tokens": 20, "background": True}
    busy = [await start(api, body, {"Authorization": f"Bearer {busy_token}"}) for _ in range(6)]
    other = await start(api, body, {"Authorization": f"Bearer {other_token}"})
    service.tasks.set_paused(False)
    await wait_status(api, other, timeout=60)
    started = {i: (await task(api, i))["started_at"] or float("inf") for i in [*busy, other]}
    # Two slots: the busy app's first task, then the other app's, before the busy app's second.
    order = sorted(started, key=lambda i: started[i])
    assert order.index(other) <= 1, [(i == other, started[i]) for i in order]


@pytest.mark.llama
async def test_a_task_that_gives_its_slot_away_keeps_its_text_word_for_word(api: Any) -> None:
    """On llama.cpp: one app's four tasks fill the slots; another app's request is answered while
    all four still run, and the task that gave way continues from its committed text."""
    apps = {}
    for name in ("Writer", "Editor"):
        _, token = await pair(api, ["responses:write", "tasks:read"], name=name)
        apps[name] = {"Authorization": f"Bearer {token}"}
    writer = [await start(api, {**LONG, "input": f"{COUNT} ({n})"}, apps["Writer"]) for n in range(4)]
    await generating_together(api, writer, tokens=8)
    resp, text = await raw(api, "POST", "/v1/responses", headers=apps["Editor"],
                           json={"input": "Hi", "max_output_tokens": 3})
    assert resp.status == 200 and json.loads(text)["usage"]["output_tokens"] == 3, text
    assert [(await task(api, i))["status"] for i in writer].count("completed") == 0

    gave_way = []
    for task_id in writer:
        done = await exact(api, task_id)
        assert done["response"]["status"] == "incomplete" and done["attempt"] == 1, done
        assert done["response"]["usage"]["output_tokens"] == 96
        assert [e["type"] for e in done["events"]].count("response.output_item.added") == 1
        for event in (e for e in done["events"] if e.get("preempted")):
            committed = event["response"]["output_text"]  # what it had written when it gave way
            assert committed and done["response"]["output_text"].startswith(committed)
            gave_way.append(task_id)
    assert len(gave_way) == 1, gave_way


@pytest.mark.scripted(pace=20.0)
async def test_each_task_shows_its_slot_or_its_place_in_the_queue(api: Any, service: Any) -> None:
    assert (await api.patch("/v1/settings", json={"parallel": 2})).status == 200
    apps = {}
    for name in ("Notes", "Editor"):
        _, token = await pair(api, ["responses:write", "tasks:read"], name=name)
        apps[name] = {"Authorization": f"Bearer {token}"}
    service.tasks.set_paused(True)
    body = {"input": "count", "max_output_tokens": 400, "background": True}
    notes = [await start(api, body, apps["Notes"]) for _ in range(3)]
    editor = [await start(api, body, apps["Editor"]) for _ in range(2)]
    queued = sorted([await task(api, i) for i in notes + editor], key=lambda t: t["queue_position"])
    assert [t["queue_position"] for t in queued] == [1, 2, 3, 4, 5] and all(t["slot"] is None for t in queued)
    assert {t["waiting_for"] for t in queued} == {"paused"}  # what each waits for (issue 40)
    owners = ["notes" if t["id"] in notes else "editor" for t in queued]
    assert owners in (["notes", "editor"] * 2 + ["notes"], ["editor", "notes"] * 2 + ["notes"]), owners  # in turns

    service.tasks.set_paused(False)
    running = await poll(lambda: _running(api, [t["id"] for t in queued]), what="two tasks running")
    assert sorted(t["slot"]["index"] for t in running) == [0, 1] and {t["slot"]["of"] for t in running} == {2}
    assert {t["id"] for t in running} == {t["id"] for t in queued[:2]}
    waiting = [await task(api, t["id"]) for t in queued[2:]]
    assert [t["queue_position"] for t in waiting] == [1, 2, 3] and all(t["slot"] is None for t in waiting)
    assert {t["waiting_for"] for t in waiting} == {"slot"} and {t["waiting_for"] for t in running} == {None}
    samples = await metrics(api)
    assert value(samples, "lmsp_slots_busy", model=DEFAULT_MODEL_ID) == 2
    assert value(samples, "lmsp_slots_total", model=DEFAULT_MODEL_ID) == 2
    listed = {t["id"]: t for t in (await (await api.get("/v1/tasks?limit=10")).json())["data"]}
    assert listed[queued[2]["id"]]["queue_position"] == 1 and listed[queued[0]["id"]]["slot"] is not None


@pytest.mark.scripted(pace=40.0)
async def test_one_app_fills_every_slot_until_another_apps_task_comes(api: Any, service: Any, script: Any) -> None:
    """The red team's P7: one app's four long tasks held every slot, and another app's 3-token task
    waited 19 s for one of them to end. Alone, an app still fills every slot; once another app's
    task comes, the first app's task with the least output goes back to the queue, its output kept
    word for word, and continues when a slot frees: each text is that of an uninterrupted run."""
    apps = {}
    for name in ("Writer", "Editor"):
        _, token = await pair(api, ["responses:write", "tasks:read"], name=name)
        apps[name] = {"Authorization": f"Bearer {token}"}
    writer = [await start(api, {"input": "count", "max_output_tokens": 400, "background": True}, apps["Writer"])
              for _ in range(4)]
    await generating_together(api, writer)
    path = service.pool.engines[0].model_path
    assert service.pool.slots() == {path: (4, 4)}  # alone, it holds every slot

    began = time.monotonic()
    resp, text = await raw(api, "POST", "/v1/responses", headers=apps["Editor"],
                           json={"input": "Hi", "max_output_tokens": 3})
    answered = time.monotonic() - began
    assert resp.status == 200 and json.loads(text)["usage"]["output_tokens"] == 3, text
    assert answered < 2.0, f"the other app's 3-token task was answered after {answered:.1f} s"
    # The task that gave way took the slot back in the commit that ended the other app's.
    await poll(lambda: service.pool.slots() == {path: (4, 4)}, what="the writer's four tasks to run again")

    # While another app's task runs, the listing says where each task stands.
    editor = await start(api, {"input": "Hi", "max_output_tokens": 200, "background": True}, apps["Editor"])
    await wait_status(api, editor, {"running"})
    listed = {t["id"]: t for t in (await (await api.get("/v1/tasks?limit=10")).json())["data"]}
    waiting = [listed[i] for i in writer if listed[i]["status"] == "queued"]
    assert len(waiting) == 1, [(listed[i]["status"], listed[i]["slot"]) for i in writer]
    assert waiting[0]["queue_position"] == 1 and waiting[0]["slot"] is None and waiting[0]["waiting_for"] == "slot"
    assert waiting[0]["progress"]["output_tokens"] > 0 and waiting[0]["started_at"] is not None
    running = [listed[i] for i in [*writer, editor] if listed[i]["status"] == "running"]
    assert sorted(t["slot"]["index"] for t in running) == [0, 1, 2, 3]
    assert all(t["queue_position"] is None for t in running)

    whole = "".join(script.token(k) for k in range(400))  # the uninterrupted run's text
    gave_way = 0
    for task_id in writer:
        done = await exact(api, task_id)
        assert done["response"]["status"] == "incomplete" and done["response"]["output_text"] == whole, done["id"]
        assert done["response"]["usage"]["output_tokens"] == 400 and done["attempt"] == 1
        kinds = [e["type"] for e in done["events"]]
        assert kinds.count("response.output_item.added") == 1 and kinds.count("response.content_part.added") == 1
        queued = [e for e in done["events"] if e["type"] == "response.queued" and e.get("preempted")]
        gave_way += len(queued)
        assert all(e["response"]["status"] == "queued" and e["response"]["output_text"] for e in queued)
    assert gave_way == 2, gave_way  # once for each of the other app's tasks
    assert (await exact(api, editor))["response"]["usage"]["output_tokens"] == 200


async def _running(api: Any, ids: list[str]) -> list[dict[str, Any]] | None:
    now = [await task(api, i) for i in ids]
    running = [t for t in now if t["status"] == "running"]
    return running if len(running) == 2 else None
