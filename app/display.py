"""How a model's figures read for a person, the same in the CLI and the desktop app (no Qt here:
the CLI runs without it)."""

from __future__ import annotations

from typing import Any


def human_size(size: int | None) -> str:
    if size is None:
        return "—"
    value = float(size)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def short_digest(digest: str | None) -> str:
    return (digest or "").removeprefix("sha256:")[:12] or "—"


def is_remote(model: dict[str, Any] | None) -> bool:
    return model is not None and model.get("format") == "remote"
