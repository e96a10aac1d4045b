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


def parameters_text(count: int | None) -> str:
    """135 M, 1.5 B: as model names say them."""
    if not count:
        return "—"
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return str(count)


def facts(model: dict[str, Any]) -> list[tuple[str, str]]:
    """What a local model is, a (label, value) a line, from its `details` and `memory` (the Models
    tab's details pane and `lmsp-tray show`)."""
    details, memory = model.get("details") or {}, model.get("memory") or {}
    trained = details.get("trained_context_length")
    served = details.get("context_length")
    loaded = "—"
    if memory:
        kv = memory.get("kv_cache_bytes")
        loaded = (f"{human_size(memory['total_bytes'])} (weights {human_size(memory['weights_bytes'])} + KV cache "
                  f"{human_size(kv)} for {memory['parallel']} at once)" if kv is not None
                  else f"{human_size(memory['weights_bytes'])} + a KV cache not known before it loads")
    return [("Family", " · ".join(x for x in (details.get("family"), details.get("architecture")) if x) or "—"),
            ("Parameters", parameters_text(details.get("parameters"))
             + (f" ({details['size_label']})" if details.get("size_label") else "")),
            ("Quantization", details.get("quantization") or "—"),
            ("Context", f"{served or '—'} tokens served" + (f" of {trained} trained" if trained else "")),
            ("File size", human_size(model.get("size_bytes"))),
            ("Memory loaded", loaded),
            ("Chat template", "yes" if details.get("chat_template") else "no (a plain prompt format is used)"),
            ("License", details.get("license") or "not stated in the file")]
