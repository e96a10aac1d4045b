"""A pure-Python GGUF header validator, run before llama.cpp ever opens a file.

llama.cpp's loader trusts more of the header than it should, and a crafted file can crash the
process. So every length and count is checked against the bytes the file really has before we
allocate, loop or seek, and only the header is read: inspecting a large model costs milliseconds.
"""

from __future__ import annotations

import math
import os
import re
import stat
import struct
import threading
from dataclasses import dataclass
from typing import BinaryIO

MAX_KV, MAX_TENSORS, MAX_KEY_LEN, MAX_DEPTH, MAX_GGML_TYPE = 1_000_000, 1_000_000, 65535, 3, 64
MAX_ELEMENTS = 1 << 62
# llama.cpp's own limits (ggml/src/gguf.cpp: GGUF_MAX_STRING_LENGTH, GGUF_MAX_ARRAY_ELEMENTS):
# a file past them is refused by its loader anyway, so we refuse it before looping over it.
MAX_STRING_BYTES, MAX_ARRAY_COUNT = 1 << 30, 1 << 30
# Strings (and arrays in arrays) are walked one by one, 0.1-0.4 us each: the largest real
# tokenizers hold well under 2^20 (o200k: 200k tokens and 446k merges). This bounds them in the
# whole header, together, not per array: a sparse file of many arrays of 2^22 empty strings cost
# 44 h of our CPU for 1 TiB (the 2026-12-05 red-team report); this way the walk ends within a
# second, even on a busy computer.
MAX_WALKED = 1 << 21
# The smallest a KV or tensor info can be on disk (1-byte key/name, 1-byte value or 1 dim):
# a count that would need more bytes than the file has left is rejected without looping.
MIN_KV, MIN_TENSOR = 8 + 1 + 4 + 1, 8 + 1 + 4 + 8 + 4 + 8
STRING, ARRAY = 8, 9
_SCALARS = {t: struct.Struct(f) for t, f in
            {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
             10: "<Q", 11: "<q", 12: "<d"}.items()}
_MIN_SIZE = {**{t: s.size for t, s in _SCALARS.items()}, STRING: 8, ARRAY: 4 + 8}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_NONZERO = re.compile(rb"[^\x00]")
# Arrays of integers this short are kept: a value per layer (a model's layers number in the
# hundreds at most), such as `<arch>.attention.head_count_kv` where layers differ, which the KV
# cache's size depends on. Longer ones (a tokenizer's token types) are only skipped.
_INTEGERS, MAX_KEPT_ARRAY = (0, 1, 2, 3, 4, 5, 10, 11), 1024
Value = str | int | float | bool | tuple[int, ...]
# ggml type -> (elements per block, bytes per block), copied from ggml's GGML_QUANT_SIZES.
# Types missing here (new or exotic quantisations) are still accepted, just without a size check.
BLOCK_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
               8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
               13: (256, 176), 14: (256, 210), 15: (256, 292), 24: (1, 1), 25: (1, 2),
               26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2)}
_CHUNK = 1 << 20
# A chat template's text is kept up to this (real ones are a few KB, the largest known tens of
# KB): the check made when a request is accepted renders it (app/core/templates.py). Past it the
# engine alone renders it.
MAX_TEMPLATE_BYTES = 1 << 20
# Fill-in-the-middle: the texts of the prefix, suffix and middle tokens llama.cpp looks for in a
# vocabulary whose header names none (src/llama-vocab.cpp, in its order: Qwen, StarCoder-like,
# Granite, DeepSeek, CodeLlama, GLM-4.5, Falcon-H1), and the keys that name them.
FIM_TEXTS = {
    part: [t.encode() for t in texts] for part, texts in {
        "pre": ["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"],
        "suf": ["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"],
        "mid": ["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"]}.items()}
_FIM_PART = {text: part for part, texts in FIM_TEXTS.items() for text in texts}
_FIM_LENGTHS = {len(text) for text in _FIM_PART}
FIM_KEYS = {"pre": "tokenizer.ggml.fim_pre_token_id", "suf": "tokenizer.ggml.fim_suf_token_id",
            "mid": "tokenizer.ggml.fim_mid_token_id"}


class GgufError(Exception):
    """The file is not a GGUF model we are willing to hand to llama.cpp; str() says why."""


class Cancelled(Exception):
    """Whoever asked stopped waiting (the client left, the service is stopping)."""


