"""Images as a request carries them (app/core/images.py): read only as far as the header that
says their size, checked, and kept as `data:` URLs with the request."""

from __future__ import annotations

import base64
import struct

import pytest

from app.core import images
from app.engine.request import Request
from app.errors import InvalidRequest
from tests.vision import data_url, png


def _jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + bytes(9)
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + bytes(3)
    return b"\xff\xd8" + app0 + b"\xff\xff" + sof + b"\xff\xd9"  # a fill byte before the frame's marker


def _bmp(width: int, height: int) -> bytes:
    return b"BM" + bytes(16) + struct.pack("<ii", width, height) + bytes(30)


@pytest.mark.parametrize(("raw", "kind", "size"), [
    (png(3, 5), "image/png", (3, 5)),
    (_jpeg(640, 480), "image/jpeg", (640, 480)),
    (b"GIF89a" + struct.pack("<HH", 7, 9) + bytes(10), "image/gif", (7, 9)),
    (_bmp(12, -34), "image/bmp", (12, 34)),  # rows top to bottom
])
def test_each_format_is_read_to_its_size_and_kept_as_a_data_url(raw: bytes, kind: str, size: tuple[int, int]) -> None:
    assert images.size(raw) == (kind, *size)
    encoded = base64.b64encode(raw).decode()
    spaced = "\n".join(encoded[i:i + 8] for i in range(0, len(encoded), 8))
    assert images.checked(spaced, "images[0]") == data_url(raw, kind)  # whitespace, as some clients wrap it
    assert images.from_url(data_url(raw, "application/octet-stream"), "x") == data_url(raw, kind)


@pytest.mark.parametrize(("data", "code"), [
    ("not base64!", "invalid_image"),
    (base64.b64encode(b"RIFF....WAVEfmt ").decode(), "invalid_image"),  # audio: llama.cpp would take it
    (base64.b64encode(_jpeg(1, 1)[:12]).decode(), "invalid_image"),  # no frame header
    (base64.b64encode(_jpeg(10_000, 10_000)).decode(), "image_too_large"),
    (base64.b64encode(png(0, 5)).decode(), "image_too_large"),
    (42, "invalid_image"),
])
def test_what_is_no_image_or_too_large_is_refused_naming_its_field(data: object, code: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        images.checked(data, "messages[0].images[1]")
    assert refused.value.code == code and refused.value.param == "messages[0].images[1]"


@pytest.mark.parametrize(("url", "code"), [
    ("https://example.com/a.png", "unsupported_image_url"),
    ("HTTP://example.com/a.png", "unsupported_image_url"),
    ("data:image/png," + "%89PNG", "invalid_image"),  # not base64
    ("file:///etc/passwd", "invalid_image"),
    (None, "invalid_image"),
])
def test_only_base64_data_urls_are_taken(url: object, code: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        images.from_url(url, "input[0].content[0].image_url")
    assert refused.value.code == code and refused.value.param == "input[0].content[0].image_url"


def test_images_are_stored_with_the_request_and_read_back() -> None:
    request = Request(messages=[{"role": "user", "content": "What is it?", "images": [data_url(png())]}])
    assert Request.from_json(request.to_json()) == request and request.images == 1
    with pytest.raises(ValueError):
        Request.from_json('{"messages": [{"role": "user", "content": "", "images": "data:,"}]}')
