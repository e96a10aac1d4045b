"""The Models tab's "Try fast mode again" (LMSP §11, red team 2026-12-05 N1): a model that fell
back to safe mode goes back to fast mode from the real widget, and stays so after a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
from gui_helpers import Until, attached
from PySide6.QtWidgets import QApplication

from app.engine.registry.models import DEFAULT_MODEL_ID
from app.gui.models_tab import ModelsTab
from tests.helpers import started
from tests.test_engine_modes import IN_FAST_MODE

pytestmark = pytest.mark.gui
ENGINE = 4


async def test_try_fast_mode_again_from_the_models_tab(tmp_path: Path, qapp: QApplication, until: Until,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:warmup")  # fast mode crashes here, as on an AMX CPU
    async with started(data) as first:
        await first.models.load_model(DEFAULT_MODEL_ID)
    monkeypatch.delenv("LMSP_ENGINE_FAULT")

    async with started(data) as service, attached(service) as session:
        tab = ModelsTab(session)
        [row] = [r for r in range(tab.table.rowCount()) if tab.table.item(r, 0).text() == DEFAULT_MODEL_ID]
        button = tab.buttons["fast-mode"]
        assert tab.table.item(row, ENGINE).text() == "Safe mode" and not button.isEnabled()  # nothing selected
        tab.table.selectRow(row)
        assert button.isEnabled() and button.text() == "Try fast mode again"
        button.click()
        await until(lambda: tab.table.item(row, ENGINE).text() == "Fast", 20, "engine column back to fast")
        assert not button.isEnabled() and tab.table.item(row, ENGINE).toolTip() != ""
        assert (await service.models.model(DEFAULT_MODEL_ID))["engine"] == IN_FAST_MODE

        # The setting `safe` is the person's own choice: nothing to try again there.
        await service.settings.update({"engine_mode": "safe"})
        await until(lambda: tab.table.item(row, ENGINE).text() == "Safe mode", 20, "setting shown")
        tab.table.clearSelection()
        tab.table.selectRow(row)
        assert not button.isEnabled()
        await service.settings.update({"engine_mode": "auto"})

    async with started(data) as again:
        assert (await again.models.model(DEFAULT_MODEL_ID))["engine"] == IN_FAST_MODE
