"""Event streams under stress: a reader that never reads, a service that shuts down, and
deleting a response only once it is finished."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from typing import Any

import pytest

from tests.conftest import Headless, wait_until
from tests.helpers import poll

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

SSE = {"Accept": "text/event-stream"}
LONG = {"input": "Write the numbers from 1 to 1000 separated by commas.", "background": True,
        "temperature": 0, "max_output_tokens": 300}


def _sequence(raw: str) -> list[int]:
    return [int(line[4:]) for line in raw.splitlines() if line.startswith("id: ")]


async def test_a_reader_that_never_reads_stalls_neither_generation_nor_other_readers(api: Any) -> None:
    created = await (await api.post("/v1/responses", json=LONG)).json()
    task_id = created["task"]["id"]
    stuck = await api.get(f"/v1/tasks/{task_id}/events", headers=SSE)  # opened, then left unread
    reader = await api.get(f"/v1/tasks/{task_id}/events", headers=SSE)
    text = await asyncio.wait_for(reader.text(), 180)
    assert "event: response.incomplete" in text or "event: response.completed" in text
    row = await (await api.get(f"/v1/tasks/{task_id}")).json()
    assert row["status"] == "completed" and row["progress"]["output_tokens"] > 0
    late = await asyncio.wait_for(stuck.text(), 30)  # everything is still there for the slow one
    assert _sequence(late) == list(range(row["last_sequence_number"] + 1))


async def test_a_response_is_deleted_only_once_finished(api: Any) -> None:
    created = await (await api.post("/v1/responses", json=LONG)).json()
    refused = await api.delete(f"/v1/responses/{created['id']}")
    assert refused.status == 409 and (await refused.json())["error"]["code"] == "response_not_finished"
    await api.post(f"/v1/responses/{created['id']}/cancel")

    async def ended() -> Any:
        task = await (await api.get(f"/v1/tasks/{created['task']['id']}")).json()
        return task["status"] == "cancelled"

    await poll(ended, what="the cancel")
    done = await api.delete(f"/v1/responses/{created['id']}")
    assert done.status == 200 and (await done.json())["deleted"] is True
    assert (await api.get(f"/v1/responses/{created['id']}")).status == 404
    assert (await api.get(f"/v1/tasks/{created['task']['id']}")).status == 404  # its task and events too


def test_open_streams_end_cleanly_when_the_service_stops(headless: Headless) -> None:
    headless.start()
    _, created = headless.post("/v1/responses", {**LONG, "max_output_tokens": 4000, "on_restart": "resume"})
    task_id = created["task"]["id"]
    wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["status"] == "running")
    received: dict[str, Any] = {}

    def follow() -> None:
        req = urllib.request.Request(f"{headless.url}/v1/tasks/{task_id}/events",
                                     headers={**SSE, "Authorization": f"Bearer {headless.token}"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            received["body"] = resp.read().decode()  # returns only when the server closes the stream
        received["at"] = time.monotonic()

    reader = threading.Thread(target=follow)
    reader.start()
    time.sleep(1.0)
    stopped_at = time.monotonic()
    assert headless.terminate() == 0
    reader.join(timeout=30)
    assert not reader.is_alive() and received["at"] - stopped_at < 10
    seqs = _sequence(received["body"])
    assert seqs == list(range(len(seqs))) and len(seqs) > 5  # whole frames, no gap, then a clean end
    last = json.loads(received["body"].strip().split("data: ")[-1])
    assert last["sequence_number"] == seqs[-1]
