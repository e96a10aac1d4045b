"""What the tray and the dashboard both show, kept current from bus events.

Seeded once through the facade when the service is ready, then updated only by events
(a models list is re-fetched through the facade when the bus says models changed).
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import QObject, Signal

from app.core.auth import Client
from app.core.follow import UNFINISHED
from app.core.service import AppService
from app.core.tasks import TERMINAL_EVENTS
from app.gui.async_ui import spawn
from app.gui.bridge import Bridge

ACTIVE = UNFINISHED  # the task statuses that are not final
# The task status each event moves to; terminal events drop the task from `active`.
EVENT_STATUS = {"response.created": "queued", "response.queued": "queued", "response.loading": "loading",
                "response.in_progress": "running", "response.output_text.delta": "running",
                "response.function_call_arguments.delta": "running",
                "response.cancelling": "cancelling", "download.started": "running",
                "download.cancelling": "cancelling"}
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


class Session(QObject):
    changed = Signal()           # anything the tray shows
    models_updated = Signal()    # the models list was re-read

    def __init__(self, service: AppService, bridge: Bridge, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.service = service
        self.bridge = bridge
        self.owner: Client | None = None
        self.url = ""
        self.phase = "starting"          # starting | ready | error | stopping
        self.problem = ""                # why phase is "error"
        self.active: dict[str, str] = {}  # unfinished task id -> status
        self.models: list[dict[str, Any]] = []
        self.downloads: dict[str, dict[str, Any]] = {}  # unfinished download id -> {"file", "progress"}
        self.pairings: dict[str, dict[str, Any]] = {}
        self._touched: set[str] | None = None  # task ids seen in events while seeding
        self._models_task: asyncio.Task[Any] | None = None
        self._models_again = False
        bridge.task_event.connect(self._on_task_event)
        bridge.pairing_requested.connect(self._on_pairing)
        bridge.pairing_resolved.connect(self._on_pairing_resolved)
        bridge.models_changed.connect(self.refresh_models)
        bridge.paused_changed.connect(lambda _paused: self.changed.emit())
        bridge.stopping.connect(lambda: self.set_phase("stopping"))

    # -- lifecycle --------------------------------------------------------------------------

    async def attach(self, url: str) -> None:
        """The service is ready: learn the owner client and seed the live state."""
        self.url = url
        self.owner = await self.service.access.authenticate(await self.service.access.owner_token())
        assert self.owner is not None, "the owner token must authenticate"
        self._touched = set()
        seeded: dict[str, str] = {}
        for status in ACTIVE:
            tasks, _more = await self.service.tasks.list_tasks(self.owner, status=status, limit=1000)
            seeded.update({t["id"]: t["status"] for t in tasks})
            self.downloads.update({t["id"]: {"file": t["download"]["file"], "progress": t["progress"]}
                                   for t in tasks if t["kind"] == "download"})
        for task_id, status in seeded.items():
            if task_id not in self._touched:  # an event since then knows better
                self.active.setdefault(task_id, status)
        self._touched = None
        self.pairings = {p["id"]: p for p in await self.service.access.pending_pairings()}
        self.models = await self.service.models.list_models()
        self.phase = "ready"
        self.changed.emit()
        self.models_updated.emit()

    def set_phase(self, phase: str, problem: str = "") -> None:
        self.phase, self.problem = phase, problem
        self.changed.emit()

    # -- what is shown ----------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return bool(self.service.scheduler.paused)

    @property
    def address(self) -> str:
        """host:port, as people type it."""
        return urlsplit(self.url).netloc if self.url else ""

    @property
    def api_base(self) -> str:
        return f"{self.url}/v1" if self.url else ""

    @property
    def exposed(self) -> bool:
        """Bound to something other than loopback: other computers may reach the service."""
        host = urlsplit(self.url).hostname or ""
        return bool(self.url) and host not in LOOPBACK and not host.startswith("127.")

    def counts(self) -> tuple[int, int]:
        running = sum(1 for s in self.active.values() if s != "queued")
        return running, len(self.active) - running

    def icon_state(self) -> str:
        if self.phase in ("error", "starting", "stopping"):
            return self.phase if self.phase != "stopping" else "starting"
        if self.paused:
            return "paused"
        return "busy" if self.counts()[0] else "idle"

    def status_line(self) -> str:
        if self.phase == "starting":
            return "Starting…"
        if self.phase == "stopping":
            return "Stopping…"
        if self.phase == "error":
            return f"Not running: {self.problem}"
        running, queued = self.counts()
        work = f"{running} running, {queued} queued" if running or queued else "idle"
        if self.paused:
            work = "new tasks paused" + (f", {work}" if running or queued else "")
        return f"Serving on {self.address} — {work}"

    def download_lines(self) -> list[str]:
        """One line per download under way, for the tray's tooltip."""
        lines = []
        for shown in self.downloads.values():
            done, total = shown["progress"].get("bytes") or 0, shown["progress"].get("total_bytes") or 0
            rate = shown["progress"].get("bytes_per_second")
            lines.append(f"Downloading {shown['file']}: {done / total if total else 0:.0%}"
                         + (f" ({rate / 1e6:.1f} MB/s)" if rate else ""))
        return lines

    # -- updates ----------------------------------------------------------------------------

    def _on_task_event(self, event: dict[str, Any]) -> None:
        task_id, kind = event["task_id"], event["type"]
        if self._touched is not None:
            self._touched.add(task_id)
        before = self.active.get(task_id)
        if kind == "download.started":
            self.downloads[task_id] = {"file": event["file"], "progress": event}
        elif kind == "download.progress" and task_id in self.downloads:
            self.downloads[task_id]["progress"] = event
            self.changed.emit()  # the tooltip shows how far it is
        if kind in TERMINAL_EVENTS:
            self.downloads.pop(task_id, None)
            self.active.pop(task_id, None)
        elif kind in EVENT_STATUS:
            self.active[task_id] = EVENT_STATUS[kind]
        if kind == "response.in_progress" or kind in TERMINAL_EVENTS:
            # The engine may just have loaded a model for this task; a remote endpoint's count of
            # running tasks went up or down.
            self.refresh_models()
        if self.active.get(task_id) != before:
            self.changed.emit()

    def _on_pairing(self, pairing: dict[str, Any]) -> None:
        self.pairings[pairing["id"]] = pairing
        self.changed.emit()

    def _on_pairing_resolved(self, pairing_id: str, _status: str) -> None:
        if self.pairings.pop(pairing_id, None) is not None:
            self.changed.emit()

    def forget_expired(self, now: float) -> None:
        expired = [pid for pid, p in self.pairings.items() if float(p["expires_at"]) <= now]
        for pid in expired:
            del self.pairings[pid]
        if expired:
            self.changed.emit()

    def refresh_models(self) -> None:
        """Re-read the models; a burst of changes costs one read in flight plus one after it."""
        if self.phase != "ready":
            return
        if self._models_task is not None and not self._models_task.done():
            self._models_again = True
            return
        self._models_again = False
        self._models_task = spawn(self.service.models.list_models(), done=self._set_models)

    def _set_models(self, found: list[dict[str, Any]]) -> None:
        self.models = found
        self.models_updated.emit()
        self.changed.emit()
        if self._models_again:
            asyncio.get_running_loop().call_soon(self.refresh_models)
