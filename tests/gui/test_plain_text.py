"""Text the app did not write (a model file's path and metadata, an app's name, a download's file
name, an upstream's error message) shows as the characters it is in every widget, never as rich
text (the red team's P9: a path holding HTML showed "✔ Official Meta release, signature verified"
in large green letters in the Models tab)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gui_helpers import Until, visible
from PySide6.QtCore import Qt
from PySide6.QtGui import Qt as QtText
from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import QLabel, QMessageBox

from app.core.auth import Client
from app.gui.chat_tab import ChatTab
from app.gui.models_tab import ModelsTab
from app.gui.pairing_dialog import PairingDialog
from app.gui.session import Session
from app.gui.task_detail import TaskDetail
from app.gui.task_table import TaskTableModel
from tests.helpers import refusing_upstream
from tests.hub_server import FakeHub, HubFile
from tests.test_gguf import make_gguf, valid_kvs, valid_tensors

pytestmark = pytest.mark.gui

HTML = '<b style="font-size:18pt;color:#0a0">&#10004; Verified</b>'


def rendered(text: str, form: Qt.TextFormat = Qt.TextFormat.AutoText) -> str:
    """The characters Qt shows for `text` in a label of format `form`, or in a tooltip (which
    is in auto format): rich text's own, else the text itself."""
    rich = form == Qt.TextFormat.RichText or (form == Qt.TextFormat.AutoText and QtText.mightBeRichText(text))
    if not rich:
        return text
    document = QTextDocument()
    document.setHtml(text)
    return document.toPlainText()


def shown(label: QLabel | QMessageBox) -> str:
    return rendered(label.text(), label.textFormat())


def tiny_model(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True)
    path = folder / "x.gguf"
    path.write_bytes(make_gguf({**valid_kvs(), "general.name": name, "general.license": name}, valid_tensors()))
    return path


async def test_a_model_path_and_name_holding_html_show_as_written(session: Session, tmp_path: Path,
                                                                 until: Until) -> None:
    # "/" would close a tag, so the folders carry the halves, as the red team's file did.
    opening, closing = HTML.split("/", 1)
    path = tiny_model(tmp_path / opening / closing, HTML)
    model = await session.service.models.register_model({"path": str(path), "id": "html"})
    tab = ModelsTab(session)
    tab.show()
    row = await until(lambda: next((r for r in range(tab.table.rowCount())
                                    if tab.table.item(r, 0).text() == "html"), None), 10, "the model listed")
    tab.table.selectRow(row)
    assert shown(tab.details).startswith(f"html — {model['path']}") and HTML in model["path"], shown(tab.details)
    assert rendered(tab.table.item(row, 0).toolTip()).startswith(model["path"])
    assert f"License: {HTML}" in shown(tab.facts).replace("\n", " ").replace("\t", " "), shown(tab.facts)

    tab.register(str(tmp_path / HTML.replace("/", "") / "missing.gguf"))  # refused: said in a message box
    box = await until(lambda: next((b for b in visible(QMessageBox) if b.objectName() == "lmsp-error"), None), 20,
                      "the error box")
    assert box.textFormat() == Qt.TextFormat.PlainText and HTML.replace("/", "") in shown(box), box.text()
    box.close()


async def test_an_app_name_holding_html_shows_as_written(session: Session) -> None:
    pairing = await session.service.access.request_pairing({"client_name": HTML, "scopes": ["models:read"]})
    dialog = PairingDialog(session, pairing)
    dialog.show()
    assert any(HTML in shown(label) for label in dialog.findChildren(QLabel))
    dialog.close()


async def test_an_upstream_error_holding_html_shows_as_written(session: Session, owner: Client,
                                                               until: Until) -> None:
    with refusing_upstream(HTML) as url:
        await session.service.models.register_model({"id": "far", "remote": {"endpoints": [
            {"base_url": url, "model": "m"}]}})
        chat = ChatTab(session)
        chat.show()
        await until(lambda: chat.model.findText("far") >= 0, 10, "the model offered")
        chat.model.setCurrentText("far")
        chat.input.setText("Hi")
        chat.send()
        await until(lambda: HTML in shown(chat.stats), 30, "the error in the stats line")
    assert chat.stats.textFormat() == Qt.TextFormat.PlainText
    [task] = [t for t in (await session.service.tasks.list_tasks(owner))[0] if t["model"] == "far"]
    detail = TaskDetail(session)
    detail.show()
    detail.show_task(task)
    assert shown(detail.header).endswith(HTML), shown(detail.header)
    table = TaskTableModel()
    table.reset([task])
    assert rendered(table.data(table.index(0, 0), Qt.ItemDataRole.ToolTipRole)).endswith(HTML)


async def test_a_download_file_name_holding_html_shows_as_written(session: Session, owner: Client, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    file = HTML.replace("/", "") + ".gguf"  # a folder in the repository otherwise
    hub = FakeHub({"o/n": {file: HubFile(tiny_model(tmp_path / "hub", "tiny"))}}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    try:
        task = await session.service.downloads.create_download(owner, {"repo": "o/n", "file": file})
    finally:
        hub.stop()
    detail = TaskDetail(session)
    detail.show()
    detail.show_task(task)
    assert f"o/n/{file}" in shown(detail.header), shown(detail.header)
