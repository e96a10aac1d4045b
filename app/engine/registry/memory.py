"""The memory a local model takes when loaded, known before it is loaded (issue 38).

A loaded model is its weights, mapped from its file (so about the file's size), and one llama.cpp
context whose KV cache holds `parallel` sequences of the model's context each (unified, f16 keys
and values). Both are computed here from the GGUF header, so that a `parallel` or a load that
would not fit is refused with figures rather than ended by the system's OOM killer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from app.display import human_size
from app.engine.registry import gguf, models
from app.engine.registry.models import Registered

F16 = 2  # bytes of one key or value element in the cache
# llama.cpp rounds a context's cells up to a multiple of this (1000 cells are allocated as 1024).
CELL_PAD = 256
# Architectures whose state is recurrent (or partly so): their memory is not a KV cache of this
# shape, so its size is left unknown rather than guessed. Most say so by their keys too (below).
RECURRENT = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "jamba", "falcon-h1", "plamo2",
             "granitehybrid", "lfm2", "nemotron_h", "qwen3next"}
RECURRENT_KEYS = ("ssm", "wkv", "shortconv")  # <arch>.ssm.conv_kernel and the like


def _per_layer(value: Any, layers: int) -> list[int] | None:
    """A count that is one number for every layer, or one per layer."""
    if type(value) is int:
        return [value] * layers
    if isinstance(value, tuple) and len(value) == layers:
        return list(value)
    return None


def kv_bytes(metadata: Mapping[str, Any], n_ctx: int) -> int | None:
    """Bytes of the KV cache of a context of `n_ctx` cells in all (every sequence's together), as
    llama.cpp allocates it for this model; None where the header does not say enough, or the
    model keeps a recurrent state instead."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch in RECURRENT or any(
            key.startswith(f"{arch}.{mark}.") for key in metadata for mark in RECURRENT_KEYS):
        return None
    layers, embd = metadata.get(f"{arch}.block_count"), metadata.get(f"{arch}.embedding_length")
    if type(layers) is not int or type(embd) is not int or layers <= 0:
        return None
    heads = _per_layer(metadata.get(f"{arch}.attention.head_count"), layers)
    kv_heads = _per_layer(metadata.get(f"{arch}.attention.head_count_kv", metadata.get(
        f"{arch}.attention.head_count")), layers)
    if heads is None or kv_heads is None or not any(heads):
        return None
    default_head = embd // max(heads)  # as llama.cpp: n_embd / n_head when the file does not say
    key = metadata.get(f"{arch}.attention.key_length", default_head)
    value = metadata.get(f"{arch}.attention.value_length", default_head)
    if type(key) is not int or type(value) is not int:
        return None
    cells = -(-n_ctx // CELL_PAD) * CELL_PAD
    return sum(cells * n * (key + value) * F16 for n in kv_heads)


@dataclass(frozen=True)
class Memory:
    """What one loaded copy of a model takes; `kv_cache_bytes` None when it cannot be known."""
    weights_bytes: int
    kv_cache_bytes: int | None
    parallel: int

    @property
    def total_bytes(self) -> int | None:
        return None if self.kv_cache_bytes is None else self.weights_bytes + self.kv_cache_bytes

    def as_dict(self) -> dict[str, int | None]:
        return {"weights_bytes": self.weights_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "parallel": self.parallel, "total_bytes": self.total_bytes}


def model_memory(weights_bytes: int, metadata: Mapping[str, Any], context_length: int, parallel: int) -> Memory:
    """A model whose file has `weights_bytes` (mapped, so about what its weights take), served
    `parallel` sequences of `context_length` tokens at once in one context."""
    return Memory(weights_bytes, kv_bytes(metadata, parallel * context_length), parallel)


def available_bytes() -> int | None:
    """Memory this computer can give a new model now without swapping (psutil, on every system:
    Linux's MemAvailable, which counts the page cache it can drop; macOS' free and inactive
    pages; Windows' available physical memory); None where it cannot be read."""
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return None


def with_gpus(gpu_bytes: int) -> int | None:
    """`available_bytes`, and `gpu_bytes` more that the GPUs would take of a model (LMSP §18)."""
    available = available_bytes()
    return None if available is None else available + gpu_bytes


def shortfall(model: str, memory: Memory, available: int | None) -> str | None:
    """Why `model` with `memory` does not fit in `available` bytes, in words; None if it fits, or
    if either side is unknown."""
    total = memory.total_bytes
    if total is None or available is None or total <= available:
        return None
    return (f"parallel {memory.parallel} needs {human_size(total)} for {model} (weights "
            f"{human_size(memory.weights_bytes)} + KV cache {human_size(memory.kv_cache_bytes)}); this "
            f"computer has {human_size(available)} available")


def most_parallel(memory: Callable[[int], Memory], available: int, limit: int) -> int:
    """The largest `parallel` up to `limit` whose `memory(parallel)` fits in `available` (0: not
    even 1, or not known)."""
    return max((p for p in range(1, limit + 1)
                if (total := memory(p).total_bytes) is not None and total <= available), default=0)


def refusal(name: str, metadata: Mapping[str, Any], weights_bytes: int, context_length: int,
            parallel: int, gpu_bytes: int = 0) -> str | None:
    """Why the model `name` (its header's `metadata`) must not be loaded with `parallel` sequences
    of `context_length`: it would not fit in the memory available now, `gpu_bytes` on its GPUs
    included (None: it fits, or that is not known). For the engine, just before llama.cpp loads
    the file."""
    return shortfall(name, model_memory(weights_bytes, metadata, context_length, parallel), with_gpus(gpu_bytes))


def opened(file: Registered, parallel: int, gpu_bytes: int = 0) -> tuple[int, str, gguf.GgufInfo]:
    """The model file opened (and a path naming that open file), if it is the one registered and
    fits in memory (its GPUs' `gpu_bytes` included) with `parallel` contexts (refused before
    llama.cpp takes the memory: what does not fit is an OOM kill), with its header. Raises
    FileChanged, OSError, GgufError, MemoryError (it does not fit: the message says so). Blocking;
    the caller closes the descriptor."""
    fd, path = models.open_verified(file)
    try:
        info = gguf.inspect(path)
        vision = 0  # the projector's weights, loaded beside the model's
        if file.projector is not None:
            if not models.is_projector(Path(file.projector)):
                raise OSError(f"The vision projector {file.projector} registered with this model is gone or no "
                              "longer one; register the model again to use it.")
            vision = os.stat(file.projector).st_size
        too_big = refusal(os.path.basename(file.path), info.metadata, file.size_bytes + vision, file.context_length,
                          parallel, gpu_bytes)
        if too_big is not None:
            raise MemoryError(too_big)
    except BaseException:
        os.close(fd)
        raise
    return fd, path, info
