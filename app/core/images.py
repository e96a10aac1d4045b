"""Images in a request (LMSP's vision input): each one is checked when the request is read, in
the terms the client sent it, and kept as a `data:` URL with the request (so a task resumed after
a crash still has it). The app fetches nothing: an `http(s)` URL is refused, naming its field.

What llama.cpp decodes (stb_image) is read here only as far as the header that says its size: a
small file can stand for an image too large to decode in reasonable time and memory, and is
refused before anything is stored. Whether the model can see it is decided when the request is
accepted for a model (app/core/templates.py: a vision projector, or a 400)."""

from __future__ import annotations

import base64
import binascii
import re
import struct
from typing import Any

from app.errors import InvalidRequest

# Pixels an image may have: 32 Mpx is a phone's photo and ~100 MB decoded (RGB); vision encoders
# scale every image down to well under a megapixel anyway.
MAX_PIXELS = 32 * 1024 * 1024
# Images in one request: each is encoded separately before the prompt is read; real chats send a few.
MAX_IMAGES = 16
DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
SPACE = re.compile(r"\s+")
_JPEG_SIZES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # SOFn, not DHT/JPG/DAC


def _jpeg(raw: bytes) -> tuple[int, int] | None:
    """A JPEG's size, from its first start-of-frame segment (segments are walked, never searched)."""
    at = 2
    while at + 9 <= len(raw):
        if raw[at] != 0xFF:
            return None
        marker = raw[at + 1]
        if marker == 0xFF:  # fill bytes before a marker
            at += 1
            continue
        if marker in _JPEG_SIZES:
            height, width = struct.unpack(">HH", raw[at + 5:at + 9])
            return width, height
        at += 2 + struct.unpack(">H", raw[at + 2:at + 4])[0]
    return None


def size(raw: bytes) -> tuple[str, int, int] | None:
    """The media type, width and height of a PNG, JPEG, GIF or BMP (what llama.cpp decodes); None
    for anything else."""
    if raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) >= 24:
        width, height = struct.unpack(">II", raw[16:24])
        return "image/png", width, height
    if raw[:3] == b"\xff\xd8\xff":
        found = _jpeg(raw)
        return None if found is None else ("image/jpeg", *found)
    if raw[:6] in (b"GIF87a", b"GIF89a") and len(raw) >= 10:
        width, height = struct.unpack("<HH", raw[6:10])
        return "image/gif", width, height
    if raw[:2] == b"BM" and len(raw) >= 26:
        width, height = struct.unpack("<ii", raw[18:26])
        return "image/bmp", width, abs(height)  # a negative height: rows stored top to bottom
    return None


def checked(data: Any, param: str) -> str:
    """An image given as base64 (Ollama's `images`), as the `data:` URL the request keeps.
    InvalidRequest naming `param` if it is not base64, not a PNG, JPEG, GIF or BMP, or too large."""
    if not isinstance(data, str):
        raise InvalidRequest("An image is a base64 string.", param=param, code="invalid_image")
    try:
        raw = base64.b64decode(SPACE.sub("", data), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("The image is not valid base64.", param=param, code="invalid_image") from None
    found = size(raw)
    if found is None:
        raise InvalidRequest("The image is not a PNG, JPEG, GIF or BMP file.", param=param, code="invalid_image")
    kind, width, height = found
    if width <= 0 or height <= 0 or width * height > MAX_PIXELS:
        raise InvalidRequest(f"The image is {width}x{height} pixels; at most {MAX_PIXELS:,} pixels are taken.",
                             param=param, code="image_too_large")
    return f"data:{kind};base64,{base64.b64encode(raw).decode()}"


def from_url(url: Any, param: str) -> str:
    """An image given as a URL (Responses' `image_url`, chat's `image_url.url`): a base64 `data:`
    URL, checked as `checked` does. A remote URL is refused: the app fetches nothing."""
    if not isinstance(url, str):
        raise InvalidRequest("`image_url` must be a string: a data: URL.", param=param, code="invalid_image")
    if url[:8].lower().startswith(("http://", "https://")):
        raise InvalidRequest("Images are taken as data: URLs (data:image/png;base64,...): this app fetches "
                             "nothing, so a remote URL cannot be read.", param=param, code="unsupported_image_url")
    head = DATA_URL.match(url)
    if head is None or ";base64" not in head[2].lower():
        raise InvalidRequest("`image_url` must be a base64 data: URL (data:image/png;base64,...).", param=param,
                             code="invalid_image")
    return checked(url[head.end():], param)

