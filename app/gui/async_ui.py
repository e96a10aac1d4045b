"""Running the facade's coroutines from Qt slots, and showing what goes wrong.

The core raises errors as values (`LmspError`: title + message). This is the GUI's one
boundary that turns them into a dialog; anything else is a bug and goes to the excepthook.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any, Awaitable, Callable, TypeVar

from PySide6.QtWidgets import QMessageBox, QWidget

from app.errors import LmspError

log = logging.getLogger(__name__)
T = TypeVar("T")
_running: set[asyncio.Task[Any]] = set()  # strong references: asyncio keeps only weak ones
_boxes: set[QMessageBox] = set()


def show_error(parent: QWidget | None, title: str, message: str) -> QMessageBox:
    """A non-modal message box: never a nested event loop inside a running coroutine."""
    box = QMessageBox(QMessageBox.Icon.Warning, title, message, QMessageBox.StandardButton.Ok, parent)
    box.setObjectName("lmsp-error")
    # A parentless box lives only as long as a Python reference to it: keep one until closed.
    _boxes.add(box)
    box.finished.connect(lambda _result: _boxes.discard(box))
    box.show()
    return box


def spawn(work: Awaitable[T], parent: QWidget | None = None,
          done: Callable[[T], None] | None = None) -> asyncio.Task[Any]:
    """Start `work` on the loop; `done` gets its result. LmspError → a dialog."""

    async def guarded() -> None:
        try:
            result = await work
        except LmspError as exc:
            log.info("%s: %s", exc.title, exc.message)
            show_error(parent, exc.title, exc.message)
            return
        except asyncio.CancelledError:
            return
        except Exception:
            sys.excepthook(*sys.exc_info())
            return
        if done is not None:
            done(result)

    task = asyncio.ensure_future(guarded())
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


def confirm(parent: QWidget | None, title: str, question: str, action: str) -> bool:
    """A yes/no question; call only from a plain Qt slot, never inside a coroutine."""
    box = QMessageBox(QMessageBox.Icon.Question, title, question, QMessageBox.StandardButton.Cancel, parent)
    yes = box.addButton(action, QMessageBox.ButtonRole.AcceptRole)
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    box.exec()
    return box.clickedButton() is yes
