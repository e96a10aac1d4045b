"""Group commit: writes that arrive together share one commit (one fsync), each keeps its own
result or exception, and a 202 is answered only once its task is committed."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest

from app.store import config
from app.store.store import Store
from app.tasks.kinds.generation_job import EngineRoom
from app.tasks.scheduler import Offer, claim
from tests.test_api import check_sequence, events, start_background, task, wait_status
from tests.test_metrics import metrics, value

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines


def _put(conn: sqlite3.Connection, key: str) -> str:
    config.save(conn, {key: 1})
    return key


async def _keys(store: Store) -> set[str]:
    return await store.read(lambda c: {r["key"] for r in c.execute("SELECT key FROM service_config")})


async def test_writes_arriving_together_share_commits_and_a_failing_one_fails_alone(store: Store) -> None:
    def half_then_fail(conn: sqlite3.Connection) -> None:
        config.save(conn, {"failed": 1})
        raise ValueError("this one only")

    commits = store.commits
    results = await asyncio.gather(*(store.write(_put, f"a{i}") for i in range(10)), store.write(half_then_fail),
                                   *(store.write(_put, f"b{i}") for i in range(10)), return_exceptions=True)

    assert results[:10] == [f"a{i}" for i in range(10)] and results[11:] == [f"b{i}" for i in range(10)]
    assert isinstance(results[10], ValueError) and str(results[10]) == "this one only"
    assert await _keys(store) == {f"a{i}" for i in range(10)} | {f"b{i}" for i in range(10)}
    assert store.commits - commits <= 3, "21 writes queued together must not cost 21 fsyncs"
    assert store.transactions >= 20


async def test_an_error_that_undoes_the_whole_transaction_takes_no_other_write_with_it(store: Store) -> None:
    def undone(conn: sqlite3.Connection) -> None:
        config.save(conn, {"undone": 1})
        conn.execute("ROLLBACK")  # what SQLite itself does on some I/O and disk-full errors
        raise OSError("the transaction is gone")

    results = await asyncio.gather(*(store.write(_put, f"k{i}") for i in range(5)), store.write(undone),
                                   *(store.write(_put, f"m{i}") for i in range(5)), return_exceptions=True)

    assert isinstance(results[5], OSError)
    assert await _keys(store) == {f"k{i}" for i in range(5)} | {f"m{i}" for i in range(5)}
    assert await store.write(_put, "after") == "after"  # the writer carries on


@pytest.mark.alone  # how many commits coalesce depends on the pace of the writer's turns
async def test_twenty_clients_at_once_cost_few_fsyncs(api: Any, service: Any) -> None:
    service.tasks.set_paused(True)  # only the 202s write: nothing runs
    before = await metrics(api)

    async def accept() -> int:
        resp = await api.post("/v1/responses", json={"input": "hi", "background": True, "max_output_tokens": 1})
        return resp.status

    statuses = await asyncio.gather(*(accept() for _ in range(20)))
    after = await metrics(api)

    assert statuses == [202] * 20
    assert value(after, "lmsp_tasks", state="queued") == 20  # every acknowledged task is committed
    commits = value(after, "lmsp_store_commits_total") - value(before, "lmsp_store_commits_total")
    writes = value(after, "lmsp_store_transactions_total") - value(before, "lmsp_store_transactions_total")
    assert writes >= 20 and commits < 20 * 0.5, (commits, writes)


async def test_a_request_to_a_loaded_model_is_started_by_the_commit_that_creates_it(api: Any, service: Any) -> None:
    """Its engine holds its model: nothing to wait for between the create and `running`, so no
    commit of its own. A 1-token request then costs two commits: its create, and its end (with
    its one token)."""
    resp = await api.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1})  # the model loaded
    assert resp.status == 200
    before = service.store.commits

    resp = await api.post("/v1/responses", json={"input": "Say hi", "max_output_tokens": 1})

    body = await resp.json()
    assert resp.status == 200 and body["status"] == "incomplete" and body["output_text"]
    assert service.store.commits - before == 2


async def test_claims_sharing_one_offer_take_one_task_between_them(api: Any, service: Any) -> None:
    """Requests that arrive while a claim is in flight share its offer (one free engine): their
    claims run one after another on the writer, and only the first takes a task. Two would put two
    tasks on the one engine."""
    service.tasks.set_paused(True)  # the scheduler takes nothing by itself
    for _ in range(3):
        resp = await api.post("/v1/responses", json={"input": "hi", "background": True, "max_output_tokens": 1})
        assert resp.status == 202
    offer = Offer([(service.generations, EngineRoom(("gguf",), (), service.pool.engines[0], None, None, None, ""))])

    claims = await asyncio.gather(*(service.store.write(claim, offer) for _ in range(3)))

    assert sum(c is not None for c in claims) == 1
    assert value(await metrics(api), "lmsp_tasks", state="queued") == 2


async def test_a_queued_task_starts_in_the_commit_that_ends_the_one_before_it(api: Any, service: Any) -> None:
    """The engine is free once a generation has ended: the commit that completes a task also takes
    the next queued one (to `running`, its model being loaded), so tasks waiting their turn cost a
    commit each, not two (one to end, one to start the next)."""
    assert (await api.patch("/v1/settings", json={"parallel": 1})).status == 200  # one task at a time
    resp = await api.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1})  # the model loaded
    assert resp.status == 200
    service.tasks.set_paused(True)
    ids = [(await start_background(api, {"input": f"Say {n}", "max_output_tokens": 1}))["task"]["id"]
           for n in range(5)]
    before, writes = service.store.commits, service.store.transactions

    service.tasks.set_paused(False)
    for task_id in ids:
        await wait_status(api, task_id, {"completed"})

    # One claim takes the first; each of the five ends in a commit that takes the next. The only
    # other write is the scheduler's look for more once the engine is free: no remote model
    # exists, so no claim looks for remote tasks meanwhile.
    assert service.store.commits - before == 6
    assert service.store.transactions - writes == 7
    for task_id in ids:
        evs = await events(api, task_id)
        check_sequence(evs)
        assert [e["type"] for e in evs][-2:] == ["response.output_text.done", "response.incomplete"]


async def test_a_pause_holds_a_request_that_shares_an_offer_made_before_it(api: Any, service: Any) -> None:
    """"Pause new tasks" holds the task of a request that arrives while a claim offered before the
    pause is still on its way: its commit does not take the room that offer held for generations."""
    held = service.scheduler.offer()  # the scheduler's claim, in flight
    assert held is not None
    service.tasks.set_paused(True)
    task_id = (await start_background(api, {"input": "Say hi", "max_output_tokens": 1}))["task"]["id"]
    service.scheduler.settle(held, None)
    await asyncio.sleep(0.5)
    assert (await task(api, task_id))["status"] == "queued"
    service.tasks.set_paused(False)
    await wait_status(api, task_id, {"completed"})
