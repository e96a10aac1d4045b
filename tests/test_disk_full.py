"""A disk that fills up while a task runs (on a scripted engine), on a real small filesystem (a
tmpfs holding the data directory): no tight loop, the service keeps answering, and once there is
space again the task ends `failed` with `disk_full` and new work runs."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Headless, Processes, cpu_seconds, scripted_app, wait_until
from tests.helpers import COUNT, SAY_HI, http

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="mounting a small filesystem needs root")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path) -> Path:
    """A file that takes every byte left on `disk`."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as fh:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    fh.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return filler


def _cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def test_a_full_disk_neither_spins_nor_stops_the_service(small_disk: Path, procs: Processes,
                                                         tmp_path: Path) -> None:
    # Scripted engines (tests/scripted.py): the test is about the writes, not what llama.cpp writes.
    headless = Headless(small_disk / "data", procs, scripted_app(length=100_000))
    headless.log = tmp_path / "service.log"  # its stderr on a disk with room
    headless.start()
    assert headless.proc is not None
    status, created = http(f"{headless.url}/v1/responses", "POST", {"input": COUNT, "max_output_tokens": 4000,
                                                                    "temperature": 0, "background": True},
                           token=headless.token)
    assert status == 202, created
    task_id = created["task"]["id"]

    def task() -> dict[str, Any]:
        found: dict[str, Any] = http(f"{headless.url}/v1/tasks/{task_id}", token=headless.token, timeout=10)[1]
        return found

    wait_until(lambda: task()["progress"]["output_tokens"] > 20, timeout=120)
    filler = _fill(small_disk)
    last: list[int] = []

    def output_stopped() -> bool:  # the writes fail: what is stored stops growing
        last.append(task()["progress"]["output_tokens"])
        time.sleep(1)
        return len(last) > 3 and last[-1] == last[-4]

    wait_until(output_stopped, timeout=90)
    engines = headless.engine_pids()
    pids = [headless.proc.pid, *engines]
    started, burnt = time.monotonic(), _cpu_seconds(pids)
    slowest = 0.0
    for _ in range(10):
        asked = time.monotonic()
        assert http(f"{headless.url}/health", timeout=5)[0] == 200
        slowest = max(slowest, time.monotonic() - asked)
        time.sleep(0.5)
    busy = (_cpu_seconds(pids) - burnt) / (time.monotonic() - started)
    stuck = task()
    print(f"\ndisk full: the task stopped at {stuck['progress']['output_tokens']} tokens ({stuck['status']}, "
          f"attempt {stuck['attempt']}); the service and its engine used {busy:.0%} of a core; "
          f"/health answered in {slowest * 1000:.0f} ms at worst")
    assert busy < 0.2 and slowest < 1.0
    assert headless.engine_pids() == engines  # no engine restarted
    assert stuck["status"] == "running" and stuck["attempt"] == 1

    filler.unlink()
    freed = time.monotonic()
    done = wait_until(lambda: (t := task())["status"] != "running" and t, timeout=60)
    print(f"space back: the task ended {done['status']} ({done['error']}) {time.monotonic() - freed:.1f} s later")
    assert done["status"] == "failed" and done["error"]["code"] == "disk_full", done
    status, body = http(f"{headless.url}/v1/responses", "POST", SAY_HI, token=headless.token)
    assert status == 200 and body["status"] in ("completed", "incomplete"), body
    assert headless.terminate() == 0
    errors = headless.log.read_text().count("--- Logging error ---")
    print(f"{errors} log records could not be written while the disk was full")
    assert errors < 50
