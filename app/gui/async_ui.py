"""Running the facade's coroutines from Qt slots, and showing what goes wrong.

The core raises errors as values (`LmspError`: title + message). This is the GUI's one
boundary that turns them into a dialog; anything else is a bug and goes to the excepthook.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from PySide6.QtWidgets import QMessageBox, QWidget
from shiboken6 import isValid

from app.errors import LmspError
from app.gui.widgets import plain

log = logging.getLogger(__name__)
T = TypeVar("T")
_running: set[asyncio.Task[Any]] = set()  # strong references: asyncio keeps only weak ones
_boxes: set[QMessageBox] = set()


def show_error(parent: QWidget | None, title: str, message: str) -> QMessageBox:
    """A non-modal message box: never a nested event loop inside a running coroutine."""
    box = plain(QMessageBox(QMessageBox.Icon.Warning, title, message, QMessageBox.StandardButton.Ok, parent))
    box.setObjectName("lmsp-error")
    # A parentless box lives only as long as a Python reference to it: keep one until closed.
    _boxes.add(box)
    box.finished.connect(lambda _result: _boxes.discard(box))
    box.show()
    return box


def spawn(work: Awaitable[T], parent: QWidget | None = None,
          done: Callable[[T], None] | None = None) -> asyncio.Task[Any]:
    """Start `work` on the loop; `done` gets its result. LmspError → a dialog.
    Work done for `parent` is dropped if that widget is destroyed meanwhile."""

    async def guarded() -> None:
        try:
            result = await work
        except RuntimeError:
            if parent is not None and not isValid(parent):
                return  # its widget is gone (a closed dialog): nothing left to show it in
            sys.excepthook(*sys.exc_info())
            return
        except LmspError as exc:
            log.info("%s: %s", exc.title, exc.message)
            show_error(parent if parent is None or isValid(parent) else None, exc.title, exc.message)
            return
        except asyncio.CancelledError:
            return
        except Exception:
            sys.excepthook(*sys.exc_info())
            return
        if done is not None and (parent is None or isValid(parent)):
            done(result)

    task = asyncio.ensure_future(guarded())
    _running.add(task)
    task.add_done_callback(_running.discard)
    if asyncio.iscoroutine(work):  # cancelled before it started: close it, or Python warns it never ran
        task.add_done_callback(lambda _: work.close())
    if parent is not None:
        def cancel(*_: Any) -> None:
            task.cancel()
        parent.destroyed.connect(cancel)
        task.add_done_callback(lambda _: isValid(parent) and parent.destroyed.disconnect(cancel))
    return task


def confirm(parent: QWidget | None, title: str, question: str, action: str) -> bool:
    """A yes/no question; call only from a plain Qt slot, never inside a coroutine."""
    box = plain(QMessageBox(QMessageBox.Icon.Question, title, question, QMessageBox.StandardButton.Cancel, parent))
    yes = box.addButton(action, QMessageBox.ButtonRole.AcceptRole)
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    box.exec()
    return box.clickedButton() is yes
