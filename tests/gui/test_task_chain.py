"""The task detail shows the response a task's response continues, and its link opens it."""

from __future__ import annotations

import pytest
from gui_helpers import Until, make_task

from app.core.auth import Client
from app.gui.dashboard import Dashboard
from app.gui.session import Session

pytestmark = [pytest.mark.gui, pytest.mark.scripted]  # a chain of tasks, whatever their text: tests/scripted.py


async def test_detail_shows_and_opens_the_previous_turn(session: Session, owner: Client, until: Until) -> None:
    service = session.service
    first = await make_task(service, owner, tokens=4)
    await service.tasks.wait(first["task"]["id"])
    second = await make_task(service, owner, tokens=4, text="And then?", previous_response_id=first["id"])
    dash = Dashboard(session)
    dash.show()
    detail = dash.tasks.detail
    await until(lambda: dash.tasks.model.row_of(second["task"]["id"]) >= 0, 20, "row appears")
    dash.tasks.select_task(second["task"]["id"])
    await until(lambda: detail.chain.isVisible(), 20, "chain shown")
    assert f'href="{first["id"]}"' in detail.chain.text() and detail.chain.text().startswith("Continues")
    detail.chain.linkActivated.emit(first["id"])  # what a click on the link does
    await until(lambda: dash.tasks.selected_id() == first["task"]["id"], 20, "previous turn selected")
    assert detail.task_id == first["task"]["id"]
    await until(lambda: detail.log.count() > 0, 20, "its events loaded")
    assert not detail.chain.isVisible()  # the first turn continues nothing
    # Once the previous turn is deleted, the link says so instead of opening nothing.
    dash.tasks.select_task(second["task"]["id"])
    await until(lambda: detail.chain.isVisible(), 20, "chain shown again")
    await service.responses.delete_response(owner, first["id"])
    detail.chain.linkActivated.emit(first["id"])
    await until(lambda: "deleted or expired" in detail.chain.text(), 20, "gone")
    assert dash.tasks.selected_id() == second["task"]["id"]