@dataclass(frozen=True)
class GgufInfo:
    version: int
    tensor_count: int
    kv_count: int
    architecture: str | None
    name: str | None
    context_length: int | None
    has_chat_template: bool
    file_size: int
    metadata: dict[str, Value]
    parameter_count: int = 0  # the elements of every tensor together
    chat_template: str | None = None  # its text, if at most MAX_TEMPLATE_BYTES
    # The longest token's text in bytes (0: no vocabulary): no token stands for more bytes of text
    # than its written form has, so a text of B bytes is at least B / this many tokens.
    token_bytes: int = 0
    # The ids of the fill-in-the-middle tokens (prefix, suffix, middle), where the model has all three.
    fim: tuple[int, int, int] | None = None


def _num(n: int) -> str:
    # Attack values are usually powers of two; "2^63" reads better than 9223372036854775808.
    return f"2^{n.bit_length() - 1}" if n >= 1 << 32 and n & (n - 1) == 0 else str(n)


class _Reader:
    """Forward-only reader over a window of the file; never reads or skips past `size`."""

    def __init__(self, f: BinaryIO, size: int, cancel: threading.Event | None = None) -> None:
        self._f, self.size, self._cancel = f, size, cancel
        self._buf, self._off, self._base = b"", 0, 0
        self.walk_left = MAX_WALKED  # strings and arrays in arrays this header may still have
        self.longest = 0  # the longest string of the last array of strings read
        self.fim: dict[str, int] = {}  # its first string of each FIM_TEXTS part, by index

    @property
    def pos(self) -> int:
        return self._base + self._off

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def _need(self, n: int, what: str) -> None:
        if n > self.remaining:
            raise GgufError(f"truncated: {what} at offset {self.pos} ends past the end of the file")

    def take(self, n: int, what: str) -> bytes:
        """Every loop over the header reads through here: so it is where a cancel is noticed."""
        if self._cancel is not None and self._cancel.is_set():
            raise Cancelled()
        self._need(n, what)
        if self._off + n > len(self._buf):
            rest = self._buf[self._off:]
            self._base, self._off = self.pos, 0
            self._f.seek(self._base + len(rest))
            self._buf = rest + self._f.read(max(n - len(rest), _CHUNK))
            if len(self._buf) < n:  # the file shrank after we measured it
                raise GgufError(f"truncated: {what} at offset {self.pos} could not be read")
        self._off += n
        return self._buf[self._off - n:self._off]

    def skip(self, n: int, what: str) -> None:
        self._need(n, what)
        if self._off + n <= len(self._buf):
            self._off += n
        else:  # drop the window; the next take() seeks, so a huge skip costs nothing
            self._base, self._buf, self._off = self.pos + n, b"", 0

    def skip_strings(self, count: int, what: str) -> None:
        """`count` strings, skipped; the length of the longest in `longest`, where the FIM tokens'
        texts are in `fim`. The one loop whose length the file chooses, so it runs over the
        window's bytes directly (a cancel is noticed at each new window, every megabyte at most); a
        string that crosses the window's edge takes the careful path."""
        unpack = _U64.unpack_from
        longest, index, self.fim = 0, 0, {}
        while count:
            buf, off = self._buf, self._off
            end = min(len(buf), self.size - self._base)  # never past the size measured
            walked, start = 0, off
            while off <= end - 8 and walked < count:
                start = off
                n = unpack(buf, off)[0]
                if n == 0:  # empty strings, as many as there are zeros (a sparse file's): at once
                    zeros = _NONZERO.search(buf, start, end)
                    run = min(((zeros.start() if zeros else end) - start) // 8, count - walked)
                    off, walked = start + 8 * run, walked + run
                    continue
                off += 8 + n
                if off <= end:
                    longest = max(longest, n)
                    if n in _FIM_LENGTHS:
                        self._found(buf[start + 8:off], index + walked)
                walked += 1
            if off > end:  # the last one ran past the window: back to its start
                off, walked = start, walked - 1
            self._off, count, index = off, count - walked, index + walked
            if count:
                n = self.str_len(what)
                longest = max(longest, n)
                if n in _FIM_LENGTHS:
                    self._found(self.take(n, what), index)
                else:
                    self.skip(n, what)
                count, index = count - 1, index + 1
        self.longest = longest

    def _found(self, text: bytes, index: int) -> None:
        part = _FIM_PART.get(text)
        if part is not None and part not in self.fim:
            self.fim[part] = index

    def u32(self, what: str) -> int:
        return int(_U32.unpack(self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack(self.take(8, what))[0])

    def str_len(self, what: str) -> int:
        n = self.u64(f"length of {what}")
        at = f"string length {_num(n)} at offset {self.pos - 8} ({what})"
        if n > self.remaining:
            raise GgufError(f"{at} is larger than the file" if n > self.size
                            else f"truncated: {at} runs past the end of the file")
        if n > MAX_STRING_BYTES:
            raise GgufError(f"{at} is over llama.cpp's limit of 2^30 bytes")
        return n

    def name(self, what: str) -> str:
        n = self.str_len(what)
        if not 0 < n <= MAX_KEY_LEN:
            raise GgufError(f"{what} has length {_num(n)} (must be 1 to {MAX_KEY_LEN})")
        return self.take(n, what).decode("utf-8", "replace")


def _value(r: _Reader, vtype: int, what: str, depth: int = 0) -> Value | None:
    """Reads one value; returns scalars, short strings and short arrays of integers, None for
    what we only skip."""
    if vtype in _SCALARS:
        s = _SCALARS[vtype]
        scalar: int | float | bool = s.unpack(r.take(s.size, what))[0]
        return scalar
    if vtype == STRING:
        n = r.str_len(what)
        if n > 4 * 256:  # cannot be <= 256 characters: skip without reading it into memory
            r.skip(n, what)
            return None
        text = r.take(n, what).decode("utf-8", "replace")
        return text if len(text) <= 256 else None
    if vtype != ARRAY:
        raise GgufError(f"{what} has unknown value type {vtype}")
    if depth >= MAX_DEPTH:
        raise GgufError(f"{what} nests arrays deeper than {MAX_DEPTH} levels")
    etype, start = r.u32(what), r.pos
    count = r.u64(what)
    if etype not in _MIN_SIZE:
        raise GgufError(f"{what} is an array of unknown value type {etype}")
    if etype in _SCALARS and count > MAX_ARRAY_COUNT:
        raise GgufError(f"array count {_num(count)} at offset {start} is over the limit of "
                        f"{_num(MAX_ARRAY_COUNT)} ({what})")
    if etype not in _SCALARS and count > r.walk_left:
        raise GgufError(f"array count {_num(count)} at offset {start} is over the limit of {MAX_WALKED:,} strings "
                        f"and arrays in one header, {MAX_WALKED - r.walk_left} before it ({what})")
    if count * _MIN_SIZE[etype] > r.remaining:
        raise GgufError(f"array count {_num(count)} at offset {start} cannot fit in the file ({what})")
    if etype in _INTEGERS and count <= MAX_KEPT_ARRAY:
        s = _SCALARS[etype]
        return tuple(int(n) for (n,) in s.iter_unpack(r.take(count * s.size, what)))
    if etype in _SCALARS:
        r.skip(count * _MIN_SIZE[etype], what)
        return None
    r.walk_left -= count
    if etype == STRING:
        r.skip_strings(count, f"an element of {what}")
    else:
        for i in range(count):
            _value(r, ARRAY, f"{what}[{i}]", depth + 1)
    return None


def _check_tensors(r: _Reader, tensor_count: int, alignment: int) -> int:
    """Read the tensor infos and check each tensor's shape, type, offset and size against the file;
    returns their elements together (the model's parameters)."""
    tensors: list[tuple[str, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    if tensor_count * MIN_TENSOR > r.remaining:
        raise GgufError(f"tensor_count {_num(tensor_count)} cannot fit in the rest of the file")
    for i in range(tensor_count):
        what = f"tensor info {i}"
        name = r.name(f"name of {what}")
        if name in names:
            raise GgufError(f"duplicate tensor name {name!r}")
        names.add(name)
        n_dims = r.u32(what)
        if not 1 <= n_dims <= 4:
            raise GgufError(f"tensor {name!r} has {n_dims} dimensions (must be 1 to 4)")
        dims = struct.unpack(f"<{n_dims}Q", r.take(8 * n_dims, what))
        tensors.append((name, dims, r.u32(what), r.u64(what)))

    data_start = -(-r.pos // alignment) * alignment
    parameters = 0
    for name, dims, gtype, offset in tensors:
        elements = math.prod(dims)
        parameters += elements  # Python ints cannot overflow; the cap keeps ggml's int64 safe
        if 0 in dims or elements > MAX_ELEMENTS:
            raise GgufError(f"tensor {name!r} has an invalid shape {list(dims)}")
        if gtype >= MAX_GGML_TYPE:
            raise GgufError(f"tensor {name!r} has unknown ggml type {gtype}")
        if offset % alignment:
            raise GgufError(f"tensor {name!r} offset {offset} is not aligned to {alignment} bytes")
        if data_start + offset >= r.size:
            raise GgufError(f"truncated: tensor {name!r} starts past the end of the file")
        if gtype in BLOCK_SIZES:
            block, nbytes = BLOCK_SIZES[gtype]
            if dims[0] % block:
                raise GgufError(f"tensor {name!r} row of {dims[0]} is not a multiple of block size {block}")
            if data_start + offset + elements // block * nbytes > r.size:
                raise GgufError(f"truncated: tensor {name!r} data ends past the end of the file")
    return parameters


def _parse(r: _Reader) -> GgufInfo:
    if r.size == 0:
        raise GgufError("empty file")
    if r.size < 4 or r.take(4, "magic") != b"GGUF":
        raise GgufError("not a GGUF file (bad magic)")
    version = r.u32("version")
    if version not in (2, 3):
        hint = " (big-endian file?)" if _U32.unpack(struct.pack(">I", version))[0] in (2, 3) else ""
        raise GgufError(f"unsupported GGUF version {version}{hint}; only versions 2 and 3 are supported")
    tensor_count, kv_count = r.u64("tensor count"), r.u64("metadata count")
    if kv_count > MAX_KV or kv_count * MIN_KV > r.remaining:
        raise GgufError(f"kv_count {_num(kv_count)} cannot fit in a {r.size}-byte file")
    if tensor_count > MAX_TENSORS or kv_count * MIN_KV + tensor_count * MIN_TENSOR > r.remaining:
        raise GgufError(f"tensor_count {_num(tensor_count)} cannot fit in a {r.size}-byte file")

    metadata: dict[str, Value] = {}
    seen: set[str] = set()
    has_template, template, alignment, token_bytes, fim = False, None, 32, 0, {}
    for i in range(kv_count):
        key = r.name(f"key {i}")
        if key in seen:
            raise GgufError(f"duplicate metadata key {key!r}")
        seen.add(key)
        vtype = r.u32(f"type of {key!r}")
        if key == "tokenizer.chat_template" and vtype == STRING:
            has_template, template = True, _template(r)
            continue
        value = _value(r, vtype, f"value of {key!r}")
        if key == "tokenizer.ggml.tokens":
            token_bytes, fim = r.longest, r.fim
        if key == "general.alignment":
            if vtype != 4 or not isinstance(value, int) or value == 0 or value & (value - 1):
                raise GgufError(f"general.alignment must be a uint32 nonzero power of two, not {value!r}"
                                f" of value type {vtype}")
            alignment = value
        if value is not None and key != "tokenizer.chat_template":  # a template of another type is no template
            metadata[key] = value

    parameters = _check_tensors(r, tensor_count, alignment)
    arch, model_name = (v if isinstance(v := metadata.get(k), str) else None
                        for k in ("general.architecture", "general.name"))
    ctx = metadata.get(f"{arch}.context_length") if arch else None
    ctx = ctx if type(ctx) is int and ctx > 0 else None  # bool is an int subclass: excluded
    named = {part: v for part, key in FIM_KEYS.items() if type(v := metadata.get(key)) is int}
    pre, suf, mid = ({**fim, **named}.get(part) for part in FIM_KEYS)  # llama.cpp: the header's, then the texts
    return GgufInfo(version, tensor_count, kv_count, arch, model_name, ctx, has_template, r.size, metadata,
                    parameters, template, token_bytes,
                    (pre, suf, mid) if pre is not None and suf is not None and mid is not None else None)


def _template(r: _Reader) -> str | None:
    """The chat template's text, unless it is longer than any real one (then only skipped)."""
    n = r.str_len("value of 'tokenizer.chat_template'")
    if n > MAX_TEMPLATE_BYTES:
        r.skip(n, "value of 'tokenizer.chat_template'")
        return None
    return r.take(n, "value of 'tokenizer.chat_template'").decode("utf-8", "replace")


def inspect(path: str | os.PathLike[str], cancel: threading.Event | None = None) -> GgufInfo:
    """Validates the GGUF header of `path` and returns what it says; raises GgufError if unsafe,
    Cancelled soon after `cancel` is set."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or device would block or never end
            raise GgufError("not a regular file")
        with open(path, "rb") as f:
            return read(f, cancel)
    except OSError as e:
        raise GgufError(f"cannot read the file: {e.strerror or e}") from e


def read(f: BinaryIO, cancel: threading.Event | None = None) -> GgufInfo:
    """`inspect` for a file already open (at its start): the caller may go on to hash the same bytes."""
    try:
        return _parse(_Reader(f, os.fstat(f.fileno()).st_size, cancel))
    except OSError as e:
        raise GgufError(f"cannot read the file: {e.strerror or e}") from e
