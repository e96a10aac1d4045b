"""What a local model is, in a person's words, from its GGUF header (issue 40): family, size,
quantization, license. The Models tab, `GET /v1/models/{id}` and `lmsp-tray show` say the same."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# llama.cpp's `general.file_type` (enum llama_ftype): how most of the file's weights are stored.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
              32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}


def _text(metadata: Mapping[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    return value if isinstance(value, str) and value else None


def details(metadata: Mapping[str, Any], parameters: int) -> dict[str, Any]:
    """The `details` of a model object: each None where the file does not say."""
    file_type = metadata.get("general.file_type")
    return {"family": _text(metadata, "general.basename") or _text(metadata, "general.architecture"),
            "parameters": parameters or None, "size_label": _text(metadata, "general.size_label"),
            "quantization": FILE_TYPES.get(file_type) if type(file_type) is int else None,
            "license": _text(metadata, "general.license.name") or _text(metadata, "general.license")}

