"""What a task that has not started waits for (issue 40, GET /v1/tasks `waiting_for`): each case
from the task, the model files and the pool's slots, as `Tasks._placed` gives them."""

from __future__ import annotations

from typing import Any

import pytest

from app.core.tasks import waiting_for
from app.gui.task_table import status_text

PATHS = {"small": "/m/small.gguf", "big": "/m/big.gguf", "far": None}  # "far": a remote model
SLOTS = {"/m/small.gguf": (2, 2)}  # small is loaded, both its slots busy


def task(status: str, model: str = "small", kind: str = "response", **more: Any) -> dict[str, Any]:
    return {"status": status, "model": model, "kind": kind, **more}


@pytest.mark.parametrize(("shape", "paused", "waits", "shown"), [
    (task("queued", queue_position=1), False, "slot", "queued #1 · waits for a slot"),
    (task("queued", "big", queue_position=2), False, "model_load", "queued #2 · waits for its model to load"),
    (task("queued", "far", queue_position=1), False, "slot", "queued #1 · waits for a slot"),
    (task("queued", queue_position=3), True, "paused", "queued #3 · waits: tasks paused"),
    (task("loading", "big"), False, "model_load", "loading"),
    (task("queued", "org/repo/f.gguf", "download"), False, "download", "queued · waits for a download"),
    (task("running"), False, None, "running"),
    (task("completed"), False, None, "completed"),
])
def test_what_each_task_waits_for(shape: dict[str, Any], paused: bool, waits: str | None, shown: str) -> None:
    assert waiting_for(shape, PATHS, SLOTS, paused) == waits
    assert status_text({**shape, "waiting_for": waits}) == shown
