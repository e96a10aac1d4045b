"""Where llama.cpp runs a model: on a GPU (LMSP §18) or on the CPU.

The build carries a GPU backend beside its CPU variants (Vulkan here; Metal or CUDA where built
so), a library llama.cpp loads only where the machine has a driver and a device for it. `devices`
asks the build, once a run, which devices it sees (`--list-devices`); with none, a model loads
exactly as a CPU build would. `Placement` reads, from what a server says as it loads, where the
model went: how many of its layers are on the device, and how much of the device's memory its
weights, KV cache and compute buffers take.
"""

from __future__ import annotations

import functools
import logging
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

from app import paths

log = logging.getLogger(__name__)
MIB = 1024 * 1024
# What fitting layers to a GPU leaves free of its memory: the desktop and other programs use it too.
FIT_MARGIN_MIB = 1024
LIST_SECONDS = 30.0  # a driver that hangs while it is asked for its devices is taken to have none
# `  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)`
DEVICE = re.compile(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)$")
OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
USING = re.compile(r"using device (\S+) ")
# `load_tensors:      Vulkan0 model buffer size =    68.80 MiB`, and the KV cache's and compute's
BUFFER = re.compile(r"(\S+) (?:model|KV|compute|RS) buffer size =\s*([\d.]+) MiB")


@dataclass(frozen=True)
class Device:
    """A GPU the build sees: its llama.cpp name (`Vulkan0`), what it is, its memory in bytes."""
    name: str
    description: str
    total_bytes: int
    free_bytes: int


def read_devices(output: str) -> list[Device]:
    """The devices `llama-server --list-devices` printed."""
    found = (DEVICE.match(line) for line in output.splitlines())
    return [Device(m[1], m[2], int(m[3]) * MIB, int(m[4]) * MIB) for m in found if m]


@functools.cache
def devices() -> tuple[Device, ...]:
    """The GPUs this build of llama.cpp can run a model on, asked once a run (it blocks: call it in
    a thread). None where the build has no GPU backend, the machine no driver or device for it,
    or the program is missing."""
    binary = paths.llama_server()
    if binary is None:
        return ()
    try:
        done = subprocess.run([str(binary), "--list-devices"], capture_output=True, text=True,  # noqa: S603
                              timeout=LIST_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("llama-server --list-devices failed (%s): models run on the CPU", exc)
        return ()
    found = tuple(read_devices(done.stdout))
    log.info("GPU devices llama.cpp sees: %s", ", ".join(f"{d.name} ({d.description})" for d in found) or "none")
    return found


def room() -> int:
    """Bytes the GPUs can take of a model, its layers and their KV cache fitted to them: their free
    memory when the run began, less the margin fitting leaves."""
    return sum(max(0, d.free_bytes - FIT_MARGIN_MIB * MIB) for d in devices())


@dataclass
class Placement:
    """Where a loaded model is, as its server said while loading (`read`, line by line)."""
    devices: list[str] = field(default_factory=list)  # the GPUs it uses, by name
    gpu_layers: int = 0
    layers: int | None = None  # those it has in all (llama.cpp counts the output layer as one)
    buffers: dict[str, float] = field(default_factory=dict)  # MiB per buffer type (`Vulkan0`, `CPU`, ...)

    def read(self, line: str) -> None:
        if found := USING.search(line):
            self.devices.append(found[1])
        elif found := OFFLOADED.search(line):
            self.gpu_layers, self.layers = int(found[1]), int(found[2])
        elif found := BUFFER.search(line):
            self.buffers[found[1]] = self.buffers.get(found[1], 0.0) + float(found[2])

    @property
    def vram_bytes(self) -> int:
        """What it takes of the GPUs' own memory (a `Vulkan_Host` buffer is the host's)."""
        return int(sum(mib for name, mib in self.buffers.items() if name in self.devices) * MIB)

    def as_dict(self) -> dict[str, Any]:
        """The model's `processor` (LMSP §18): `device` is the GPU its layers are on, or "CPU"."""
        on_gpu = self.gpu_layers > 0 and bool(self.devices)
        return {"device": ",".join(self.devices) if on_gpu else "CPU", "gpu_layers": self.gpu_layers,
                "layers": self.layers, "vram_bytes": self.vram_bytes if on_gpu else 0}
