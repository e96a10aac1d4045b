"""Activity: live charts of tokens per second (all models and each), tasks running and queued,
and memory taken by loaded models, over the last 10 minutes or 24 hours (issue 40).

pyqtgraph draws them: made for live plots in Qt, pure Python over numpy (which the app has anyway),
about 10 MB installed; QtCharts would bring PySide6-Addons, 175 MB, for three line charts."""

from __future__ import annotations

import time
from typing import Any

import pyqtgraph as pg
from PySide6.QtGui import QHideEvent, QShowEvent
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.display import human_size
from app.gui.activity import Recorder
from app.gui.widgets import named

COLORS = ("#1d4ed8", "#15803d", "#b45309", "#7c3aed", "#be185d", "#0e7490", "#4d7c0f", "#b91c1c")
ALL = "#111827"


class ActivityTab(QWidget):
    def __init__(self, recorder: Recorder, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.recorder = recorder
        self.span = named(QComboBox(), "activity-span")
        self.span.addItems(["Last 10 minutes", "Last 24 hours"])
        self.span.currentIndexChanged.connect(lambda _: self.draw())
        self.now = named(QLabel(), "activity-now")
        top = QHBoxLayout()
        top.addWidget(self.span)
        top.addWidget(self.now, 1)
        pg.setConfigOptions(background="w", foreground="#374151", antialias=False)
        self.view = pg.GraphicsLayoutWidget()
        self.plots: dict[str, pg.PlotItem] = {}
        for row, (name, title, unit) in enumerate((("tokens", "Tokens per second", "tok/s"),
                                                  ("tasks", "Tasks", ""), ("memory", "Memory of loaded models", "B"))):
            plot = self.view.addPlot(row=row, col=0, title=title, axisItems={"bottom": pg.DateAxisItem()})
            plot.setMouseEnabled(x=False, y=False)
            plot.hideButtons()
            plot.showGrid(x=True, y=True, alpha=0.15)
            plot.setLabel("left", units=unit or None)
            plot.addLegend(offset=(10, 5), labelTextSize="8pt")  # top left: the newest samples are at the right
            plot.getAxis("left").setWidth(48)
            plot.setLimits(yMin=0)
            plot.enableAutoRange(axis="y")
            if row:
                plot.setXLink(self.plots["tokens"])
            self.plots[name] = plot
        self.lines: dict[str, pg.PlotDataItem] = {}
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.view, 1)
        recorder.sampled.connect(self.draw)

    def _line(self, key: str, plot: str, name: str, color: str, fill: bool = False) -> pg.PlotDataItem:
        if key not in self.lines:
            self.lines[key] = self.plots[plot].plot(name=name, pen=pg.mkPen(color, width=2),
                                                    fillLevel=0 if fill else None, brush=color + "30" if fill else None)
        return self.lines[key]

    def draw(self) -> None:
        """Only while on screen: hidden, the samples wait in the rings."""
        if not self.isVisible():
            return
        series = self.recorder.rings["10 min" if self.span.currentIndex() == 0 else "24 h"].series()
        x = series["x"]
        self._line("tokens", "tokens", "all models", ALL).setData(x, series["tokens"])
        for n, (model, rates) in enumerate(series["by_model"].items()):
            self._line(f"model:{model}", "tokens", model, COLORS[n % len(COLORS)]).setData(x, rates)
        self._line("running", "tasks", "running", COLORS[0]).setData(x, series["running"])
        self._line("queued", "tasks", "queued", COLORS[2]).setData(x, series["queued"])
        self._line("memory", "memory", "loaded", COLORS[1], fill=True).setData(x, series["memory"])
        span = 600 if self.span.currentIndex() == 0 else 86400
        now = time.time()
        self.plots["tokens"].setXRange(now - span, now, padding=0)
        self.now.setText(self._now_text(series))

    @staticmethod
    def _now_text(series: dict[str, Any]) -> str:
        if not series["x"]:
            return "Nothing has run since the app started."
        return (f"Now: {series['tokens'][-1]:.1f} tokens/s · {series['running'][-1]} running · "
                f"{series['queued'][-1]} queued · {human_size(series['memory'][-1])} in memory")

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 (Qt's name)
        super().showEvent(event)
        self.recorder.watch(self, True)
        self.draw()

    def hideEvent(self, event: QHideEvent) -> None:  # noqa: N802 (Qt's name)
        super().hideEvent(event)
        self.recorder.watch(self, False)
