"""How llama.cpp runs each model on this CPU (LMSP §11, "Local engine modes").

`fast` lets llama.cpp use its extra buffer types (weight repacking, Intel AMX kernels); `safe`
loads with `use_extra_bufts = false`. Those fast paths crash on some CPUs (a SIGSEGV in
`ggml_backend_amx_mul_mat` on Sapphire Rapids), so in `auto` an engine that dies from such a
signal falls back to safe for that model, and the choice is remembered per model digest and CPU.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any, Callable

from app.engine import cpu
from app.store.store import Store
from app.tasks.bus import EventBus

FAST, SAFE = "fast", "safe"
SETTING_REASON = "Chosen in the settings (engine_mode)."


def _remembered(conn: sqlite3.Connection, cpu_key: str) -> dict[str, tuple[str, str | None]]:
    rows = conn.execute("SELECT digest, mode, reason FROM engine_modes WHERE cpu = ?", (cpu_key,))
    return {r["digest"]: (r["mode"], r["reason"]) for r in rows}


def _remember(conn: sqlite3.Connection, digest: str, cpu_key: str, mode: str, reason: str) -> list[str]:
    conn.execute("INSERT INTO engine_modes(digest, cpu, mode, reason, decided_at) VALUES (?, ?, ?, ?, ?) "
                 "ON CONFLICT(digest, cpu) DO UPDATE SET mode = excluded.mode, reason = excluded.reason, "
                 "decided_at = excluded.decided_at", (digest, cpu_key, mode, reason, time.time()))
    return [r["id"] for r in conn.execute("SELECT id FROM models WHERE digest = ? ORDER BY id", (digest,))]


class EngineModes:
    """The one place that says which mode a model loads in; engines ask it and report crashes to it."""

    def __init__(self, store: Store, bus: EventBus, setting: Callable[[], str]) -> None:
        self.store = store
        self.bus = bus
        self.setting = setting  # the `engine_mode` setting: auto | fast | safe, read live
        self._decided: dict[str, tuple[str, str | None]] = {}

    async def open(self) -> None:
        self._decided = await self.store.read(_remembered, cpu.key())

    @property
    def auto(self) -> bool:
        return self.setting() == "auto"

    def describe(self, digest: str) -> dict[str, Any]:
        """`{"mode", "reason"}` for a model, as GET /v1/models shows it."""
        if not self.auto:
            return {"mode": self.setting(), "reason": SETTING_REASON}
        mode, reason = self._decided.get(digest, (FAST, None))
        return {"mode": mode, "reason": reason}

    def mode(self, digest: str) -> str:
        return str(self.describe(digest)["mode"])

    async def fall_back(self, digest: str, reason: str) -> None:
        """Remember safe mode for this model on this CPU, and say so once."""
        self._decided[digest] = (SAFE, reason)
        model_ids = await self.store.write(_remember, digest, cpu.key(), SAFE, reason)
        self.bus.publish([{"type": "engine.safe_mode", "models": model_ids, "reason": reason},
                          {"type": "models.changed"}])
