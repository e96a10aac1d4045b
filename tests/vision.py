"""A vision projector made at run time, for tests of images through the real llama-server: no small
vision model can be downloaded where the tests run, so this writes one in llama.cpp's `mmproj`
form (a `clip` GGUF, `gemma3` projector type: a SigLIP-style encoder, average-pooled, projected to
the text model's embedding size) with seeded random weights, in milliseconds and with numpy alone.

llama.cpp loads it, encodes each image with it and puts the image's tokens into the prompt: the
whole pipeline runs for real. What the model makes of those tokens is noise (it was never trained
to read them), so tests assert that the image reached the model, never what it says about it."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import numpy as np

# GGUF value types (ggml's gguf.h) and tensor type.
_U32, _F32, _BOOL, _STR, _ARR, F32_TENSOR = 4, 6, 7, 8, 9, 0
IMAGE_SIZE, PATCH, MERGE = 64, 8, 2  # 8x8 patches, pooled 2x2: 16 tokens an image
TOKENS = (IMAGE_SIZE // PATCH // MERGE) ** 2


def _text(value: str) -> bytes:
    data = value.encode()
    return struct.pack("<Q", len(data)) + data


def _kv(key: str, value: object) -> bytes:
    head = _text(key)
    if isinstance(value, bool):
        return head + struct.pack("<I?", _BOOL, value)
    if isinstance(value, int):
        return head + struct.pack("<II", _U32, value)
    if isinstance(value, float):
        return head + struct.pack("<If", _F32, value)
    if isinstance(value, str):
        return head + struct.pack("<I", _STR) + _text(value)
    assert isinstance(value, list)
    return head + struct.pack(f"<IIQ{len(value)}f", _ARR, _F32, len(value), *value)


def _tensors(width: int, ff: int, n_embd_text: int, seed: int) -> dict[str, np.ndarray]:
    """The encoder's weights, in the shapes clip.cpp reads (numpy's order: ggml's reversed)."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    ones = np.ones(width, np.float32)
    block = {"ln1.weight": ones, "ln1.bias": w(width), "ln2.weight": ones, "ln2.bias": w(width),
             "ffn_up.weight": w(ff, width), "ffn_up.bias": w(ff),
             "ffn_down.weight": w(width, ff), "ffn_down.bias": w(width)}
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        block |= {f"{name}.weight": w(width, width), f"{name}.bias": w(width)}
    return {"v.patch_embd.weight": w(width, 3, PATCH, PATCH), "v.patch_embd.bias": w(width),
            "v.position_embd.weight": w((IMAGE_SIZE // PATCH) ** 2, width),
            **{f"v.blk.0.{name}": t for name, t in block.items()},
            "v.post_ln.weight": ones, "v.post_ln.bias": w(width),
            "mm.input_projection.weight": w(width, n_embd_text), "mm.soft_emb_norm.weight": ones}


def write_projector(path: Path, n_embd_text: int, *, width: int = 32, ff: int = 64, seed: int = 0) -> Path:
    """A projector for a text model whose embeddings have `n_embd_text` dimensions (SmolLM2-135M: 576)."""
    kvs: dict[str, object] = {
        "general.architecture": "clip", "general.alignment": 32, "clip.projector_type": "gemma3",
        "clip.has_vision_encoder": True, "clip.use_gelu": True,
        "clip.vision.image_size": IMAGE_SIZE, "clip.vision.patch_size": PATCH,
        "clip.vision.embedding_length": width, "clip.vision.feed_forward_length": ff,
        "clip.vision.projection_dim": n_embd_text, "clip.vision.block_count": 1,
        "clip.vision.attention.head_count": 2, "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.image_mean": [0.5, 0.5, 0.5], "clip.vision.image_std": [0.5, 0.5, 0.5],
        "clip.vision.projector.scale_factor": MERGE}
    tensors = _tensors(width, ff, n_embd_text, seed)
    head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    for key, value in kvs.items():
        head += _kv(key, value)
    data = bytearray()
    for name, t in tensors.items():
        head += _text(name) + struct.pack(f"<I{t.ndim}Q", t.ndim, *reversed(t.shape))
        head += struct.pack("<IQ", F32_TENSOR, len(data))
        data += t.tobytes() + bytes(-t.nbytes % 32)
    head += bytes(-len(head) % 32)
    path.write_bytes(bytes(head + data))
    return path


def png(width: int = 16, height: int = 16, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A one-colour PNG."""
    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def data_url(image: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(image).decode()}"
