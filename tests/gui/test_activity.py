"""The Activity charts and the Chat tab (issue 40), driven through the real widgets on a real
service with scripted engines: the numbers drawn are checked against the tasks that actually ran."""

from __future__ import annotations

import time
from typing import Any

import pytest
from gui_helpers import Until, make_task
from PySide6.QtCore import Qt

from app.core.auth import Client
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.gui.activity import Ring
from app.gui.dashboard import Dashboard
from app.gui.session import Session

pytestmark = [pytest.mark.gui, pytest.mark.scripted(pace=50.0)]


async def test_the_charts_count_the_tokens_tasks_and_memory_of_what_ran(session: Session, owner: Client,
                                                                          until: Until) -> None:
    await session.service.settings.update({"parallel": 2})
    dash = Dashboard(session)
    dash.show()
    dash.bring_forward("Activity")
    recorder = dash.activity.recorder
    ids = [(await make_task(session.service, owner, tokens=n, text=f"Story {n}."))["task"]["id"]
           for n in (150, 200, 5)]  # two at once, the third waits: 5 tokens end between two samples

    async def ended() -> bool:
        return all([(await session.service.tasks.task(owner, t))["status"] == "completed" for t in ids])
    await until(ended, 60, "the three tasks completed")
    made = sum([(await session.service.tasks.task(owner, t))["progress"]["output_tokens"] for t in ids])
    assert made == 355
    await until(lambda: sum(recorder.rings["10 min"].series()["tokens"]) == made, 10, "every token counted")
    series = recorder.rings["10 min"].series()
    assert sum(series["by_model"][DEFAULT_MODEL_ID]) == made  # the one model made them all
    assert max(series["running"]) == 2 and max(series["queued"]) >= 1  # two slots, one waited
    [model] = [m for m in session.models if m["id"] == DEFAULT_MODEL_ID]
    assert max(series["memory"]) == model["memory"]["total_bytes"]
    assert sum(recorder.rings["24 h"].series()["tokens"]) * 60 == pytest.approx(made)  # the same tokens, by the minute
    # What is drawn is what was sampled: a line for all models and one for the model.
    drawn = dash.activity.lines["tokens"].getData()[1]
    assert drawn is not None and sum(drawn) == pytest.approx(sum(series["tokens"]))
    assert f"model:{DEFAULT_MODEL_ID}" in dash.activity.lines
    assert dash.activity.now.text().startswith("Now: ")

    # Idle and hidden, the clock sleeps; on screen it ticks (the time axis moves).
    dash.hide()
    await until(lambda: not recorder._clock.isActive(), 10, "the clock asleep")
    dash.bring_forward("Activity")
    assert recorder._clock.isActive()


def test_a_stretch_without_samples_is_drawn_as_zeros() -> None:
    ring = Ring(1, 600)
    ring.add(1000.2, 30, {"m": 30}, 1, 0, 5)
    ring.add(1000.7, 10, {"m": 10}, 2, 1, 5)  # the same second: tokens add up, the rest keeps its largest
    ring.add(1010.5, 0, {}, 0, 0, 5)
    series = ring.series()
    assert series["x"] == [1000.5, 1001.5, 1009.5, 1010.5]
    assert series["tokens"] == [40, 0, 0, 0] and series["by_model"]["m"] == [40, 0, 0, 0]
    assert series["running"] == [2, 0, 0, 0] and series["queued"] == [1, 0, 0, 0]
    assert series["memory"] == [5] * 4  # the loaded models stayed
    long = Ring(60, 1440)
    for at in range(0, 120, 1):
        long.add(at, 6, {}, 1, 0, 0)
    assert long.series()["tokens"] == [6.0, 6.0]  # 360 tokens a minute: 6 a second


async def chat_turn(dash: Dashboard, until: Until, text: str) -> None:
    chat = dash.chat
    chat.input.setText(text)
    chat.send_button.click()
    await until(lambda: chat.busy, 10, "asking")


@pytest.mark.scripted(pace=20.0, length=100)  # an answer: "1, 2, ... 100", about 5 s
async def test_a_chat_streams_stops_and_goes_on(session: Session, owner: Client, until: Until, qtbot: Any) -> None:
    dash = Dashboard(session)
    dash.show()
    dash.bring_forward("Chat")
    chat = dash.chat
    assert chat.model.currentText() == DEFAULT_MODEL_ID and not chat.stop_button.isEnabled()
    await chat_turn(dash, until, "Count to ten.")
    assert chat.stop_button.isEnabled() and not chat.send_button.isEnabled()
    await until(lambda: "Time to first token" in chat.stats.text(), 30, "the first token")
    await until(lambda: not chat.busy, 60, "answered")
    first = chat.previous
    assert first is not None
    answer = await session.service.responses.response(owner, first)
    assert answer["status"] == "completed" and answer["output_text"] in chat.transcript.toPlainText()
    # A conversation's sampling, not the API's 1.0 and 1.0, at which small models ramble
    assert (answer["temperature"], answer["top_p"]) == (0.2, 0.9)
    tokens = answer["usage"]["output_tokens"]
    assert f"{tokens} tokens · " in chat.stats.text() and chat.stats.text().endswith("tokens/s"), chat.stats.text()
    # It is a task of the owner like any other: it shows in the Tasks tab.
    await until(lambda: dash.tasks.model.task(answer["task"]["id"]) is not None, 10, "listed in Tasks")

    # A long answer, stopped: the task is cancelled, and the next message goes on from the first answer.
    long_started = time.monotonic()
    qtbot.keyClicks(chat.input, "Tell a very long story.")
    qtbot.keyClick(chat.input, Qt.Key.Key_Return)
    await until(lambda: chat.task_id is not None and "writing" in chat.stats.text(), 30, "writing")
    stopped = chat.task_id
    chat.stop_button.click()
    await until(lambda: not chat.busy, 30, "stopped")
    assert time.monotonic() - long_started < 30 and chat.stats.text().endswith("stopped")
    assert (await session.service.tasks.task(owner, stopped))["status"] == "cancelled"
    assert chat.previous == first
    await chat_turn(dash, until, "And then?")
    await until(lambda: not chat.busy, 60, "answered again")
    assert chat.previous != first
    again = await session.service.responses.response(owner, chat.previous)
    assert again["previous_response_id"] == first and again["status"] == "completed"

    chat.new_chat.click()
    assert chat.previous is None and chat.transcript.toPlainText() == ""
