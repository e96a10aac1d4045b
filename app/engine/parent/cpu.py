"""Which CPU this is: the key engine modes are remembered under, and the details a crash log needs."""

from __future__ import annotations

import hashlib
import platform
from functools import cache
from pathlib import Path

# The feature flags that decide which llama.cpp kernels run (and the ones known to crash: AMX).
NOTABLE = ("avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
           "f16c", "fma")


@cache
def describe() -> tuple[str, frozenset[str]]:
    """The CPU's model name and its feature flags (empty where /proc/cpuinfo is not there)."""
    name, flags = platform.processor() or platform.machine(), frozenset[str]()
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return name, flags
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            name = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return name, flags


@cache
def key() -> str:
    """Stable for one kind of CPU; changes when the instruction set does (e.g. a new machine)."""
    name, flags = describe()
    return f"{name} [{hashlib.sha256(' '.join(sorted(flags)).encode()).hexdigest()[:12]}]"


def summary() -> str:
    """For the log: the name and the flags that matter to llama.cpp."""
    name, flags = describe()
    return f"{name}; flags: {' '.join(f for f in NOTABLE if f in flags) or 'none of note'}"
