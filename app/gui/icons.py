"""Tray and window icons, from the PNGs in app/resources/icons/ (hand-hinted at small sizes)."""

from __future__ import annotations

from functools import cache

from PySide6.QtGui import QIcon, QPixmap

from app import paths

STATES = ("starting", "idle", "busy", "paused", "error")
SIZES = (16, 22, 24, 32, 64)
APP_SIZES = (16, 22, 24, 32, 48, 64, 128, 256)


def _icon(*pngs: tuple[str, ...]) -> QIcon:
    """One QIcon holding every size, so the tray host or window manager picks its own without
    scaling blur. The PNGs are read as bytes: package data need not be a file on disk."""
    icon = QIcon()
    for parts in pngs:
        pixmap = QPixmap()
        if pixmap.loadFromData(paths.resource("icons", *parts).read_bytes(), "PNG"):
            icon.addPixmap(pixmap)
    return icon


@cache
def tray_icon(state: str) -> QIcon:
    return _icon(*((f"tray-{state}-{size}.png",) for size in SIZES))


@cache
def app_icon() -> QIcon:
    return _icon(*(("hicolor", f"{size}x{size}", "apps", "lmsp-tray.png") for size in APP_SIZES))
