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


def gpu_share(processor: dict[str, Any] | None) -> float:
    """The share of a loaded model's layers on a GPU, 0 to 1 (LMSP §18 `processor`)."""
    if not processor or not processor.get("gpu_layers") or not processor.get("layers"):
        return 0.0
    return min(processor["gpu_layers"], processor["layers"]) / processor["layers"]


def processor_text(processor: dict[str, Any] | None) -> str:
    """Where a loaded model runs, as `ollama ps` prints it: 100% GPU, 100% CPU, 48%/52% CPU/GPU."""
    gpu = round(100 * gpu_share(processor))
    return "100% GPU" if gpu == 100 else "100% CPU" if gpu == 0 else f"{100 - gpu}%/{gpu}% CPU/GPU"


def processor_facts(model: dict[str, Any]) -> str:
    """Where a local model runs, or would, and why not on the GPU where it failed there."""
    processor, engine = model.get("processor"), model.get("engine") or {}
    if processor and processor.get("gpu_layers"):
        where = (f"{processor_text(processor)} ({processor['device']}: {processor['gpu_layers']} of "
                 f"{processor['layers']} layers, {human_size(processor['vram_bytes'])} of its memory)")
    else:
        where = "100% CPU" if processor else "not loaded"
    return where + (f". {engine['gpu_reason']}" if engine.get("gpu_reason") else "")


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
            ("Processor", processor_facts(model)),
            ("Chat template", "yes" if details.get("chat_template") else "no (a plain prompt format is used)"),
            ("License", details.get("license") or "not stated in the file")]
