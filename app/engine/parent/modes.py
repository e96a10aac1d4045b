"""How llama.cpp runs each model on this CPU (LMSP §11, "Local engine modes").

`fast` lets llama.cpp use its extra buffer types (weight repacking, Intel AMX kernels); `safe`
loads with `use_extra_bufts = false` (llama-server's `--no-repack`). Those fast paths crash on some CPUs (a SIGSEGV in
`ggml_backend_amx_mul_mat` on Sapphire Rapids), so in `auto` an engine that dies from such a
signal in llama.cpp's compute kernels (app/engine/parent/engine.py decides) falls back to safe for that
model, and the choice is remembered per model digest, CPU and llama.cpp release (the pin it is built from). It is
not for ever: a decision made under another release does not apply (an update may have fixed
the crash), and the person can ask for fast mode again (`forget`); if it still crashes, the
engine falls back again and says so.

The GPU (LMSP §18) is decided here too: with the setting `gpu` at `auto`, a model's layers go to
the GPU the build sees unless that model failed there (a load that failed on the device, a device
lost or out of memory mid-task); then it runs on the CPU, remembered the same way, until the
person asks for the GPU again (`forget`).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from app import paths
from app.engine.parent import cpu, gpu
from app.events import EventBus
from app.store.store import Store

log = logging.getLogger(__name__)
FAST, SAFE = "fast", "safe"
SETTING_REASON = "Chosen in the settings (engine_mode)."


def _remembered(conn: sqlite3.Connection, cpu_key: str, llama: str) -> dict[str, tuple[str, str | None]]:
    rows = conn.execute("SELECT digest, mode, reason, llama FROM engine_modes WHERE cpu = ?", (cpu_key,)).fetchall()
    stale = sum(r["llama"] != llama for r in rows)
    if stale:
        log.info("%d model(s) fell back to safe mode under another llama.cpp release than %s: fast mode is "
                 "tried again", stale, llama)
    return {r["digest"]: (r["mode"], r["reason"]) for r in rows if r["llama"] == llama}


def _remember(conn: sqlite3.Connection, digest: str, cpu_key: str, llama: str, mode: str, reason: str) -> list[str]:
    conn.execute("INSERT INTO engine_modes(digest, cpu, llama, mode, reason, decided_at) VALUES (?, ?, ?, ?, ?, ?) "
                 "ON CONFLICT(digest, cpu) DO UPDATE SET llama = excluded.llama, mode = excluded.mode, "
                 "reason = excluded.reason, decided_at = excluded.decided_at",
                 (digest, cpu_key, llama, mode, reason, time.time()))
    return [r["id"] for r in conn.execute("SELECT id FROM models WHERE digest = ? ORDER BY id", (digest,))]


def _forget(conn: sqlite3.Connection, digest: str, cpu_key: str) -> None:
    conn.execute("DELETE FROM engine_modes WHERE digest = ? AND cpu = ?", (digest, cpu_key))
    conn.execute("DELETE FROM gpu_fallbacks WHERE digest = ?", (digest,))


def _on_cpu(conn: sqlite3.Connection, llama: str) -> dict[str, str]:
    rows = conn.execute("SELECT digest, reason FROM gpu_fallbacks WHERE llama = ?", (llama,)).fetchall()
    return {r["digest"]: r["reason"] for r in rows}


def _remember_cpu(conn: sqlite3.Connection, digest: str, llama: str, reason: str) -> list[str]:
    conn.execute("INSERT OR REPLACE INTO gpu_fallbacks(digest, llama, reason, decided_at) VALUES (?, ?, ?, ?)",
                 (digest, llama, reason, time.time()))
    return [r["id"] for r in conn.execute("SELECT id FROM models WHERE digest = ? ORDER BY id", (digest,))]


class EngineModes:
    """The one place that says which mode a model loads in; engines ask it and report crashes to it."""

    def __init__(self, store: Store, bus: EventBus, setting: Callable[[], str],
                 gpu_setting: Callable[[], str] = lambda: "auto") -> None:
        self.store = store
        self.bus = bus
        self.setting = setting  # the `engine_mode` setting: auto | fast | safe, read live
        self.gpu_setting = gpu_setting  # the `gpu` setting: auto | off, read live
        self._decided: dict[str, tuple[str, str | None]] = {}
        self._on_cpu: dict[str, str] = {}  # models that failed on the GPU: why
        self._asked: dict[str, int] = {}  # layers on the GPU a load asked for, per model (this run)

    async def open(self) -> None:
        self._decided = await self.store.read(_remembered, cpu.key(), paths.LLAMA_CPP)
        self._on_cpu = await self.store.read(_on_cpu, paths.LLAMA_CPP)

    @property
    def auto(self) -> bool:
        return self.setting() == "auto"

    def describe(self, digest: str) -> dict[str, Any]:
        """`{"mode", "reason"}` for a model, as GET /v1/models shows it."""
        gpu_use = {"gpu": "off" if self.gpu_setting() == "off" or digest in self._on_cpu else "auto",
                   "gpu_reason": self._on_cpu.get(digest)}
        if not self.auto:
            return {"mode": self.setting(), "reason": SETTING_REASON, **gpu_use}
        mode, reason = self._decided.get(digest, (FAST, None))
        return {"mode": mode, "reason": reason, **gpu_use}

    def gpu_layers(self, digest: str) -> int | None:
        """The layers of this model to put on a GPU: 0 (the CPU alone) where the setting or a failure
        there says so, or the machine has none; else those a load asked for (`ask_layers`), or None:
        as many as fit (`gpu.devices` blocks the first time a run: ask it in a thread first)."""
        if self.gpu_setting() == "off" or digest in self._on_cpu or not gpu.devices():
            return 0
        return self._asked.get(digest)

    def gpu_room(self, digest: str) -> int:
        """Bytes of this model the GPUs would take off the host's memory (0 on the CPU alone). It
        blocks the first time a run, as `gpu_layers`."""
        return 0 if self.gpu_layers(digest) == 0 else gpu.room()

    def ask_layers(self, digest: str, layers: int | None) -> None:
        """Load this model with `layers` on the GPU from now on (None: as many as fit)."""
        if layers is None:
            self._asked.pop(digest, None)
        else:
            self._asked[digest] = layers

    async def fall_back_to_cpu(self, digest: str, reason: str) -> None:
        """Remember that this model runs on the CPU (it failed on the GPU), and say so once."""
        self._on_cpu[digest] = reason
        model_ids = await self.store.write(_remember_cpu, digest, paths.LLAMA_CPP, reason)
        self.bus.publish([{"type": "engine.gpu_fallback", "models": model_ids, "reason": reason},
                          {"type": "models.changed"}])

    def mode(self, digest: str) -> str:
        return str(self.describe(digest)["mode"])

    async def fall_back(self, digest: str, reason: str) -> None:
        """Remember safe mode for this model on this CPU, and say so once."""
        self._decided[digest] = (SAFE, reason)
        model_ids = await self.store.write(_remember, digest, cpu.key(), paths.LLAMA_CPP, SAFE, reason)
        self.bus.publish([{"type": "engine.safe_mode", "models": model_ids, "reason": reason},
                          {"type": "models.changed"}])

    async def forget(self, digest: str) -> None:
        """Try fast mode, and the GPU, again for this model (the person asked): its next load runs
        so, and `auto` falls back again, remembered and said again, if it still fails."""
        await self.store.write(_forget, digest, cpu.key())
        self._decided.pop(digest, None)
        self._on_cpu.pop(digest, None)
