"""Tray and window icons, from the PNGs in icons/ (hand-hinted at small sizes)."""

from __future__ import annotations

from functools import cache

from PySide6.QtGui import QIcon

from app import paths

STATES = ("starting", "idle", "busy", "paused", "error")
SIZES = (16, 22, 24, 32, 64)


@cache
def tray_icon(state: str) -> QIcon:
    """One QIcon holding every size, so the tray host picks its own without scaling blur."""
    icon = QIcon()
    for size in SIZES:
        icon.addFile(str(paths.ICONS / f"tray-{state}-{size}.png"))
    return icon


@cache
def app_icon() -> QIcon:
    icon = QIcon()
    for size in (16, 22, 24, 32, 48, 64, 128, 256):
        png = paths.ICONS / "hicolor" / f"{size}x{size}" / "apps" / "lmsp-tray.png"
        if png.exists():
            icon.addFile(str(png))
    if icon.isNull():
        icon = QIcon(str(paths.ICONS / "lmsp-tray.svg"))
    return icon
