"""llama.cpp's CPU code, picked for the CPU it runs on.

A portable build of llama-cpp-python (`make`: GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS) ships
one CPU backend per instruction-set level, `libggml-cpu-<variant>.so`. llama.cpp loads the
best one by itself, but it looks only beside the executable and in the current folder
(python's bin/, wherever the user started us), and llama-cpp-python's wheel puts them in
`site-packages/bin/` (ggml installs backend modules to CMAKE_INSTALL_BINDIR): from a venv or
the frozen app it would find none. So we point it at the folder that has them, once, before
the first model. A native build (one CPU backend linked in) needs nothing and is left alone.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)


def lib_dir() -> Path:
    """llama_cpp/lib, where llama-cpp-python loads libllama and its libggml from."""
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent / "lib"


def variants_dir() -> Path | None:
    """Where the CPU variants are: llama_cpp/lib (the frozen app puts them there) or the
    wheel's site-packages/bin; None for a native build."""
    lib = lib_dir()
    return next((d for d in (lib, lib.parent.parent / "bin") if any(d.glob("*ggml-cpu-*"))), None)


@cache
def load() -> str | None:
    """Load the best CPU variant; its name (`haswell`, `icelake`, ...) or None for a native build."""
    folder = variants_dir()
    if folder is None:
        return None
    from llama_cpp import llama_cpp as lib

    # Through libllama's own handle: symbol lookup then reaches the libggml it was linked
    # with. Opening libggml.so by path could load a second copy (the wheel ships the same
    # library under three names), whose backend registry libllama never sees.
    load_all = lib._lib.ggml_backend_load_all_from_path
    load_all.argtypes = [ctypes.c_char_p]
    load_all.restype = None
    load_all(str(folder).encode())
    return loaded_variant()


def loaded_variant() -> str | None:
    """Which libggml-cpu-<variant> this process mapped (Linux: /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1]
        if "ggml-cpu-" in name:
            return name.split("ggml-cpu-", 1)[1].split(".", 1)[0]
    return None
