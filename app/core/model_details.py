"""What a model is, in a person's words (LMSP §17, issue 40): its architecture, family, size,
quantization, contexts, chat template and license, from its GGUF header and what the registry
recorded of it. The Models tab, `GET /v1/models/{id}` and `lmsp-tray show` say the same."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.engine.registry import gguf

# llama.cpp's `general.file_type` (enum llama_ftype): how most of the file's weights are stored.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
              32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}


def _text(metadata: Mapping[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    return value if isinstance(value, str) and value else None


KEYS = ("architecture", "family", "parameters", "size_label", "quantization", "context_length",
        "trained_context_length", "chat_template", "license")


def unknown() -> dict[str, Any]:
    """The `details` of a model whose file is not here (a remote one): every key, each None."""
    return dict.fromkeys(KEYS)


def details(model: Mapping[str, Any], info: gguf.GgufInfo | None) -> dict[str, Any]:
    """The `details` of a local model object (its other keys in `model`), each None where unknown.
    The registry's record (architecture, contexts, chat template) holds while the file is missing;
    the rest needs its header `info` (None: the file cannot be read now)."""
    metadata = info.metadata if info else {}
    file_type = metadata.get("general.file_type")
    return {"architecture": model.get("architecture"),
            "family": _text(metadata, "general.basename") or model.get("architecture"),
            "parameters": (info.parameter_count if info else 0) or None,
            "size_label": _text(metadata, "general.size_label"),
            "quantization": FILE_TYPES.get(file_type) if type(file_type) is int else None,
            "context_length": model["context_length"], "trained_context_length": model["trained_context_length"],
            "chat_template": bool(model.get("has_chat_template")),
            "license": _text(metadata, "general.license.name") or _text(metadata, "general.license")}

