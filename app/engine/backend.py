"""llama.cpp's CPU code, picked for the CPU it runs on.

A portable build of llama-cpp-python (`make`: GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS) ships
one CPU backend per instruction-set level, `libggml-cpu-<variant>.so`, beside libllama.
llama.cpp loads the best one by itself, but it looks only beside the executable and in the
current folder (python's bin/, wherever the user started us): from a venv, a wheel or the
frozen app it would find none. So we point it at the folder that has them, once, before the
first model. A native build (one CPU backend linked in) needs nothing and is left alone.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)


def lib_dir() -> Path:
    import llama_cpp
    return Path(llama_cpp.__file__).resolve().parent / "lib"


def variants_dir() -> Path | None:
    """The folder of the CPU variants: llama_cpp/lib (the frozen app's), or the wheel's top-level
    bin/ (site-packages/bin/), where llama-cpp-python's build installs ggml's backend modules.
    None for a native build."""
    for folder in (lib_dir(), lib_dir().parent.parent / "bin"):
        if list(folder.glob("*ggml-cpu-*")):
            return folder
    return None


@cache
def load() -> str | None:
    """Load the best CPU variant; its name (`haswell`, `icelake`, ...) or None for a native build."""
    folder = variants_dir()
    if folder is None:
        return None
    # The very libggml that libllama linked (import llama_cpp, in lib_dir(), loaded it): the wheel
    # has byte-identical copies (libggml.so, libggml.so.0, ...), and dlopen of another copy would
    # load a second libggml whose backend registry llama.cpp never looks in ("no backends are
    # loaded"). On Linux that is the file named by its soname, libggml.so.<N>.
    names = {"win32": ["ggml.dll"], "darwin": ["libggml.dylib"]}.get(
        sys.platform, sorted((f.name for f in lib_dir().glob("libggml.so.*")), key=len)[:1] or ["libggml.so"])
    ggml = ctypes.CDLL(str(lib_dir() / names[0]))
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load_all_from_path(str(folder).encode())
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
