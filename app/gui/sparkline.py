"""A small bar chart of a few numbers (a day each), drawn with QPainter: sized for a table cell."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import QRectF, QSize
from PySide6.QtGui import QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import QWidget


class Sparkline(QWidget):
    """One bar a value, the largest as high as the widget, a zero as a thin baseline only."""

    def __init__(self, values: Sequence[float], tooltip: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.values = list(values)
        self.setToolTip(tooltip)

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return QSize(max(60, 3 * len(self.values)), 20)

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt's name)
        if not self.values:
            return
        painter = QPainter(self)
        area = QRectF(self.rect()).adjusted(3, 3, -3, -3)
        step = area.width() / len(self.values)
        palette = self.palette()
        painter.fillRect(QRectF(area.left(), area.bottom(), area.width(), 1), palette.color(QPalette.ColorRole.Mid))
        peak = max(self.values)
        if peak <= 0:
            return
        colour = palette.color(QPalette.ColorRole.Highlight)
        for k, value in enumerate(self.values):
            if value > 0:
                height = max(1.0, area.height() * value / peak)
                painter.fillRect(QRectF(area.left() + k * step, area.bottom() - height, max(1.0, step - 1), height),
                                 colour)
