"""The one bridge from the core's event bus to Qt signals.

The bus calls its listeners synchronously inside `publish`, often in the middle of a core
coroutine. The bridge only queues the event; the GUI reacts in a later turn of the Qt event
loop, so a slow or re-entrant widget can never stall or disturb the core.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, Qt, Signal

from app.events import EventBus


class Bridge(QObject):
    task_event = Signal(object)          # any event with a task_id (dict)
    pairing_requested = Signal(object)   # the pairing object (dict), and "notify": False when throttled
    pairing_resolved = Signal(str, str)  # pairing id, new status
    models_changed = Signal()
    safe_mode = Signal(object)           # {"models": [ids], "reason"}: the engine fell back (§11)
    gpu_fallback = Signal(object)        # {"models": [ids], "reason"}: a model left the GPU for the CPU (§18)
    model_hashing = Signal(object)       # {"path", "done", "total"}
    clients_changed = Signal()
    settings_changed = Signal(object)    # list of changed keys
    paused_changed = Signal(bool)
    stopping = Signal()

    _incoming = Signal(object)

    def __init__(self, bus: EventBus, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._incoming.connect(self._dispatch, Qt.ConnectionType.QueuedConnection)
        self._detach = bus.listen(self._incoming.emit)

    def close(self) -> None:
        self._detach()

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("type", "")
        if "task_id" in event:
            self.task_event.emit(event)
        elif kind == "pairing.requested":
            self.pairing_requested.emit({**event["pairing"], "notify": event.get("notify", True)})
        elif kind == "pairing.resolved":
            self.pairing_resolved.emit(event["id"], event.get("status", ""))
        elif kind == "models.changed":
            self.models_changed.emit()
        elif kind == "engine.safe_mode":
            self.safe_mode.emit(event)
        elif kind == "engine.gpu_fallback":
            self.gpu_fallback.emit(event)
        elif kind == "models.hashing":
            self.model_hashing.emit(event)
        elif kind == "clients.changed":
            self.clients_changed.emit()
        elif kind == "settings.changed":
            self.settings_changed.emit(event.get("changed", []))
        elif kind == "service.paused":
            self.paused_changed.emit(bool(event["paused"]))
        elif kind == "service.stopping":
            self.stopping.emit()
