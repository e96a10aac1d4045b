"""What the Activity charts show, sampled from what the service already has (issue 40): tokens
generated (the core's TokenMeter), tasks running and queued (the session, kept by the bus), memory
of the loaded models (their `memory`), into two rings: 10 minutes by the second, 24 hours by the
minute. Nothing is written anywhere: the history starts with the app.

The clock ticks only while something happens or the charts are on screen: an idle app with its
dashboard hidden samples nothing (a task event or a model change wakes it)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal
from shiboken6 import isValid

from app.core.activity import TokenMeter
from app.gui.async_ui import spawn
from app.gui.session import Session

SHORT, LONG = (1, 600), (60, 1440)  # (seconds a point, points): 10 minutes, 24 hours


@dataclass
class Bucket:
    start: float
    tokens: int = 0
    by_model: Counter[str] = field(default_factory=Counter)
    running: int = 0
    queued: int = 0
    memory: int = 0


class Ring:
    """The last `size` buckets of `step` seconds; within one, tokens add up and the rest keep
    their largest value. A stretch with no sample (the clock was asleep: nothing ran) is drawn
    as zeros at the memory it had, not as a line across it."""

    def __init__(self, step: int, size: int) -> None:
        self.step = step
        self.buckets: deque[Bucket] = deque(maxlen=size)

    def add(self, at: float, tokens: int, by_model: dict[str, int], running: int, queued: int, memory: int) -> None:
        start = at - at % self.step
        last = self.buckets[-1] if self.buckets else None
        if last is None or start > last.start:
            if last is not None and start - last.start > self.step:
                self.buckets.append(Bucket(last.start + self.step, memory=last.memory))
                if start - last.start > 2 * self.step:
                    self.buckets.append(Bucket(start - self.step, memory=last.memory))
            self.buckets.append(Bucket(start))
        bucket = self.buckets[-1]
        bucket.tokens += tokens
        bucket.by_model.update(by_model)
        bucket.running, bucket.queued = max(bucket.running, running), max(bucket.queued, queued)
        bucket.memory = max(bucket.memory, memory)

    def series(self) -> dict[str, Any]:
        """x (Unix seconds, each bucket's middle) and each line's y: tokens/s in all and by model,
        tasks running and queued, memory in bytes."""
        buckets = list(self.buckets)
        models = sorted({m for b in buckets for m in b.by_model})
        return {"x": [b.start + self.step / 2 for b in buckets],
                "tokens": [b.tokens / self.step for b in buckets],
                "by_model": {m: [b.by_model.get(m, 0) / self.step for b in buckets] for m in models},
                "running": [b.running for b in buckets], "queued": [b.queued for b in buckets],
                "memory": [b.memory for b in buckets]}


def loaded_memory(models: list[dict[str, Any]]) -> int:
    """Bytes the loaded models take: weights and KV cache (the weights alone where that is unknown)."""
    return sum((m.get("memory") or {}).get("total_bytes") or (m.get("memory") or {}).get("weights_bytes") or 0
               for m in models if m.get("status") == "loaded")


class Recorder(QObject):
    sampled = Signal()

    def __init__(self, session: Session, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.rings = {"10 min": Ring(*SHORT), "24 h": Ring(*LONG)}
        self.watchers: set[QObject] = set()  # charts on screen
        self._meter = TokenMeter(session.service.tasks)
        self._total: int | None = None
        self._by_model: dict[str, int] = {}
        self._sampling: asyncio.Task[Any] | None = None
        self._clock = QTimer(self, interval=1000)
        self._clock.timeout.connect(self.sample)
        session.changed.connect(self.wake)
        session.models_updated.connect(self.wake)

    def watch(self, chart: QObject, on_screen: bool) -> None:
        """A chart came on screen or left it (a set: a tab is hidden before it was ever shown)."""
        if on_screen:
            self.watchers.add(chart)
        else:
            self.watchers.discard(chart)
        self.wake()

    def wake(self) -> None:
        if self.session.phase == "ready" and not self._clock.isActive():
            self._clock.start()
            self.sample()

    def sample(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the loop that ran the app has ended (its recorder outlived it): stop for good
            self._clock.stop()
            return
        if self.session.phase != "ready":  # the service stops (or never started): nothing to read, no clock
            self._clock.stop()
            return
        if self._sampling is None or self._sampling.done():
            self._sampling = spawn(self._sample())  # the recorder lives as long as the app

    async def _sample(self) -> None:
        total, by_model = await self._meter.read()
        if not isValid(self):  # a window's own recorder, closed meanwhile
            return
        tokens = total - self._total if self._total is not None else 0
        new = {m: n - self._by_model.get(m, 0) for m, n in by_model.items() if n != self._by_model.get(m, 0)}
        self._total, self._by_model = total, by_model
        running, queued = self.session.counts()
        memory = loaded_memory(self.session.models)
        now = time.time()
        for ring in self.rings.values():
            ring.add(now, tokens, new, running, queued, memory)
        if not (running or queued or tokens or self.watchers):
            self._clock.stop()  # idle and unseen: asleep until an event
        self.sampled.emit()
